"""OffloadOptimizer's state_dict and load_state_dict (mixed into zoe.torch.OffloadOptimizer): zoe's own format
(this rank's engine checkpoint, inline or as a file beside a trainer's checkpoint), torch.optim's format, and
every rank's state_dicts of a run of another size (_interop.py).

The state is the optimizer's FlatState (``self._flat``, _flat.py), read and written through its interface;
besides it this mixin uses torch.optim.Optimizer's own state_dict()/load_state_dict() for the param groups,
``self.state`` (_state_view.py), ``step_count``, and ``_weights_loaded()`` (_weight_edits.py) after a load.
Its own fields: ``_saved_to`` and ``_load_folder`` (save_to()/load_from())."""
from __future__ import annotations

import os

import torch

from . import _adaptations, _checks, _interop, _lazy, _rules, _scratch, _serial, _torch_flags, _zoe

_STATE_FORMAT = _interop.STATE_FORMAT


def _groups_and_extras(state_dict: dict) -> dict:
    """What torch's own load_state_dict is given: the param groups, and the state's entries that are not a
    parameter's (a hook's own), which it keeps as torch does; the parameters' state goes to the engine."""
    params = {k for g in state_dict["param_groups"] for k in g["params"]}
    extras = {k: v for k, v in state_dict.get("state", {}).items() if k not in params}
    return {"state": extras, "param_groups": state_dict["param_groups"]}


def _across_dtypes(state_dict: dict) -> dict:
    """A one-rank zoe state_dict as torch's format with the fp32 masters (``zoe_masters``), for parameters of
    other dtypes than it was saved with: zoe's checkpoint holds the device's weights in their dtype, torch's
    format the fp32 state alone, which does not depend on it. As torch's load_state_dict casts a state to its
    parameter's dtype, but kept in fp32: the masters, moments and each parameter's step go across unrounded,
    and the model's weights are set from the masters, rounded to their new dtype."""
    full = _interop.consolidate([state_dict])
    for index, st in full["state"].items():
        own = (state_dict.get("state") or {}).get(index, {})
        if "step" in own:  # consolidate gives the optimizer's step; a parameter keeps its own
            st["step"] = own["step"]
    return full


def _read_into(f, buffer: memoryview) -> int:
    """Fills ``buffer`` from ``f``; returns its size."""
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done:])
        if not n:
            raise OSError(f"{f.name}: ended {len(buffer) - done} bytes early")
        done += n
    return done


