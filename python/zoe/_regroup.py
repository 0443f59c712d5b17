"""``add_param_group`` after construction (PyTorch Lightning's BaseFinetuning unfreezes layers with it): the
engine lays its state out once, for the parameters it was built with, so a new group means a new engine. The
state of every parameter held so far goes across in torch's format (fp32 masters, moments, each parameter's
step count, the loss scaler), with the trainer's weight edits since the last step taken first; the new
parameters start as torch's would (no state until their first step); the param-group dicts, ``opt.state``'s
other entries and everything else stay the objects they were. If the new engine cannot be made, the old
layout is rebuilt with the state it had, and the error is raised."""
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
    if any(s.accumulated for s in flat.slots if s.windowed) or \
            (opt._engine_accumulates and any(s.accumulated for s in flat.slots)):
        # What only the engine holds of this iteration: micro-batch sums, gradients that left the device.
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: add_param_group between backward and step() would drop the gradients "
            "zoe holds on the host (declared micro-batches, offloaded parameters); call it after step(), "
            "before the next backward")
    count = len(opt.param_groups)
    try:
        add(param_group)
    except BaseException:
        del opt.param_groups[count:]  # a group torch appended before zoe's checks refused it
        raise
    try:
        with torch.no_grad():
            opt._take_edited_weights()  # an edit since the last step is the master that goes across
            # The state so far, numbered as torch numbers the parameters: the new group's come last, with none.
            saved = _interop.torch_state(flat, opt.param_groups)
    except BaseException:
        del opt.param_groups[count:]
        raise
    try:
        _rebuild(opt, saved)
    except BaseException as first:
        del opt.param_groups[count:]
        saved["param_groups"] = saved["param_groups"][:count]
        try:
            _rebuild(opt, saved)
        except BaseException as second:
            error = RuntimeError(
                "zoe.torch.OffloadOptimizer: add_param_group could not make the new engine "
                f"({first}), nor the old one again ({second}): this optimizer is unusable. Its state is on this "
                "exception as .state_dict (torch's format with the fp32 masters): torch.save it, and load it "
                "into a new OffloadOptimizer with load_state_dict")
            error.state_dict = saved
            raise error from second
        raise


def _rebuild(opt, saved: dict) -> None:
    """A new engine over ``opt.param_groups``, the old one released first (tier nvme's folder is locked by
    its owner), with the state ``saved`` written into it — not through load_state_dict, which would replace
    the param-group dicts a trainer holds and run its hooks."""
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
    full, steps = _interop.read_torch_state(flat, opt.param_groups, saved)
    scaler = _interop.read_loss_scale(flat, saved)
    _interop.write_torch_state(flat, full, steps)
    if scaler is not None:
        flat.engine.set_loss_scale_state(*scaler)
    opt._weights_loaded()
