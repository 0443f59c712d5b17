"""OffloadOptimizer's gradient intake (mixed into zoe.torch.OffloadOptimizer): the hooks that report each
gradient to the engine during backward (the overlap and delayed schedules, declared micro-batches,
offloaded parameters' windows), the taking of every gradient into the flat buffers before a step or a norm,
and the detection of gradients a trainer changed after zoe took them.

Its fields, set by ``_init_grad_intake``: ``_accumulating``, ``_accumulation_steps``, ``_reporting_pass``,
``_engine_accumulates``, ``_reported``, ``_taken_versions``, ``_window_versions``, ``_windowed_slots``,
``_hyper_pushed``, ``_warned_changed``, ``_check_changes``, ``_grad_sources``, ``_retired_grads``,
``_absent_sent``, ``_open_backwards``, ``_outstanding``. It reads the flat buffers and engine through
``self._flat`` (_flat.py) and uses the optimizer's ``_device``, ``_stream``, ``_zoe_device``, ``_options``,
``_calls``, ``_scaled``, ``_clip_once``, ``_max_grad_norm``, ``_refuse_unscaled_fp16()``, ``_sync_hyper()``
and ``_capture_edits()`` (_weight_edits.py).

An iteration ends with its step, or is given up (``_abandon_iteration``): after an exception in backward (a
hook raised, a KeyboardInterrupt), in step() before the engine stepped, or at zero_grad() after gradients
were reported, the engine drops what the iteration reported and puts back what it stepped or sent, so the
iteration can run again."""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from . import _param_offload
from ._flat import Slot


