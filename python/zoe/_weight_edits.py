"""OffloadOptimizer's intake of the model's weights (mixed into zoe.torch.OffloadOptimizer): the model's weights
are the truth between steps, so an edit a trainer makes to them (a load, ``copy_`` under no_grad,
``nn.init``, an EMA swap, ``p.data = other``, an offloaded parameter's ``gathered()``) becomes the master
weights at the next step.

Its fields, set by ``_init_weight_edits``: ``_weight_marks``, ``_offloads``, ``_edits``. It reads the slots and
engine through ``self._flat`` (_flat.py)."""
from __future__ import annotations

import torch

from ._flat import Slot


class WeightEdits:
    """The weights side of OffloadOptimizer (see the module docstring)."""

    def _init_weight_edits(self) -> None:
        self._weight_marks: list[tuple] = []
        self._offloads: list = []  # the parameter offloads (offload_parameters) of the slots
        self._edits: dict = {}  # id(slot) -> (slot, its weights as the trainer set them), taken at step()

    def _weight_marks_now(self) -> list:
        """What says, for each slot, that the trainer changed its weights: torch's version counter, address and
        dtype of ``p`` (a DTensor's own counter, of its local shard's address), or for an offloaded parameter
        its tier's count of ``gathered()`` write-backs. zoe's own writes go through addresses and change none.
        Run twice an iteration, so kept to one tuple per tensor."""
        local = self._flat.dtensor is not None
        return [s.tier[0].edits() if s.tier is not None else
                (s.param._version, (s.param._local_tensor if local else s.param).data_ptr(), s.param.dtype)
                for s in self._flat.slots]

    def _note_weights(self) -> None:
        self._weight_marks = self._weight_marks_now()
        # With those of the parameters zoe holds no state for yet: their tier still wants its edit checks and
        # the prefetch after each step.
        held = [*self._flat.slots, *self._flat.lazy]
        self._offloads = list({id(s.tier[0]): s.tier[0] for s in held if s.tier is not None}.values())

    def _weights_loaded(self) -> None:
        """After load_state_dict: the master weights and the model's agree, and an edit read before the load
        is not applied after it."""
        self._edits.clear()
        self._flat.weights_to_params()
        self._note_weights()

    def _capture_edits(self) -> None:
        """Reads the weights the trainer changed since zoe last took them (``load_state_dict``, ``copy_`` under
        no_grad, ``nn.init``, an EMA swap, ``p.data = other``; an offloaded parameter's through
        ``offload.gathered()``; an FSDP2 shard's through the DTensor), to become the master weights at
        step(). Called at the iteration's first gradient report, before which zoe writes no weight (the
        overlap and delayed schedules write weights into the model during backward), and again at step()
        for an edit made after backward. A parameter moved to another dtype or device is refused, naming it."""
        marks = self._weight_marks_now()
        if marks == self._weight_marks:
            return
        changed = [s for s, now, then in zip(self._flat.slots, marks, self._weight_marks) if now != then]
        if self._flat.dtensor is not None:
            self._flat.dtensor.check_storage()
        for s in changed:
            p = s.param
            if s.weight_view is not None and p.data_ptr() != s.weight_view.data_ptr():
                if p.dtype != s.weight_view.dtype or p.device != s.weight_view.device or p.shape != s.weight_view.shape:
                    raise RuntimeError(
                        f"zoe.torch.OffloadOptimizer: parameter {s.index} is now {p.dtype} {tuple(p.shape)} on {p.device}; "
                        f"the optimizer was built for {s.weight_view.dtype} {tuple(s.weight_view.shape)} on "
                        f"{s.weight_view.device} (model.to(...) or p.data = ... after creating it). Nothing was "
                        "stepped. Convert or move the model first, then create the optimizer")
                with torch.no_grad():
                    s.weight_view.copy_(p.detach())
                p.data = s.weight_view  # the new values, back in the storage the engine writes
            if s.flat_weights is not None:
                # zoe's own partition: the flat weights are what weights_to_params copies into the model after
                # a step, which a skipped step (fp16 overflow) gathers nothing into.
                with torch.no_grad():
                    s.flat_weights.copy_(s.weight_view.reshape(-1))
            self._edits[id(s)] = (s, self._current_weights(s).to("cpu", copy=True))
        self._note_weights()

    def _take_edited_weights(self) -> None:
        """Before a step: the weights the trainer changed (_capture_edits) become the master weights, never
        reverted to zoe's; what the overlap schedule stepped from the old ones during backward is undone
        first, and the step is then sync's from the new master."""
        for offload in self._offloads:
            offload.check_edits()  # an edit an offloaded parameter could not keep is refused
        self._capture_edits()
        if not self._edits:
            return
        pieces = {id(s): (begin, n) for s, begin, n in self._flat.pieces()}
        self._flat.engine.discard_speculative_steps()
        self._flat.engine.wait()
        for s, now in self._edits.values():
            if id(s) not in pieces:
                continue  # partitioned: another rank holds this parameter's state
            begin, n = pieces[id(s)]
            now = now[begin:begin + n]
            master = torch.empty(n, dtype=torch.float32)
            self._flat.engine.read_state(s.engine_ids[0], master, None, None)
            # Element by element: a weight that still is its master rounded keeps the master's extra bits
            # (a load of the same values, or of another part of the tensor); any other is the new truth.
            kept = master.to(now.dtype) == now
            if bool(kept.all()):
                continue
            self._flat.engine.write_state(s.engine_ids[0], torch.where(kept, master, now.float()), None, None)
        self._edits.clear()

    def _current_weights(self, s: Slot) -> torch.Tensor:
        """The weights the model holds for a slot now, flat."""
        if s.tier is not None:
            return s.tier[0].weights(s.param).reshape(-1)
        if self._flat.dtensor is not None:
            return s.param._local_tensor.detach().reshape(-1)
        return s.weight_view.detach().reshape(-1)
