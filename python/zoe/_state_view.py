"""``opt.state`` of zoe's OffloadOptimizer: torch's per-parameter state, read from zoe's engine."""
from __future__ import annotations

import collections.abc
import contextlib
import weakref
from typing import Callable

import torch

from ._flat import FlatState


class StateView(collections.abc.MutableMapping):
    """``opt.state`` as torch's optimizers have it: ``state[p]`` is ``{"step", "exp_avg", "exp_avg_sq"}`` for each
    parameter stepped at least once (``{}`` for the others, as torch's defaultdict gives); Lion's is ``{"step",
    "exp_avg"}``, Adagrad's ``{"step", "sum"}`` (the rule's state keys, _rules.py). The moments are
    views of zoe's own memory where it keeps them as fp32 in RAM (tier ram, ``state_dtype="fp32"``, one rank):
    reading and writing them reads and writes the optimizer's state until the next step (the overlap schedule
    steps into a second set of arrays and makes it current: take ``opt.state[p]`` again). Elsewhere (bf16 or int8 moments, tier
    nvme, a partitioned optimizer: this rank's piece, flat; FSDP2: the local shard) they are fp32 copies
    decoded when asked for —
    writing them changes nothing. Built on access; the engine's work in flight is waited for first. Keys that
    are not parameters (a hook's own entries) are kept here and travel in ``state_dict()["state"]``, as with
    torch; a parameter's entry cannot be replaced (``load_state_dict`` takes a state into the engine)."""

    def __init__(self, flat: FlatState, read_state: Callable):
        self._flat = flat
        # The optimizer's read_state, held weakly: the view must not keep the optimizer (and its engine's
        # memory) alive.
        self._read_state = weakref.WeakMethod(read_state)
        self._hidden = False
        self.extras: dict = {}

    def _slot(self, key):
        if self._read_state() is None or not isinstance(key, torch.Tensor):
            return None
        return self._flat.slot_of(key)

    def _stepped(self, s) -> int:
        return self._flat.engine.param_step_count(s.engine_ids[0]) if s.engine_ids else 0

    def __getitem__(self, key):
        s = self._slot(key)
        if s is None:
            if isinstance(key, torch.Tensor):
                return {}
            return self.extras.setdefault(key, {})  # a defaultdict(dict), as torch's
        if self._hidden or self._stepped(s) == 0:
            return {}
        engine = self._flat.engine
        engine.wait()
        names = self._flat.states  # the rule's state keys, in the engine's order (Adam: exp_avg, exp_avg_sq)
        views = [engine.moments_view(s.engine_ids[0], which) for which in range(1, len(names) + 1)]
        whole = len(s.engine_ids) == 1 and self._flat.whole  # not a piece, not a shard
        if whole and all(v is not None for v in views):
            arrays = [torch.from_numpy(x).view(s.shape) for x in views]
        else:
            st = self._read_state()(key)
            arrays = [st[k] for k in names]
        return {"step": torch.tensor(float(self._stepped(s))), **dict(zip(names, arrays))}

    def __setitem__(self, key, value) -> None:
        if self._slot(key) is not None:
            raise TypeError("zoe.torch.OffloadOptimizer: a parameter's state lives in zoe's engine and cannot be "
                            "replaced entry by entry: load a state_dict (load_state_dict), or write into the "
                            "tensors of opt.state[p] where they are views (fp32 moments in RAM)")
        self.extras[key] = value

    def __delitem__(self, key) -> None:
        if self._slot(key) is not None:
            raise TypeError("zoe.torch.OffloadOptimizer: a parameter's state lives in zoe's engine; it cannot be "
                            "deleted")
        del self.extras[key]

    def __contains__(self, key) -> bool:
        s = self._slot(key)
        if s is None:
            return key in self.extras
        return not self._hidden and self._stepped(s) > 0

    def __iter__(self):
        gone = self._read_state() is None
        params = [] if gone or self._hidden else [s.param for s in self._flat.slots if self._stepped(s) > 0]
        return iter(params + list(self.extras))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @contextlib.contextmanager
    def hidden(self):
        """Without the parameters' entries for a while: torch's state_dict() packing, which zoe fills from its
        checkpoint instead (the extras are packed as torch packs them)."""
        self._hidden = True
        try:
            yield
        finally:
            self._hidden = False


