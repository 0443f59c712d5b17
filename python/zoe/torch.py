"""zoe.torch — ``OffloadOptimizer``, a ``torch.optim.Optimizer`` whose fp32 master weights and Adam moments
live in zoe (pinned RAM, or NVMe) while the model keeps its own weights, in their own dtype, on its device.
``OffloadLion`` and ``OffloadAdagrad`` (_rule_optimizers.py) are the same with the engine's other update rules.

How it meets torch:

* At construction the gradients of each dtype are packed into one flat buffer on their device (``p.grad``
  becomes a view of it, so ``zero_grad`` is one fill), while each parameter keeps a storage of its own,
  which the engine writes in place: the engine reads every gradient and writes every weight at one address
  per parameter that never changes, and safetensors, Accelerate and ``torch.save`` see the model's tensors
  as the model made them. Move the model to its device *before* creating the optimizer.
* ``step()`` hands the hyper-parameters of each param group (an LR scheduler's ``group['lr']`` included) to
  the engine, then runs the engine's step with the GIL released; the updated weights are back in ``p.data``
  when it returns (one step later for ``schedule="delayed"``).
* Clipping: ``torch.nn.utils.clip_grad_norm_`` over all of an optimizer's parameters (``model.parameters()``,
  as Hugging Face's Trainer and Accelerate pass them) is answered by the optimizer's ``clip_grad_norm_``:
  zoe's norm, ``p.grad`` clipped as torch clips it but not taken for a trainer's edit
  (_adaptations.route_clipping says why). Over part of them, it is torch's, and the edit is seen at
  ``step()`` as any other.
* ``schedule="overlap"`` reports each parameter to the engine from a post-accumulate-grad hook during
  backward, so its transfer and CPU Adam overlap the rest of backward. With gradient accumulation only the
  last micro-batch's backward reports (the k-th time a parameter's gradient is accumulated since the last
  step; k is ``gradient_accumulation_steps``, or the count seen before the previous step). Gradients a
  trainer changes after backward (its own ``clip_grad_norm_``, ``GradScaler.unscale_``, any in-place edit)
  are seen by torch's version counters at ``step()``, and the engine then takes them again, undoing what it
  stepped speculatively: the step is exactly ``sync``'s.
* With ``torch.distributed`` initialised, each rank owns 1/W of every flat buffer: gradients are averaged
  (reduce-scatter, or all-reduce where the backend lacks it, as gloo does), the rank steps its shard, and
  the weights are all-gathered.
* Parameters offloaded with ``offload_parameters`` live in their parameter tier; the step writes their new
  weights there. On a GPU their gradients leave the device as each one's backward ends (into zoe's fp32
  sum on the host, with declared micro-batches): all of them take turns in one window on the device, as
  large as the largest, and ``p.grad`` holds zeros after backward. Clipping therefore goes through zoe:
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` — what Hugging Face's Trainer and Accelerate
  call — is answered by the optimizer's ``clip_grad_norm_`` while such an optimizer exists; an edit of
  ``p.grad`` zoe cannot apply (GradScaler's unscaling, a copy of torch's clipping) makes ``step()`` raise,
  stepping nothing.
* DTensor parameters (torch FSDP2, ``fully_shard``) are partitioned already: each rank's engine steps its
  local shards in place, and only the gradient norm and skip decisions are agreed across the mesh
  (``_dtensor.py``).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import (_adaptations, _data_parallel, _dtensor, _flat, _grad_intake, _interop, _lazy, _options,
               _param_offload, _regroup, _rules, _scratch, _serial, _state_dict, _stream, _torch_flags, _weight_edits,
               _zoe)
from ._flat import Bucket
from ._param_offload import full_shape, offload_parameters
from ._state_view import StateView

__all__ = ["OffloadOptimizer", "OffloadLion", "OffloadAdagrad", "offload_parameters", "full_shape"]


def _cpu_device():
    """The engine's device for a model on the CPU: the CPU itself, stepped in place. Tests put the host
    stand-in (``zoe.host_device``: memory of its own and copy streams, as a GPU has) in its place to run the
    paths of a device with its own memory without one."""
    return _zoe.cpu_device()


class OffloadOptimizer(_state_dict.StateDictMethods, _grad_intake.GradIntake, _weight_edits.WeightEdits,
                       torch.optim.Optimizer):
    """Adam/AdamW with its state offloaded to zoe. A drop-in for ``torch.optim.AdamW`` (``adamw=True``, the
    default) or ``torch.optim.Adam`` with L2 decay (``adamw=False``).

    Args beyond AdamW's:
        tier: ``"ram"`` (pinned host memory) or ``"nvme"`` (swap files under ``nvme_path``).
        nvme_path: a folder, or a list of folders on several drives, for the NVMe tier.
        durability: tier nvme — ``"step"`` (default): each step's writes are made durable (fdatasync and
            tile table) in the background, beside the next forward/backward; after a crash the swap files
            hold the last step or the one before, whole. ``"checkpoint"``: no fdatasync per step, the swap
            files are made durable at ``state_dict()``/save only; after a crash they may be refused (never
            used wrong) — resume from the last checkpoint, as a new optimizer does anyway.
        keep_resident: tier nvme — when the whole state fits in ``buffer_count`` tiles, keep it in those
            buffers between steps (True, the default): a step reads nothing from the swap files and its writes
            finish during the next forward/backward (a write that fails is made again from RAM by the next
            step, or that step fails, changing nothing). False: every step streams its tiles from the files.
        schedule: ``"sync"``, ``"overlap"`` (transfers and CPU Adam during backward) or ``"delayed"``
            (the CPU step runs beside the next forward/backward, one step stale, after
            ``delayed_warmup_steps`` sync steps).
        max_grad_norm: clip the global gradient norm (``torch.nn.utils.clip_grad_norm_`` semantics).
        refuse_non_finite: a NaN/Inf gradient without fp16 loss scaling makes ``step()`` raise
            ``zoe.InvalidArgumentError`` naming the parameters, and nothing changes; ``False`` lets it
            propagate into the weights, as ``torch.optim.AdamW`` does.
        loss_scale: ``None`` — dynamic fp16 loss scaling when any parameter is fp16, none otherwise;
            ``"dynamic"``; a number — a static scale; ``False`` — none. Multiply the loss by
            ``opt.loss_scale`` (or call ``opt.backward(loss)``); an overflow skips the step, as GradScaler does.
        gradient_accumulation_steps: backward passes (micro-batches) per ``step()``. Declared (> 1), each
            micro-batch's gradient is added into an fp32 sum on the host as backward produces it, ``p.grad``
            is zeroed for the next one, and after the last ``p.grad`` holds the sum rounded to its dtype
            (what a trainer that clips or logs it sees) while the step uses the fp32 sum — unless the
            trainer changes ``p.grad``, whose edited values are then stepped. ``None``: gradients accumulate
            in ``p.grad`` in its dtype, as with torch, and the count seen before the previous step tells
            the overlap and delayed schedules which backward pass is the last (the first step runs as sync).
        process_group: the data-parallel group (default: the world, when torch.distributed is initialised).
            Each rank owns 1/W of the optimizer state: it steps that part and the weights are all-gathered
            (the engine's partitioned step, over torch.distributed; schedule ``sync``).
        reduce_grads: ``True``: zoe averages the gradients over ``process_group`` before stepping (each rank
            ran backward on its own batch, with no wrapper). ``False``: they are averaged already — pass it
            with ``DistributedDataParallel``, whose backward averages them; zoe then only partitions the
            state (as ``ZeroRedundancyOptimizer`` does beside DDP). The first step checks the choice: unequal
            gradients across ranks with ``False`` are an error, equal ones with ``True`` a warning (averaging
            them again is right but costs an all-reduce per step).
        isa, threads, tile: the CPU kernel's instruction set, worker threads, elements per unit of work (a
            piece: what one copy and one Adam call handle). ``tile=None``: 4M elements on a CUDA device with
            tier ram, 1M elsewhere — on an H100 the gradients came down at 0.67 of plain copies' speed in 1M
            pieces and 0.87 in 4M ones (docs/performance.md); tier nvme's tiles stay 1M (its RAM buffers).
        state_dtype: how the Adam moments are kept: ``"fp32"``; ``"bf16"`` (8 bytes less per parameter in
            RAM, or 4 bytes less of NVMe traffic each way on tier nvme; each moment rounded to nearest even
            after its fp32 update); or ``"int8"`` (2 bytes per parameter and an fp32 scale per 2048
            elements, in RAM or in the swap files: m linear in its block's largest, v an 8-bit float
            relative to its block's largest). The master weights stay fp32, and
            ``read_state``/``state_dict`` give fp32 values.
        spill_grads: tier nvme with FSDP2 (sync, no declared micro-batches): each shard's gradient goes to a
            file beside the swap files as its backward ends, and ``p.grad`` is None after it; the step reads
            them back window by window (docs/param-offload.md). Clip with ``max_grad_norm`` or
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, which zoe answers.

    With torch FSDP2 (``fully_shard``; the parameters are DTensors): pass ``model.parameters()`` after
    ``fully_shard``, on every rank. zoe steps each rank's local shards in place (with ``CPUOffloadPolicy``
    they are host memory already) and does not partition again; ``max_grad_norm``, ``clip_grad_norm_`` and
    the NaN/Inf refusal act on the global norm over the mesh, as FSDP2's ``clip_grad_norm_`` does, which a
    trainer may call instead. ``state_dict()`` holds this rank's shards: each rank saves and loads its own
    with ``torch.save``; or ``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` save
    and load it with the model, resharded to another mesh if need be. The schedules run as
    ``sync`` (a warning says so): torch's foreach ops on DTensor gradients do not bump version counters, so
    a trainer's edit after backward could not be seen. Every parameter must be a DTensor on one mesh,
    sharded or replicated alike; anything else is refused at construction.
    """

    _rule = _rules.ADAM  # the engine's update rule and its torch keys (_rules.py); the subclasses name theirs

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, adamw: bool = True, tier: str = "ram", nvme_path=None,
                 schedule: str = "sync", max_grad_norm: float | None = None, *, loss_scale=None,
                 initial_scale: float = 2.0 ** 16, growth_interval: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, delayed_warmup_steps: int = 10, process_group=None,
                 isa: str = "auto", threads: int = 0, tile: int | None = None, buffer_count: int = 4,
                 block_size: int = 1 << 20, queue_depth: int = 8, refuse_non_finite: bool = True,
                 durability: str = "step", keep_resident: bool = True,
                 gradient_accumulation_steps: int | None = None,
                 reduce_grads: bool = True, state_dtype: str = "fp32",
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None, spill_grads: bool = False):
        _torch_flags.check_hyper(lr, betas, eps, weight_decay)
        if decoupled_weight_decay is not None:
            if not adamw and decoupled_weight_decay:
                raise ValueError("adamw=False and decoupled_weight_decay=True contradict each other: pass one of them")
            adamw = bool(decoupled_weight_decay)
        options = dict(tier=tier, nvme_path=nvme_path, schedule=schedule, max_grad_norm=max_grad_norm,
                       loss_scale=loss_scale, initial_scale=initial_scale, growth_interval=growth_interval,
                       hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                       delayed_warmup_steps=delayed_warmup_steps, isa=isa, threads=threads, tile=tile,
                       buffer_count=buffer_count, block_size=block_size, queue_depth=queue_depth,
                       refuse_non_finite=refuse_non_finite, durability=durability, keep_resident=keep_resident,
                       state_dtype=state_dtype, spill_grads=spill_grads, process_group=process_group,
                       gradient_accumulation_steps=gradient_accumulation_steps, reduce_grads=reduce_grads)
        # torch.optim.AdamW's keys, so that torch reads these groups as its own (state_dict, schedulers).
        if amsgrad:  # a third state array for every parameter (_rules.AMSGRAD)
            self._rule = _rules.AMSGRAD
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw,
                        decoupled_weight_decay=adamw, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        fused=fused, capturable=capturable, differentiable=differentiable)
        self._start(params, defaults, options)

    def _start(self, params, defaults: dict, options: dict) -> None:
        """What every rule's constructor shares: ``defaults`` are its torch param-group keys, ``options`` zoe's
        keywords by name (this class's __init__ names them all, with their defaults)."""
        process_group, schedule, reduce_grads = options.pop("process_group"), options["schedule"], options.pop("reduce_grads")
        gradient_accumulation_steps = options.pop("gradient_accumulation_steps")
        _options.check_keywords(options, gradient_accumulation_steps, reduce_grads)
        _torch_flags.check_group(defaults, type(self).__name__)
        self._built = False
        self._calls = threading.RLock()  # _serial.serialised: one public call at a time
        self._flat = flat = _flat.FlatState()  # the engine and the flat buffers, filled in by _build
        super().__init__(params, defaults)
        self._options = options
        # DTensor parameters (FSDP2) are partitioned already: the engine steps this rank's shards, world 1.
        flat.dtensor = _dtensor.ShardedParams.detect(self.param_groups, process_group)
        if flat.dtensor is not None:
            self._options["schedule"] = flat.dtensor.schedule(schedule)
        flat.group = process_group
        if flat.dtensor is None and dist.is_available() and dist.is_initialized():
            flat.group = process_group if process_group is not None else dist.group.WORLD
            flat.world = dist.get_world_size(flat.group)
            flat.rank = dist.get_rank(flat.group)
        if flat.world > 1 and schedule != "sync":
            warnings.warn(
                f"zoe.torch.OffloadOptimizer: schedule='{schedule}' runs as 'sync' across {flat.world} ranks — "
                "zoe's partitioned step reduces the gradients once backward has ended, and overlapping it with "
                "backward is not supported yet. The steps are exact, not overlapped.", stacklevel=2)
            self._options["schedule"] = "sync"
        self._init_grad_intake(gradient_accumulation_steps, process_group)
        self._init_weight_edits()
        self._clip_once: float | None = None  # clip_grad_norm_'s max_norm for the coming step
        self._reduce = reduce_grads
        self._hooks = []
        self._timing = {"engine_s": 0.0, "adapter_s": 0.0, "comm_s": 0.0, "steps": 0}
        self._scaled = False  # this iteration's loss was scaled by zoe's loss scale (fp16)
        self._build()
        self._built = True

    # The engine and flat buffers are the FlatState's (_flat.py); tests and zoe.bench read them here.
    _engine = property(lambda self: self._flat.engine)
    _buckets = property(lambda self: self._flat.buckets)
    _slots = property(lambda self: self._flat.slots)

    @property
    def state(self) -> StateView:
        """torch's per-parameter state, read from zoe (``StateView``)."""
        view = self.__dict__.get("_zoe_state")
        if view is None:
            view = self.__dict__["_zoe_state"] = StateView(self._flat, self.read_state)
        return view

    @state.setter
    def state(self, value) -> None:
        """torch.optim.Optimizer sets its own dict at construction; zoe's state lives in its engine."""

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict ends here: the parameters' state went to the engine; entries of other keys
        # (a hook's) are kept, as torch keeps them.
        state = dict(state)
        loaded = state.pop("state", None)
        super().__setstate__(state)
        if loaded is not None and "_zoe_state" in self.__dict__:
            self.state.extras = {k: v for k, v in loaded.items() if not isinstance(k, torch.Tensor)}

    # ---- construction ---------------------------------------------------------------------------------

    @_serial.serialised
    def add_param_group(self, param_group: dict) -> None:
        """As torch's, at any time: after construction the engine is made anew for the new parameters, and
        the state of the others goes across unchanged (_regroup.py)."""
        if getattr(self, "_built", False):
            _regroup.add_group_later(self, param_group, self._add_group)
        else:
            self._add_group(param_group)

    def _add_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict):
            self._rule.prepare(param_group)
        super().add_param_group(param_group)
        self._rule.check(self.param_groups[-1], f"param group {len(self.param_groups) - 1}")

    def _build(self) -> None:
        flat = self._flat
        flat.rule = self._rule
        self._device, self._zoe_device = _stream.devices_of(self.param_groups, _cpu_device)
        self._stream = _stream.TorchStream(self._zoe_device, self._device)
        slots_by_dtype = flat.collect_slots(self.param_groups)
        if self._options["spill_grads"] and flat.dtensor is None:
            raise _zoe.UnsupportedError(
                "zoe.torch.OffloadOptimizer: spill_grads is for FSDP2-sharded models (fully_shard, one rank "
                "included), whose gradient shards zoe takes from FSDP2 one by one as backward ends")
        if flat.world > 1 and any(s.tier is not None for s in flat.slots):
            raise _zoe.UnsupportedError(
                "zoe.torch.OffloadOptimizer: offloaded parameters (offload_parameters) with zoe's own data-parallel "
                "partition are not supported: the engine cannot gather weights into a parameter tier. Shard the "
                "model with FSDP2's fully_shard, whose shards zoe offloads per rank")
        if flat.dtensor is not None:
            flat.buckets = flat.dtensor.make_buckets(slots_by_dtype, self._device, self._options["spill_grads"])
            self._make_engine()
            self._hooks += flat.dtensor.adopt_grads(flat, weakref.ref(self))
            if flat.dtensor.spills:  # p.grad is None after backward: torch's clipping would see nothing
                _adaptations.route_clipping(self._answers_clipping)
            self._note_weights()
            return
        # On a device with memory of its own, offloaded parameters' gradients leave it as each one's backward
        # ends (docs/architecture.md, "Parameters off the device"): on CUDA they take one window's memory,
        # not theirs.
        for s in flat.slots:
            s.windowed = s.tier is not None and not self._zoe_device.host_memory
        self._windowed_slots = [s for s in flat.slots if s.windowed]
        if flat.world == 1:
            _adaptations.route_clipping(self._answers_clipping)
        flat.buckets = [Bucket(dt, self._device, slots, flat.world) for dt, slots in slots_by_dtype.items()]
        if flat.world > 1:
            flat.dp = _data_parallel.DataParallel(flat.group, self._device, self._reduce)
        flat.fill_buckets()
        self._make_engine()
        self._grad_sources = flat.world == 1 and not self._engine_accumulates
        hook_all = self._options["schedule"] in ("overlap", "delayed") or self._engine_accumulates
        if flat.world == 1:
            for s in flat.slots:
                # A frozen parameter has no hook (torch refuses one); unfrozen later, it is taken at step().
                if (hook_all or s.windowed) and s.param.requires_grad:
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_hook(s)))
        self._window_versions = self._versions_of_windows()
        self._note_weights()

    def _make_engine(self) -> None:
        _scratch.remove_abandoned()  # what killed saves of earlier runs left
        flat = self._flat
        opts, self._max_grad_norm, flat.loss_scaling = _options.engine_options(
            self._options, partition=flat.partition(),
            accumulation_steps=self._accumulation_steps if self._engine_accumulates else 1,
            reduce=self._reduce, sharded=flat.dtensor is not None, dtypes=[b.dtype for b in flat.buckets],
            cuda=self._device.type == "cuda")
        groups = [self._rule.group_hyper(g) for g in self.param_groups]
        specs, tiered = flat.engine_specs(self.param_groups)
        collectives = flat.dp.collectives if flat.dp is not None else None
        engine_groups = [dict(h, optimizer=self._rule.name) for h in groups]
        flat.engine = _zoe.Engine(self._zoe_device, engine_groups, specs, opts, collectives, tiered)
        flat.hyper_sent = [self._rule.hyper_key(h) for h in groups]

    def _sync_hyper(self) -> None:
        for gi, group in enumerate(self.param_groups):
            h = self._rule.group_hyper(group)
            key = self._rule.hyper_key(h)
            if key != self._flat.hyper_sent[gi]:
                self._flat.engine.set_hyper(gi, **h)
                self._flat.hyper_sent[gi] = key

    @torch.no_grad()
    @_serial.serialised
    def step(self, closure: Callable[[], Any] | None = None):
        """Applies one Adam step to every parameter; returns the closure's loss when given one."""
        if _adaptations.called_to_initialise_state():
            return None  # zoe's state exists already; a step with zero gradients would decay the moments
        self._after_interrupted_backward()  # then p.grad is stepped as it is, as torch does
        loss = None
        if closure is not None:
            with torch.enable_grad(), self._abandoned_on_error():
                loss = closure()
        if self._flat.dp is not None and self._timing["steps"] == 0:
            _adaptations.refuse_trainer_without_callback(self, self._flat.world)
        t0 = time.perf_counter()
        comm = engine_s = 0.0
        stepping = False  # an exception before the engine's step leaves the iteration as it was: given up
        try:
            _lazy.materialise(self, at_step=True)  # state for a parameter frozen at construction, unfrozen since
            self._refuse_unscaled_fp16()
            self._take_edited_weights()
            self._check_windows()
            self._note_changed_grads()
            self._adopt_grads()
            self._sync_hyper()
            if self._flat.dp is not None:
                self._flat.dp.check_reduction(self._flat.buckets)
            if self._flat.dtensor is not None:
                tc = time.perf_counter()
                max_norm = self._clip_once if self._clip_once is not None else self._max_grad_norm
                refuse = self._options["refuse_non_finite"] and not self._flat.loss_scaling
                self._flat.dtensor.agree(self._flat, max_norm, refuse)
                comm += time.perf_counter() - tc
            self._stream.follow()
            te = time.perf_counter()
            stepping = True
            self._flat.engine.step()
            stepping = "applied"
            if not self._stream.ordered:
                # torch computes on the host at once: the device's copies (the weights up; with the delayed
                # schedule, the gradients down on a stand-in's own threads) must be done before the caller
                # reads the weights, zero_grad() or the next backward. On CUDA torch's stream waits instead.
                self._zoe_device.synchronize()
            self._flat.weights_to_params()
            for offload in self._offloads:
                offload.after_step()
            engine_s = time.perf_counter() - te
        except BaseException:
            # The engine's step refused spilled gradients: they go, and the iteration runs again.
            if not stepping or (self._flat.spills and stepping != "applied"):
                self._abandon_iteration()
            raise
        finally:
            self._end_iteration(learn=stepping)  # a refused step ends the iteration too: the next one counts anew
        total = time.perf_counter() - t0
        tm = self._timing
        tm["engine_s"] += engine_s
        tm["comm_s"] += comm
        tm["adapter_s"] += total - engine_s - comm
        tm["steps"] += 1
        return loss

    def _refuse_unscaled_fp16(self) -> None:
        """fp16 loss scaling divides each gradient by the scale: a loss that was not multiplied by it (a plain
        ``loss.backward()``, or torch's GradScaler) would be stepped 65536 times too small, silently."""
        if not self._flat.loss_scaling or self._scaled:
            return
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: this optimizer scales the fp16 loss (loss_scale="
            f"{self._options['loss_scale']!r}: {self._flat.engine.loss_scale:g} now), but this iteration's loss was "
            "not scaled by it, and the step would divide the gradients by it. Nothing was stepped. Call "
            "opt.backward(loss) (or opt.scale_loss(loss).backward(), or multiply the loss by opt.loss_scale) — or, to "
            "use torch's GradScaler or no scaling, create the optimizer with loss_scale=False")

    @torch.no_grad()
    @_serial.serialised
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of this optimizer, for the coming step:
        returns the total norm of the (unscaled) gradients, computed by zoe, and clips the step by
        ``max_norm / (norm + 1e-6)`` when that is below 1: ``p.grad`` is multiplied by it as torch's function
        does, and the step is AdamW's on the clipped gradients (_grad_intake._show_clipped_grads: how, and why
        the overlap schedule keeps its overlap when nothing was clipped). ``max_norm=inf`` returns the norm and
        clips nothing; with the optimizer's own ``max_grad_norm`` the tighter of the two applies. Other ``norm_type`` values clip ``p.grad`` in place with torch (exact,
        not overlapped; not with offloaded parameters on a GPU, whose gradients left the device)."""
        max_norm = float(max_norm)
        if not max_norm >= 0:
            raise ValueError(f"max_norm = {max_norm} is invalid: need >= 0 (inf: the norm, no clipping)")
        self._after_interrupted_backward()
        _lazy.materialise(self)  # a parameter frozen at construction with a gradient now is in the norm
        if float(norm_type) != 2.0:
            if self._windowed_slots or self._flat.spills:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: clip_grad_norm_ with norm_type={norm_type} over offloaded "
                    "parameters (offload_parameters) or spilled gradients (spill_grads) is not supported: their "
                    "gradients left the device as their backward ended, and zoe computes the 2-norm only")
            return _adaptations.torch_clip_grad_norm_([s.param for s in self._flat.slots], max_norm,
                                                      norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
        limit = min(max_norm, self._max_grad_norm) if self._max_grad_norm > 0 else max_norm
        self._check_windows()
        self._note_changed_grads()
        self._adopt_grads()
        for s in self._flat.slots:
            s.taken = True
        # A parameter without a gradient (LoRA's frozen base, an unused one) that is still without one at
        # step() is no change, and the overlap stays; one that has a gradient by then is (_adopt_grads).
        self._absent_at_norm = {id(s) for s in self._flat.slots if self._grad_absent(s)}
        if self._flat.dtensor is not None:
            norm = self._flat.dtensor.global_norm(self._flat.engine)
        else:
            if self._flat.dp is not None:
                self._flat.dp.check_reduction(self._flat.buckets)
            self._flat.engine.set_max_grad_norm(limit if math.isfinite(limit) else 0.0)
            self._stream.follow()
            norm = self._flat.engine.grad_norm()
            if math.isfinite(limit):
                norm = self._show_clipped_grads(norm, limit)
        self._clip_once = limit
        self._taken_versions = self._grad_versions()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({norm}), "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32, device=self._device)

    @_serial.serialised
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: ``set_to_none=True`` (the default) sets every ``p.grad`` to None, and a parameter whose
        gradient is still None at ``step()`` is not stepped. autograd then allocates each new gradient, which
        zoe copies into its flat buffer when it takes it. ``set_to_none=False`` zeroes the flat buffers in
        place (one fill per dtype; backward accumulates straight into them, no copy): every parameter then has
        a gradient, zero where backward gave none, and is stepped — as with torch. Offloaded parameters'
        gradients (``offload_parameters`` on a GPU) are zeroed either way: they leave the device as backward
        reports them, and one that was not reported is not stepped. Gradients reported to zoe since the last
        step (a backward that ended in an exception, or one whose step is not to come) are dropped with what
        zoe stepped or sent from them: weights and state are as before the iteration, which may run again."""
        self._abandon_iteration()
        if self._flat.dtensor is not None:
            self._flat.dtensor.zero_filled = not set_to_none  # spill_grads: zeros spilled for shards without one
        _lazy.materialise(self)  # a parameter unfrozen since: its state, and its hooks for the next backward
        for b in self._flat.buckets:
            if b.window is not None:
                b.window.zero_()
            if not set_to_none:
                b.grads.zero_()
        self._window_versions = self._versions_of_windows()
        # The engine reads zoe's buffers again before the trainer's gradient tensors are let go.
        self._read_grads_from([(s, s.grad_ptr, s.grad_view) for s in self._flat.slots if s.own_grad is not None])
        for s in self._flat.slots:
            s.own_grad = None
            if set_to_none and not s.windowed:
                _param_offload.set_grad(s.param, None)
            elif s.param.grad is not s.grad_view and (s.param.grad is not None or s.windowed):
                # Zeroed where backward accumulates without a copy; torch leaves a None gradient None.
                _param_offload.set_grad(s.param, s.grad_view)

    # ---- loss scaling ---------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """What this iteration's loss must be multiplied by before backward (1.0 without loss scaling). Reading
        it counts as scaling this iteration's loss (step() refuses an fp16 loss that zoe's scale never reached)."""
        self._scaled = True
        return float(self._flat.engine.loss_scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._after_interrupted_backward()
        _lazy.materialise(self)
        self._scaled = True
        return loss * self.loss_scale if self._flat.loss_scaling else loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the loss scale applied. An exception out of it (a hook's, a KeyboardInterrupt)
        gives the iteration up at once: the weights and state are as before it, and it may run again."""
        scaled = self.scale_loss(loss)
        with self._abandoned_on_error():
            scaled.backward(**kwargs)

    @property
    def last_step_skipped(self) -> bool:
        """True when the last step found an fp16 overflow and changed nothing (the scale was lowered)."""
        return bool(self._flat.engine.last_step_skipped)

    @contextlib.contextmanager
    def accumulating(self):
        """Micro-batches inside this context only accumulate gradients: the overlap schedule reports them
        to the engine on the backward outside it, the last one before step()."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ---- inspection -----------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return int(self._flat.engine.step_count)

    def stats(self) -> dict:
        """The engine's counters (steps, skipped, last_grad_norm — of the gradients the step used, so on the CPU
        after clip_grad_norm_ clipped them in place, the clipped ones —, adam_s, step_call_s, d2h/h2d bytes) and the
        adapter's own time: ``engine_s`` inside the engine's step (zoe's own partitioning communicates there),
        ``comm_s`` in torch.distributed outside it (FSDP2's global norm), ``adapter_s`` the rest of step();
        ``device_grad_bytes``, the gradient buffers the adapter keeps on the model's device; ``state_elements``,
        the elements this rank's engine holds state for; ``host_waits_trainer``/``host_wait_trainer_s`` the
        times (and seconds) a trainer's thread waited for zoe's device since it was made,
        ``host_waits_worker``/``host_wait_worker_s`` zoe's own threads'."""
        s = dict(self._flat.engine.stats(), **self._timing, state_elements=sum(self._flat.engine.state_sizes))
        s.update(_stream.host_wait_stats(self._zoe_device))
        s["device_grad_bytes"] = sum(
            (b.grads.numel() + (b.window.numel() if b.window is not None else 0)) * b.grads.element_size()
            for b in self._flat.buckets)
        return s

    @_serial.serialised
    def read_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fp32 master weights and moments zoe holds for ``param`` (this rank's part of it: a flat tensor
        when the optimizer is partitioned, else shaped like ``param``)."""
        s = self._flat.slot_of(param)
        if s is None:
            raise KeyError("this parameter has no state here: not this optimizer's, or frozen since it was made")
        out = self._flat.read_state(s)
        if self._flat.world == 1:
            shape = param._local_tensor.shape if self._flat.dtensor is not None else _param_offload.full_shape(param)
            out = {k: v.view(shape) for k, v in out.items()}
        return out

    def __deepcopy__(self, memo):
        raise TypeError(
            "zoe.torch.OffloadOptimizer cannot be deep-copied: its state lives in zoe's engine (pinned memory or "
            "swap files) and writes the weights of the very parameters it was given, so a copy could not be "
            "independent. Create another OffloadOptimizer and load this one's state_dict() into it")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "zoe.torch.OffloadOptimizer cannot be pickled: its state lives in zoe's engine, not in the object. "
            "Save opt.state_dict() (torch.save) and load it into a new optimizer with load_state_dict()")

    def __del__(self):
        for h in getattr(self, "_hooks", []):
            h.remove()


# Checkpoints across runs of different sizes and out of zoe (_interop.py).
consolidate_state_dicts = _interop.consolidate
export_fp32 = _interop.export_fp32
# The other rules' optimizers subclass OffloadOptimizer (defined above) and share everything but the rule.
from ._rule_optimizers import OffloadAdagrad, OffloadLion  # noqa: E402