class StateDictMethods:
    """state_dict() and load_state_dict() of OffloadOptimizer, and the file-based save_to()/load_from()."""

    _saved_to: str | None = None  # save_to(): the next state_dict() refers to each rank's file there
    _load_folder: str | None = None  # load_from(): where the next load_state_dict() finds them

    @_serial.serialised
    def state_dict(self) -> dict:
        """The standard ``{"state", "param_groups"}`` plus ``"zoe"``: the engine's checkpoint (master weights,
        moments, step, loss-scale state; this rank's partition) as a uint8 tensor, and the layout it fits.
        Round-trips through ``torch.save`` / ``torch.load``. After ``save_to(folder)`` the next one carries
        no state, only where each rank's file is (what a trainer that saves on rank 0 alone needs).

        Called by ``torch.distributed.checkpoint`` (``get_state_dict`` / ``get_optimizer_state_dict``): torch's
        format instead, which it can save and reshard (see ``torch_state_dict``), with the masters in each
        parameter's state as ``zoe_master``: DTensors of this rank's shards for FSDP2, else whole tensors
        (gathered over zoe's partition; collective)."""
        flat = self._flat
        if _adaptations.called_by_distributed_checkpoint():
            return _interop.torch_state(flat, self.param_groups, masters_in_state=True)
        world, rank = flat.partition()
        folder, self._saved_to = self._saved_to, None
        live = folder is None and _adaptations.called_by_accelerate_prepare()
        if folder is None and not live:
            _adaptations.refuse_rank0_only_save(world)
        with self.state.hidden():  # torch's packing would copy every parameter's moments
            sd = super().state_dict()
        empty = torch.empty(0, dtype=torch.uint8)
        sd["zoe"] = {
            "format": _STATE_FORMAT,
            "world_size": world,
            "rank": rank,
            "layout": flat.layout(self.param_groups),
            # The engine's parameters: (parameter index, first element, elements), for consolidate_state_dicts.
            "pieces": [[s.index, begin, n] for s, begin, n in flat.pieces()] if flat.dtensor is None else None,
            # The parameters the engine holds nothing for (frozen since it was made, _lazy.py): its checkpoint
            # is of the others.
            "lazy": [e.index for e in flat.lazy],
            "checkpoint": empty,
        }
        if flat.rule is not _rules.ADAM:  # (Adam's state_dicts stay as they were before other rules existed)
            sd["zoe"]["optimizer"] = flat.rule.name
            if flat.rule.amsgrad:
                sd["zoe"]["amsgrad"] = True
        if folder is not None:
            sd["zoe"]["folder"] = folder
        elif live:
            # Accelerate's prepare() hands this straight back to load_state_dict() (after moving its tensors
            # to the device): it names this optimizer at this step instead of copying the state.
            sd["zoe"]["live"] = [id(self), self.step_count]
        else:
            self._save_engine_into(sd)
        return sd

    def _save_engine_into(self, sd: dict) -> None:
        """The engine's checkpoint into ``sd``, read from its file once, without a second copy. One rank's
        whole parameters: its fp32 moments become torch's ``state`` ({index: step, exp_avg, exp_avg_sq} for
        every parameter), which ``torch.optim.AdamW.load_state_dict`` takes, and the rest of the file is
        ``zoe.checkpoint`` with those two ranges cut out (``zoe.moments``: where they go back, for zoe's own
        load, which checks every byte against the file's checksums). A partitioned optimizer (zoe's pieces,
        FSDP2's shards) keeps the whole file in ``zoe.checkpoint``."""
        flat = self._flat
        with _scratch.scratch_file() as path:
            flat.engine.save(path, record_names=False)  # param_groups name them, as torch's do
            size = os.path.getsize(path)
            holes = []
            if flat.whole:
                index = _zoe.checkpoint_blobs(path)
                holes = sorted([*index[key], key] for key in flat.states)
            moments = {key: torch.empty(n // 4, dtype=torch.float32) for _, n, key in holes}
            blob = bytearray(size - sum(n for _, n, _ in holes))
            with open(path, "rb") as f:
                at = 0
                for offset, n, key in holes:
                    at += _read_into(f, memoryview(blob)[at:at + offset - f.tell()])
                    _read_into(f, memoryview(moments[key].numpy()).cast("B"))
                _read_into(f, memoryview(blob)[at:])
        sd["zoe"]["checkpoint"] = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        if not holes:
            return
        sd["zoe"]["moments"] = holes
        first = 0
        for s, _, n in flat.pieces():
            steps = float(flat.engine.param_step_count(s.engine_ids[0]))
            sd["state"][s.index] = {"step": torch.tensor(steps),
                                    **{key: moments[key][first:first + n].view(s.shape) for key in flat.states}}
            first += n

    @_serial.serialised
    def save_to(self, folder) -> str:
        """On every rank: writes this rank's state as ``folder/zoe/rank<r>-of-<W>.zoe`` (atomic, checksummed),
        and makes the next ``state_dict()`` refer to these files instead of carrying the state — the
        Hugging Face Trainer and Accelerate save the optimizer's state_dict from rank 0 only
        (``zoe.hf.ZoeCheckpointCallback`` and ``zoe.hf.register_accelerator_hooks`` call this). Returns the
        file written."""
        world, rank = self._flat.partition()
        folder = os.path.abspath(_checks.path("save_to", "folder", folder))
        path = _interop.rank_file(folder, rank, world)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._flat.engine.save(path)
        self._saved_to = folder
        return path

    @_serial.serialised
    def load_from(self, folder) -> None:
        """The folder the next ``load_state_dict()`` of a ``save_to`` state_dict reads this rank's file from,
        when it is no longer where it was saved (Accelerate's ``load_state(dir)`` passes it)."""
        self._load_folder = os.path.abspath(_checks.path("load_from", "folder", folder))

    @_serial.serialised
    def load_state_dict(self, state_dict) -> None:
        """Loads, over the same model:

        - a state_dict made by ``state_dict()`` of an optimizer with the same partitioning (each rank its own);
          the model's weights are set from the master weights it holds;
        - the list of every rank's ``state_dict()`` of a run of any number of ranks (or its
          ``consolidate_state_dicts``), on any number of ranks: each takes its partition;
        - a ``torch.optim.AdamW`` / ``Adam`` state_dict (or ``torch_state_dict()``'s): moments and step taken
          over, the master weights from ``zoe_masters`` when it has them, else the model's weights.

        - what ``torch.distributed.checkpoint`` loaded from a ``get_state_dict`` checkpoint (torch's format,
          keyed by parameter name; DTensors resharded to this run's mesh).

        A state that does not fit raises before anything changes. A backward pass that ended in an exception
        gives its iteration up first (``zero_grad()``'s doc)."""
        self._after_interrupted_backward()
        self._load_state_dict(state_dict)
        self._weights_loaded()

    def _load_state_dict(self, state_dict) -> None:
        if isinstance(state_dict, (list, tuple)):
            state_dict = _interop.consolidate(state_dict)
        if not isinstance(state_dict, dict):
            raise ValueError(f"load_state_dict takes a dict (or a list of every rank's), not {type(state_dict).__name__}")
        meta = state_dict.get("zoe")
        if isinstance(meta, dict) and "live" in meta:
            if meta["live"] != [id(self), self.step_count]:
                raise ValueError("this state_dict names another optimizer's live state (Accelerate's prepare() round "
                                 "trip): it carries no state of its own")
            return  # our own state, unchanged
        if meta is None:
            if "state" not in state_dict or "param_groups" not in state_dict:
                raise ValueError("this is not an optimizer state_dict: it has no 'state' and 'param_groups' (nor "
                                 "zoe's 'zoe' entry)")
            self._load_torch_state_dict(state_dict)
            return
        if meta.get("format") != _STATE_FORMAT:
            raise ValueError(f"this state_dict's 'zoe' entry is of format {meta.get('format')!r}, not {_STATE_FORMAT}")
        saved_rule = _rules.rule_of_meta(meta)
        if saved_rule is not self._flat.rule:
            saved = saved_rule.title if saved_rule is not None else meta.get("optimizer")
            raise ValueError(
                f"this state_dict was saved by an optimizer running {saved}, and this one runs "
                f"{self._flat.rule.title}: zoe does not convert one optimizer's state into another's. "
                f"{_rules.load_hint(saved_rule, self._flat.rule)}")
        world, rank = self._flat.partition()
        if "folder" in meta:
            self._load_rank_file(state_dict, world, rank)
            return
        if meta["world_size"] == 1 and self._only_dtypes_differ(meta):
            self._load_torch_state_dict(_across_dtypes(state_dict))
            return
        if (meta["world_size"], meta["rank"]) != (world, rank):
            raise ValueError(
                f"this state_dict holds the partition of rank {meta['rank']} of {meta['world_size']}; this "
                f"optimizer is rank {rank} of {world}: load each rank's own state_dict, or pass the list of all "
                f"{meta['world_size']} ranks' state_dicts (zoe.torch.consolidate_state_dicts) to load it on "
                "another number of ranks")
        self._check_layout(meta)
        self._check_groups(state_dict)
        if self._hold_as_saved(meta):
            self._load_torch_state_dict(_across_dtypes(state_dict))  # not the engine's layout: as torch's format
            return
        with _interop.blob_file(meta, state_dict.get("state")) as path:
            self._flat.engine.load(path)  # across ranks collective: the loaded shards are all-gathered
        # The param groups only, once the engine took its checkpoint (it refuses a damaged or crafted one,
        # a shape that does not hold its element count among them, before changing anything): the state is
        # the engine's (torch would copy each tensor to its parameter).
        super().load_state_dict(_groups_and_extras(state_dict))
        self._flat.hyper_unknown(len(self.param_groups))

    def _only_dtypes_differ(self, meta: dict) -> bool:
        """The state_dict is of this model with parameters of other dtypes (an fp32 run resumed in bf16)."""
        layout = self._flat.layout(self.param_groups)
        dtypes = [entry[1] for entry in layout]
        return len(meta["layout"]) == len(layout) and [e[1] for e in meta["layout"]] != dtypes and \
            [e[:1] + e[3:] for e in meta["layout"]] == [e[:1] + e[3:] for e in layout]

    def _check_layout(self, meta: dict) -> None:
        # requires_grad (the layout's third entry) may differ: a parameter frozen at one optimizer's construction
        # and not the other's is held as the checkpoint needs (_hold_as_saved).
        def essential(layout):
            return [entry[:2] + entry[3:] for entry in layout]
        layout = self._flat.layout(self.param_groups)
        if essential(meta["layout"]) == essential(layout):
            return
        if len(meta["layout"]) != len(layout):
            why = f"it holds {len(meta['layout'])} parameters, this optimizer {len(layout)}"
        else:
            i = next(k for k, (x, y) in enumerate(zip(essential(meta["layout"]), essential(layout))) if x != y)
            why = f"parameter {i} is {meta['layout'][i]} there and {layout[i]} here (shape, dtype, requires_grad)"
        raise ValueError(f"this state_dict is for a different model: {why}")

    def _hold_as_saved(self, meta: dict, convertible: bool = True) -> bool:
        """Before loading zoe's checkpoint: the parameters it has state for that this optimizer holds nothing
        for (_lazy.py) are held first. Returns whether this optimizer holds parameters the saved one did not,
        so that the engines' layouts differ: one rank's checkpoint inline (``convertible``) then goes in as
        torch's format; any other is refused."""
        lazy = set(meta.get("lazy", ()))
        _lazy.hold_for_load(self, set(range(len(meta["layout"]))) - lazy)
        more = [s.index for s in self._flat.slots if s.index in lazy]
        if not more:
            return False
        if convertible and meta["world_size"] == 1 and self._flat.whole:
            return True
        raise ValueError(
            f"this checkpoint was saved while parameters {more[:5]} had no state (frozen when its optimizer was "
            "made), and this optimizer holds them: the engines' layouts differ. Load one rank's state_dict() taken "
            "without save_to, or the ranks' state_dicts joined by zoe.torch.consolidate_state_dicts (torch's "
            "format), or create this optimizer with those parameters frozen too")

    def _check_groups(self, state_dict: dict) -> None:
        """What torch's load_state_dict refuses, checked before the engine's load so that a refusal there
        comes before anything changed too."""
        saved = state_dict.get("param_groups")
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.param_groups):
            raise ValueError(f"this state_dict has {len(saved) if isinstance(saved, (list, tuple)) else 'no'} param "
                             f"groups, this optimizer {len(self.param_groups)}")
        for k, (a, b) in enumerate(zip(saved, self.param_groups)):
            if not isinstance(a, dict) or len(a.get("params", ())) != len(b["params"]):
                raise ValueError(f"param group {k} of this state_dict does not hold as many parameters as this "
                                 "optimizer's")

    def _load_rank_file(self, state_dict: dict, world: int, rank: int) -> None:
        """A ``save_to`` state_dict: this rank's own file from the folder (each rank reads its own, whichever
        rank's state_dict the trainer loaded)."""
        meta = state_dict["zoe"]
        folder, self._load_folder = self._load_folder or meta["folder"], None
        if meta["world_size"] != world:
            raise ValueError(f"this checkpoint was saved by {meta['world_size']} ranks and this run has {world}: "
                             "load every rank's state_dict as a list (see load_state_dict) to change the number")
        self._check_layout(meta)
        path = _interop.rank_file(folder, rank, world)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"rank {rank}'s optimizer state {path} is missing: the checkpoint was saved with "
                "OffloadOptimizer.save_to (zoe.hf's callback or hooks) and each rank's file must stay beside it; if "
                "the folder moved, call opt.load_from(new_folder) before loading")
        self._check_groups(state_dict)
        self._hold_as_saved(meta, convertible=False)
        self._flat.engine.load(path)  # across ranks collective: the loaded shards are all-gathered
        super().load_state_dict(_groups_and_extras(state_dict))  # after the engine's load, as above
        self._flat.hyper_unknown(len(self.param_groups))

    def _load_torch_state_dict(self, state_dict: dict) -> None:
        _rules.refuse_other_rule(self._flat.rule, state_dict)
        for gi, g in enumerate(state_dict["param_groups"]):
            _torch_flags.check_group(g, f"param group {gi} of this state_dict")
        # A parameter this optimizer holds nothing for yet (frozen at construction) takes its state from here;
        # one never stepped there (zoe's torch_state_dict() lists those) has none to take.
        state = state_dict.get("state", {})
        keys = _interop.saved_keys(self.param_groups, state_dict)
        stepped = [state.get(k, state.get(str(k))) for k in keys]
        _lazy.hold_for_load(self, {i for i, st in enumerate(stepped) if st is not None and
                                   (not isinstance(st, dict) or float(st.get("step", 1)) != 0)})
        flat = self._flat
        full, steps = _interop.read_torch_state(flat, self.param_groups, state_dict)
        scaler = _interop.read_loss_scale(flat, state_dict)
        super().load_state_dict(_groups_and_extras(state_dict))
        for g in self.param_groups:
            g.pop("zoe_loss_scale", None)  # the engine's, not a hyper-parameter
            if "decoupled_weight_decay" in g:  # torch.optim.Adam(W)'s name for zoe's adamw
                g["adamw"] = bool(g["decoupled_weight_decay"])
        _interop.write_torch_state(flat, full, steps)
        if scaler is not None:
            flat.engine.set_loss_scale_state(*scaler)
        flat.hyper_unknown(len(self.param_groups))

    @_serial.serialised
    def save_checkpoint(self, path: str) -> None:
        """Writes this rank's state as a zoe checkpoint file (atomic, checksummed) — what ``state_dict()``
        carries — for ``zoe export``, which joins every rank's into safetensors by parameter name."""
        self._flat.engine.save(_checks.path("save_checkpoint", "path", path))

    @_serial.serialised
    def torch_state_dict(self) -> dict:
        """This optimizer's state as ``torch.optim.AdamW.load_state_dict`` takes it: full-size moments and the
        step per parameter, torch's param_groups, and zoe's fp32 masters as ``zoe_masters`` (torch ignores
        them; zoe's ``load_state_dict`` takes them, on any number of ranks), and an fp16 run's loss scaler as
        each group's ``zoe_loss_scale``. Partitioned: collective, every rank gets the whole. DTensor (FSDP2)
        parameters: DTensor moments and masters of this rank's shards, as torch's optimizers hold them."""
        return _interop.torch_state(self._flat, self.param_groups)
