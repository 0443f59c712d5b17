"""A new engine after construction, for ``add_param_group`` (PyTorch Lightning's BaseFinetuning unfreezes layers
with it) and for parameters frozen when the engine was made that want state now (_lazy.py): the engine lays
its state out once, for the parameters it was built with, so more parameters mean a new engine. The state of
every parameter held so far goes across in torch's format (fp32 masters, moments, each parameter's step
count, the loss scaler), with the trainer's weight edits since the last step taken first; the new parameters
start as torch's would (no state until their first step); the param-group dicts, ``opt.state``'s other
entries and everything else stay the objects they were. If the new engine cannot be made, the old layout is
rebuilt with the state it had, and the error is raised."""
from __future__ import annotations

import torch

from . import _interop, _param_offload, _zoe
from ._flat import FlatState, wants_state


def holds_iteration(opt) -> bool:
    """Whether the engine holds gradients of this iteration that only it has — micro-batch sums it adds up,
    offloaded parameters' gradients that left the device — which a new engine would lose."""
    flat = opt._flat
    return any(s.accumulated for s in flat.slots if s.windowed) or \
        (opt._engine_accumulates and any(s.accumulated for s in flat.slots))


def add_group_later(opt, param_group, add) -> None:
    """Appends ``param_group`` to a built optimizer ``opt``: ``add`` is torch's add_param_group with zoe's
    checks of the group."""
    flat = opt._flat
    if flat.world > 1 or flat.dtensor is not None:
        raise _zoe.UnsupportedError(
            "zoe.torch.OffloadOptimizer: add_param_group after construction is supported on one rank without "
            "FSDP2; here the state is partitioned across ranks. Create the optimizer with every param group, "
            "the parameters to unfreeze later trainable (requires_grad=True) then")
    opt._after_interrupted_backward()
    if holds_iteration(opt):
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
    # The new group's parameters that want state, and those frozen before that want it now; a frozen one
    # waits for its first gradient here too.
    new = [p for p in opt.param_groups[-1]["params"] if wants_state(p)] + \
        [e.param for e in flat.lazy if wants_state(e.param)]

    def undo():
        del opt.param_groups[count:]
    rebuild_holding(opt, new, undo)


def rebuild_holding(opt, params, undo=None) -> None:
    """A new engine holding what ``opt``'s holds and ``params``, the state carried across. If it cannot be
    made, ``undo()`` puts the param groups back as they were and the old layout is made again with its
    state."""
    try:
        with torch.no_grad():
            opt._take_edited_weights()  # an edit since the last step is the master that goes across
            # The state so far, numbered as torch numbers the parameters: the new ones have none.
            saved = _interop.torch_state(opt._flat, opt.param_groups)
    except BaseException:
        if undo is not None:
            undo()
        raise
    held = {id(s.param) for s in opt._flat.slots}
    try:
        _rebuild(opt, saved, held | {id(p) for p in params})
    except BaseException as first:
        if undo is not None:
            undo()
            saved["param_groups"] = saved["param_groups"][:len(opt.param_groups)]
        try:
            _rebuild(opt, saved, held)
        except BaseException as second:
            error = RuntimeError(
                "zoe.torch.OffloadOptimizer: could not make the engine for the new parameters "
                f"({first}), nor the old one again ({second}): this optimizer is unusable. Its state is on this "
                "exception as .state_dict (torch's format with the fp32 masters): torch.save it, and load it "
                "into a new OffloadOptimizer with load_state_dict")
            error.state_dict = saved
            raise error from second
        raise


def _rebuild(opt, saved: dict, hold: set[int]) -> None:
    """A new engine over ``opt.param_groups`` holding the parameters whose ids are in ``hold``, the old one
    released first (tier nvme's folder is locked by its owner), with the state ``saved`` written into it — not
    through load_state_dict, which would replace the param-group dicts a trainer holds and run its hooks."""
    for h in opt._hooks:
        h.remove()
    opt._hooks = []
    # The gradient tensors in p.grad: the new engine's flat buffers take their values, and p.grad is then given
    # back the tensor it was (step() never replaces p.grad, as torch's), which the engine adopts as any
    # trainer's gradient — unless zoe sums the micro-batches, which needs p.grad to be its buffer.
    grads = [(p, p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]
    old = opt._flat
    old.engine = None  # its swap files and memory go now, before the new engine takes the folder
    opt._flat = flat = FlatState()
    flat.group = old.group
    flat.hold = hold
    view = opt.__dict__.get("_zoe_state")
    if view is not None:
        view._flat = flat
    opt._build()
    if not opt._engine_accumulates:
        windowed = {id(s.param) for s in opt._windowed_slots}
        for p, g in grads:
            if id(p) not in windowed:
                _param_offload.set_grad(p, g)
    opt._forget_iteration()
    full, steps = _interop.read_torch_state(flat, opt.param_groups, saved)
    scaler = _interop.read_loss_scale(flat, saved)
    _interop.write_torch_state(flat, full, steps)
    if scaler is not None:
        flat.engine.set_loss_scale_state(*scaler)
    opt._weights_loaded()