class GradIntake:
    """The gradient side of OffloadOptimizer (see the module docstring)."""

    def _init_grad_intake(self, gradient_accumulation_steps: int | None, process_group) -> None:
        self._accumulating = False
        # Micro-batches: the backward pass whose gradients the overlap/delayed engine is told of (None: not
        # known yet), whether it has been told this iteration, and the version of each bucket's gradients
        # when the engine last took them — a later version means the trainer changed them.
        self._accumulation_steps = gradient_accumulation_steps
        self._reporting_pass = gradient_accumulation_steps
        # Declared accumulation on one rank: the engine sums the micro-batches in fp32 on the host. Across
        # ranks (zoe's own data-parallel mode) the gradients accumulate in p.grad, as with torch.
        self._engine_accumulates = bool(gradient_accumulation_steps and gradient_accumulation_steps > 1
                                        and not (dist.is_available() and dist.is_initialized()
                                                 and dist.get_world_size(process_group) > 1))
        self._reported = False
        self._taken_versions: list[int] | None = None
        self._window_versions: list[int] = []  # of the windows' gradients when zoe last wrote them (Bucket)
        self._windowed_slots: list[Slot] = []
        self._hyper_pushed = False  # this iteration's hyper-parameters went to the engine at a report
        self._warned_changed = False
        self._check_changes = True  # tests turn the detection off to show that it matters
        # The engine may read a gradient where autograd put it (set_grad_sources) instead of a copy in the
        # flat buffer: one rank, zoe's own buffers (not FSDP2's), no micro-batches summed by the engine.
        self._grad_sources = False
        self._retired_grads: list = []  # gradient tensors the engine read this iteration, replaced since
        self._absent_sent = False  # the engine holds a non-empty list of parameters without a gradient
        # Backward passes that reported to zoe (autograd's graph task ids) whose end autograd has not signalled:
        # one left once backward has returned ended in an exception, which autograd signals by running none of
        # the callbacks queued in it.
        self._open_backwards: set[int] = set()
        self._outstanding = False  # the engine holds something of this iteration: reports, taken gradients
        self._grads_clipped = False  # zoe's clip_grad_norm_ multiplied p.grad this iteration (_show_clipped_grads)
        self._clip_coef = 1.0  # by what, in all, where the engine clips its own copy of the gradients
        self._absent_at_norm: set[int] = set()  # slots without a gradient when clip_grad_norm_ took the norm

    def _make_hook(self, slot: Slot) -> Callable:
        # A weak reference: the parameter holds the hook, and must not keep the optimizer (and its engine's
        # memory) alive after the trainer drops it.
        ref = weakref.ref(self)

        def hook(param):
            opt = ref()
            if opt is None:
                return
            opt._note_backward()
            if slot.windowed:
                opt._on_windowed_grad(slot)  # it cannot wait on the device, inside accumulating() too
            elif not opt._accumulating:
                opt._on_grad_accumulated(slot)
        return hook

    def _on_grad_accumulated(self, slot: Slot) -> None:
        """After autograd accumulated this backward's gradient into ``slot``. With accumulation declared, every
        micro-batch's gradient goes to the engine (added in fp32 on the host, the buffer zeroed); otherwise
        the engine is told on the reporting micro-batch (overlap: it copies and steps it during the rest of
        backward)."""
        self._adopt_grad(slot)
        slot.accumulated += 1
        passes = self._reporting_pass
        if slot.accumulated > (passes or 1) and self._open_backwards - {torch._C._current_graph_task_id()}:
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step, after one that "
                "ended in an exception without a call to the optimizer since. Call opt.zero_grad() and run the "
                "iteration again: zoe then drops what the interrupted pass reported and puts the weights back")
        if self._engine_accumulates and slot.accumulated > passes:
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step, but "
                f"gradient_accumulation_steps = {passes}: call step() after every {passes} backward passes, or "
                "create the optimizer with the number you use")
        if self._reported:
            if slot.accumulated > passes:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step, but the "
                    f"{self._options['schedule']} schedule had started this step after backward pass {passes} — "
                    "its forward ran with weights that step already changed. Pass gradient_accumulation_steps="
                    "<micro-batches per step> to OffloadOptimizer, or call step() after the same number of "
                    "backward passes each time")
            # Every accumulation is followed by its hook: the last version seen here is the end of backward's.
            self._taken_versions = self._grad_versions()
        if self._engine_accumulates or slot.accumulated == passes:
            self._report(slot, last=slot.accumulated == passes)

    def _note_backward(self) -> None:
        """In a hook: the backward pass running reports to zoe. The callback queued at its first report runs
        when it ends whole; one that raises runs none, and leaves its id in ``_open_backwards``."""
        self._outstanding = True
        task = torch._C._current_graph_task_id()
        if task in self._open_backwards:
            return
        self._open_backwards.add(task)
        ref = weakref.ref(self)

        def ended():
            opt = ref()
            if opt is not None:
                opt._open_backwards.discard(task)
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def _after_interrupted_backward(self) -> None:
        """At the trainer's next call (zero_grad, step, scale_loss/backward, clip_grad_norm_, load_state_dict):
        a backward pass that ended in an exception gives its iteration up. Not at state_dict() or read_state(),
        which another thread may call while backward runs; they read the state before the iteration anyway."""
        if self._open_backwards:
            self._abandon_iteration()

    @contextlib.contextmanager
    def _abandoned_on_error(self):
        """An exception out of the block (a backward, a closure) gives the iteration up before it propagates."""
        try:
            yield
        except BaseException:
            self._abandon_iteration()
            raise

    def _abandon_iteration(self) -> None:
        """The iteration is given up before its step: the engine drops what it reported and summed and puts
        back what it stepped or sent (abandon_iteration: state and the model's weights as before the
        iteration), and the next backward pass is the iteration's first again. Nothing is learnt from it."""
        with self._calls:
            self._open_backwards.clear()
            if not self._outstanding:
                return
            self._stream.follow()
            self._flat.engine.abandon_iteration()
            if not self._stream.ordered:
                self._zoe_device.synchronize()  # the weights it put back, before the trainer reads them
            self._absent_sent = False
            self._forget_iteration()

    def _end_iteration(self, learn: bool = True) -> None:
        """After step(), applied or refused: the next iteration counts its backward passes anew. ``learn``:
        the passes of this one tell overlap and delayed which pass reports (undeclared accumulation)."""
        passes = max((s.accumulated for s in self._flat.slots), default=0)
        if learn and self._accumulation_steps is None:
            self._reporting_pass = passes or None
        self._open_backwards.clear()
        self._scaled = False  # kept by an abandoned iteration: the one run again scales by the same scale
        self._forget_iteration()

    def _forget_iteration(self) -> None:
        self._retired_grads.clear()
        for s in self._flat.slots:
            s.accumulated = 0
            s.taken = False
            s.spilled = False
        self._reported = False
        self._outstanding = False
        self._taken_versions = None
        self._hyper_pushed = False
        self._grads_clipped = False
        self._clip_coef = 1.0
        self._absent_at_norm = set()
        if self._flat.dtensor is not None:
            self._flat.dtensor.end_iteration()
        if self._clip_once is not None:
            self._clip_once = None
            if self._flat.dtensor is None:
                self._flat.engine.set_max_grad_norm(self._max_grad_norm)

    def _on_windowed_grad(self, slot: Slot) -> None:
        """After autograd accumulated the gradient of an offloaded parameter into its window: it goes down
        now (with micro-batches declared, added into zoe's fp32 sum on the host), and the window is zeroed for
        the next parameter. p.grad holds zeros from then on."""
        self._adopt_grad(slot)
        slot.accumulated += 1
        passes = self._accumulation_steps if self._engine_accumulates else 1
        if slot.accumulated > passes:
            slot.grad_view.zero_()
            self._window_versions = self._versions_of_windows()
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step reached offloaded "
                f"parameter {slot.index} (shape {tuple(slot.shape)}), whose gradient left the device after pass "
                f"{passes}: gradients of offloaded parameters cannot accumulate in p.grad. Pass "
                "gradient_accumulation_steps=<micro-batches per step> to OffloadOptimizer (zoe then sums them in "
                "fp32 on the host), or call step() after every backward pass")
        self._push_hyper_once()
        self._stream.follow()
        for i in slot.engine_ids:
            self._flat.engine.grad_ready(i)
        if not self._stream.ordered:
            # The copy down must have read the window before the next parameter's gradient is accumulated
            # there. On CUDA the engine made torch's stream wait for it (grad_left_device), so the zeroing
            # below is ordered after it with no host wait.
            self._zoe_device.synchronize()
        slot.grad_view.zero_()
        self._window_versions = self._versions_of_windows()
        slot.taken = slot.accumulated == passes

    def _answers_clipping(self, params: list) -> bool:
        """Whether torch's clip_grad_norm_ over ``params`` is this optimizer's (_adaptations.route_clipping):
        they are its parameters, all of them but frozen ones without a gradient, and no other with a gradient.
        Over part of them, torch clips p.grad in place and step() takes the edit — impossible for gradients
        that left the device, which is an error."""
        # Parameters frozen since construction are the optimizer's too, needed only once they have a gradient
        # (which clip_grad_norm_ makes their state for, _lazy.py).
        mine = {id(s.param) for s in self._flat.slots}
        frozen = {id(e.param): e.param.grad is not None for e in self._flat.lazy}
        given = {id(p) for p in params}
        if not (mine | frozen.keys()) & given:
            return False
        foreign = {id(p) for p in params if p.grad is not None} - mine - frozen.keys()
        missing = (mine | {k for k, graded in frozen.items() if graded}) - given
        if not (foreign or missing):
            return True
        if self._flat.spills:
            raise RuntimeError(
                "zoe.torch.OffloadOptimizer: torch.nn.utils.clip_grad_norm_ over spilled gradients (spill_grads) must "
                f"be given this optimizer's parameters (e.g. model.parameters()): {len(foreign)} given with gradients "
                f"are not the optimizer's, {len(missing)} of the optimizer's are not given. Their gradients are in "
                "the spill file, not p.grad, and zoe computes the norm over all of the optimizer's")
        if any(id(s.param) in given for s in self._windowed_slots):
            raise RuntimeError(
                "zoe.torch.OffloadOptimizer: torch.nn.utils.clip_grad_norm_ over parameters that include offloaded "
                "ones (offload_parameters) must be given this optimizer's parameters (e.g. model.parameters()): "
                f"{len(foreign)} given with gradients are not the optimizer's, {len(missing)} of the optimizer's "
                "are not given. Their gradients left the device, and zoe computes the norm over all of the "
                "optimizer's")
        return False

    def _show_clipped_grads(self, norm: float, max_norm: float) -> float:
        """torch's clip_grad_norm_ multiplies every p.grad by min(1, max_norm / (norm + 1e-6)), in fp32 as
        torch computes it; zoe's answer does too, so that code reading p.grad after it sees torch's values.
        Written through ``.data`` aliases, whose version counters are their own: the trainer-edit detection
        (_note_changed_grads) sees no change. Where the engine reads p.grad itself in place (the CPU, one rank,
        no copy), it takes the clipped values again, clipping no more itself; where it holds a copy (the
        staging of a device with memory of its own, zoe's flat buffer, its fp32 sum of declared micro-batches)
        it clips the copy inside the step by every coefficient applied this iteration (``_clip_coef``), and
        the overlap keeps what it stepped when nothing was clipped. ``norm``: the engine's, of the gradients
        it holds. Returns the norm of p.grad as it was before this call, which torch's function returns."""
        flat = self._flat
        if flat.world > 1:
            # zoe's own partition reads p.grad's flat buffer in place or a reduced copy of it, by its options:
            # p.grad stays as it was, the engine clips inside the step (docs/python.md says so).
            return norm
        present = [s for s in flat.slots if not s.windowed and s.param.grad is not None]
        in_place = flat.engine.reads_grads_in_place and not self._engine_accumulates
        seen = norm if in_place else norm * self._clip_coef
        coef = torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(seen, dtype=torch.float32) + 1e-6)
        if math.isfinite(seen) and float(coef) < 1.0:  # else torch multiplies by 1: the values stay
            grads = [s.param.grad.data for s in present]
            if in_place:
                flat.engine.wait()  # the overlap's worker reads them where they are: not while they change
                # A gradient zoe copied into its flat buffer (one the engine could not read where it was) is
                # read there: clipped alike, it is p.grad's values again.
                grads += [s.grad_view.data for s in present if s.grads_at != s.param.grad.data_ptr()]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
            self._grads_clipped = True
            if in_place:
                self._take_again()
                return seen
            self._clip_coef *= float(coef)
        if not in_place and self._clip_coef < 1.0:
            # The engine's coefficient is max_norm / (norm + 1e-6): this limit makes it every one applied.
            flat.engine.set_max_grad_norm(self._clip_coef * (norm + 1e-6))
        return seen

    def _push_hyper_once(self) -> None:
        """At the iteration's first report, before the engine steps or writes anything of it: a learning-rate
        scheduler stepped after the last step() reaches the overlap schedule's speculative steps, which use
        the values of the first report (the engine redoes them if step() brings others), and the trainer's
        edits of the weights are read before zoe's writes could cover them."""
        if not self._hyper_pushed:
            self._refuse_unscaled_fp16()
            self._capture_edits()
            self._sync_hyper()
            self._hyper_pushed = True

    def _versions_of_windows(self) -> list[int]:
        return [b.window._version for b in self._flat.buckets if b.window is not None]

    def _check_windows(self) -> None:
        """Gradients that left the device cannot be changed: a trainer that clips, unscales or edits p.grad
        after backward (it finds zeros in the windows) gets an error, not a step that ignores its edit."""
        if self._versions_of_windows() == self._window_versions:
            return
        self._window_versions = self._versions_of_windows()
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: p.grad of an offloaded parameter (offload_parameters) was changed after "
            "backward, but its gradient had left the device as its backward ended (p.grad holds zeros since), "
            "so the change cannot be applied. Nothing was stepped. Let zoe clip: OffloadOptimizer("
            "max_grad_norm=...), opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm) called through torch.nn.utils (zoe answers it; a copy of torch's function bound before the "
            "optimizer existed is not); and zoe's loss scaling (loss_scale) in place of GradScaler.")

    def _report(self, slot: Slot, last: bool) -> None:
        self._push_hyper_once()
        self._stream.follow()
        for i in slot.engine_ids:
            self._flat.engine.grad_ready(i)
        if self._engine_accumulates and not self._stream.ordered:
            # Unless it works in place, the engine zeroes the buffer (or writes the sum back) on its own copy
            # stream — on the CPU too, with the delayed schedule — which torch's next backward or the
            # trainer's clipping does not wait for. On CUDA torch's stream waits for it on the device.
            self._zoe_device.synchronize()
        if last:
            self._reported = slot.taken = True
            self._taken_versions = self._grad_versions()

    def _adopt_grads(self) -> None:
        """Every gradient into the flat buffers before the engine reads them all; one the engine had read
        already that the trainer replaced by another tensor (``p.grad = ...``, or None) is a changed gradient.
        Parameters whose gradient is None are named to the engine, which leaves them as they are (torch's
        rule: not stepped, their moments and step count unchanged)."""
        self._outstanding = True  # the engine is told where the gradients are, and which are absent
        absent = [s for s in self._flat.slots if self._grad_absent(s)]
        if self._flat.dp is not None:  # every rank, every step: a rank cannot tell whether another has a None
            absent = self._flat.dp.absent_everywhere(self._flat.slots, absent)
        absent_ids = {id(s) for s in absent}
        moves: list = []  # where the engine reads gradients from, told in one call
        replaced = [s for s in self._flat.slots if id(s) in absent_ids or self._adopt_grad(s, moves)]
        self._read_grads_from(moves)
        self._window_versions = self._versions_of_windows()
        # Absent when the norm was taken and still absent: nothing the engine took has changed.
        still = absent_ids & self._absent_at_norm
        if self._check_changes and any(s.taken and id(s) not in still for s in replaced):
            self._take_again()
            self._warn_changed()
        if absent or self._absent_sent:
            self._flat.engine.set_grads_absent([i for s in absent for i in s.engine_ids])
            self._absent_sent = bool(absent)

    def _grad_absent(self, s: Slot) -> bool:
        """No gradient this iteration: p.grad is None (set so after backward too: the overlap schedule's
        speculative step of it is undone). Where the engine sums the micro-batches, or the gradient left the
        device (an offloaded parameter), one that was reported is present whatever p.grad says."""
        if s.windowed:
            return s.accumulated == 0
        if s.spilled or (self._flat.spills and self._flat.dtensor.zero_filled):
            return False  # spill_grads: in the spill file (p.grad None), or a zero spilled at step()
        if self._engine_accumulates and s.accumulated:
            return False
        return s.param.grad is None

    def _take_again(self) -> None:
        if self._grads_clipped:
            # What the engine takes now is p.grad, clipped already by zoe's clip_grad_norm_.
            self._flat.engine.set_max_grad_norm(0.0)
            self._clip_coef = 1.0
        self._flat.engine.grads_changed()
        self._taken_versions = self._grad_versions()

    def _grad_versions(self) -> list[int]:
        # A view shares its base's version counter: any in-place change of any p.grad bumps its bucket's.
        return [b.grads._version for b in self._flat.buckets]

    def _note_changed_grads(self) -> None:
        """At step(): gradients the engine took (during backward, or for clip_grad_norm_) and the trainer
        changed since are taken again — the overlap schedule's speculative steps undone and redone."""
        if self._taken_versions is None or not self._check_changes:
            return
        if self._grad_versions() == self._taken_versions:
            return
        self._take_again()
        self._warn_changed()

    def _warn_changed(self) -> None:
        """Once: what a change of the gradients after zoe took them cost (the overlap, or the fp32 sum)."""
        overlapped = self._options["schedule"] in ("overlap", "delayed")
        if self._reported and (overlapped or self._engine_accumulates) and not self._warned_changed:
            self._warned_changed = True
            cost = []
            if overlapped:
                cost.append(f"the {self._options['schedule']} schedule took them again, so this step is exact but "
                            "not overlapped")
            if self._engine_accumulates:
                cost.append(f"the step uses p.grad as edited, in {self._flat.buckets[0].dtype}, instead of zoe's fp32 "
                            "sum of the micro-batches")
            warnings.warn(
                "zoe.torch.OffloadOptimizer: the gradients changed after backward (the trainer clipped, unscaled, "
                f"edited or dropped them): {'; '.join(cost)}. To avoid this, let zoe clip: OffloadOptimizer("
                "max_grad_norm=...), opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_ called "
                "through torch.nn.utils over all of this optimizer's parameters, which zoe answers (Hugging Face's "
                "Trainer and Accelerate call it so; a copy of torch's function bound before the optimizer existed "
                "is torch's). This warning is shown once.", stacklevel=5)

    def _adopt_grad(self, s: Slot, moves: list | None = None) -> bool:
        """Makes sure the parameter's gradient is in its slot of the flat buffer (it is not when autograd
        allocated it — after ``zero_grad()``, whose default sets None — or a trainer assigned a tensor, or
        replaced its data). Returns whether it had to be brought there. As torch's optimizers, a step never
        replaces or writes ``p.grad``: a gradient of its own stays in ``p.grad`` and is copied (again once it
        changes). Only where zoe's design needs ``p.grad`` to be its buffer — micro-batches summed by the
        engine, offloaded parameters' windows, FSDP2 shards — does ``p.grad`` become the buffer's view.
        ``moves``: where to collect where the engine reads gradients from now (None: tell it now)."""
        told = moves is None
        moves = [] if told else moves
        replaced = self._take_grad(s, moves)
        if told:
            self._read_grads_from(moves)
        return replaced

    def _take_grad(self, s: Slot, moves: list) -> bool:
        g = s.param.grad
        if self._flat.spills:
            if g is not None and s.spilled:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: parameter {s.index} (shape {tuple(s.param.shape)}) has a gradient "
                    "again after its backward's went to the spill file (spill_grads), which does not sum "
                    "micro-batches: call step() after each backward, or set p.grad = None")
            if g is not None:  # set without a backward hook (by hand, or a torch that runs none): spilled now
                self._flat.dtensor.spill(s, self._flat.engine)
            elif not s.spilled and self._flat.dtensor.zero_filled:
                self._flat.dtensor.spill_zeros(s, self._flat.engine)
            return False
        if g is s.grad_view and (self._flat.dtensor is not None or g.data_ptr() == s.grad_ptr):
            return False
        if g is s.grad_view:  # p.grad.data = other: the same tensor, holding other memory now
            s.grad_view = s.bucket.grad_buffer(s)[s.offset:s.offset + s.numel].view(s.shape)
        if g is not None and g is s.own_grad and g._version == s.own_version:
            return False  # taken already, unchanged since
        if s.own_grad is not None and s.own_grad is not g:
            # The overlap schedule's worker may still read it until the step: let go of it after that.
            self._retired_grads.append(s.own_grad)
        s.own_grad = None
        if g is None:
            moves.append((s, s.grad_ptr, s.grad_view))
            s.grad_view.zero_()  # present on another rank (zoe's partitioning): a zero here
            return True
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"parameter {s.index} (shape {tuple(s.param.shape)}) has a sparse gradient; "
                               "zoe steps dense gradients (use nn.Embedding(sparse=False))")
        own = not (s.windowed or self._engine_accumulates or self._flat.dtensor is not None)
        if own and self._grad_sources and g.is_contiguous() and g.dtype == s.bucket.dtype and \
                g.device == self._device and g.numel() == s.numel:
            moves.append((s, g.data_ptr(), g))  # no copy: the engine reads it where autograd put it
        elif self._flat.dtensor is not None:
            self._flat.dtensor.copy_grad(s, g)  # a DTensor's data_ptr() is 0: its local tensor's tells
        else:
            moves.append((s, s.grad_ptr, s.grad_view))
            if g.data_ptr() != s.grad_view.data_ptr():
                s.grad_view.copy_(g)
        if own:
            s.own_grad, s.own_version = g, g._version
        else:
            _param_offload.set_grad(s.param, s.grad_view)
        return True

    def _read_grads_from(self, moves: list) -> None:
        """Points the engine at where it reads each slot's gradient, (slot, address, tensor): a tensor of the
        trainer's (kept alive by ``own_grad``, and by the engine, until it is pointed elsewhere) or the slot's
        view of zoe's flat buffer (at grad_ptr)."""
        moved = [(s, at, t) for s, at, t in moves if s.grads_at != at]
        if not moved:
            return
        self._flat.engine.set_grad_sources([i for s, _, _ in moved for i in s.engine_ids],
                                           [t for s, _, t in moved for _ in s.engine_ids])
        for s, at, _ in moved:
            s.grads_at = at
