"""``add_param_group`` after construction (PyTorch Lightning's BaseFinetuning unfreezes layers with it): the
engine lays its state out once, for the parameters it was built with, so a new group means a new engine. The
state of every parameter held so far goes across in torch's format (fp32 masters, moments, each parameter's
step count, the loss scaler), the new parameters start as torch's would (no state until their first step),
and nothing else moves. If the new engine cannot be made, the old layout is rebuilt with the state it had,
and the error is raised."""
from __future__ import annotations

import torch

from . import _interop, _zoe
from ._flat import FlatState


def add_group_later(opt, param_group, add) -> None:
    """Appends ``param_group`` to a built optimizer ``opt``: ``add`` is torch's add_param_group with zoe's
    checks of the group."""
    flat = opt._flat
    if flat.world > 1 or flat.dtensor is not None:
        raise _zoe.UnsupportedError(
            "zoe.torch.OffloadOptimizer: add_param_group after construction is supported on one rank without "
            "FSDP2; here the state is partitioned across ranks. Create the optimizer with every param group "
            "(a frozen parameter is held and stepped once it has a gradient)")
    opt._after_interrupted_backward()
    if opt._engine_accumulates and any(s.accumulated for s in flat.slots):
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: add_param_group during gradient accumulation would drop zoe's fp32 sum "
            "of the micro-batches so far; call it after step(), before the next micro-batch")
    count = len(opt.param_groups)
    try:
        add(param_group)
    except BaseException:
        del opt.param_groups[count:]  # a group torch appended before zoe's checks refused it
        raise
    # The state so far, numbered as torch numbers the parameters: the new group's come last, without state.
    with torch.no_grad():
        saved = _interop.torch_state(flat, opt.param_groups)
    try:
        _rebuild(opt, saved)
    except BaseException:
        del opt.param_groups[count:]
        saved["param_groups"] = saved["param_groups"][:count]
        _rebuild(opt, saved)
        raise


def _rebuild(opt, saved: dict) -> None:
    """A new engine over ``opt.param_groups``, the old one released first (tier nvme's folder is locked by
    its owner), with ``saved`` loaded into it."""
    for h in opt._hooks:
        h.remove()
    opt._hooks = []
    old = opt._flat
    old.engine = None  # its swap files and memory go now, before the new engine takes the folder
    opt._flat = flat = FlatState()
    flat.group = old.group
    view = opt.__dict__.get("_zoe_state")
    if view is not None:
        view._flat = flat
    opt._build()
    opt._forget_iteration()
    opt._load_torch_state_dict(saved)
    opt._weights_loaded()
