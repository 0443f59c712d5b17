"""State made at a parameter's first gradient, as torch's optimizers make it (issue 51).

A parameter frozen when the optimizer is made (``requires_grad=False`` and no gradient: LoRA's base, layers a
fine-tuning unfreezes later) is not held by the engine: no fp32 master, no moments, no place in the flat
gradient buffers (``_flat.Lazy``). Holding them cost 12 bytes per element in RAM (tier ram) and 2-4 more of
gradient buffer on the device, for a base that is never stepped: PEFT LoRA given ``model.parameters()``
cost 0.7 GB for 131k trainable elements of a 58M model.

One that wants state later — ``requires_grad`` set again, or a gradient assigned — gets it at the trainer's
next call that may take it: ``zero_grad()``, ``scale_loss()``/``backward()``, ``clip_grad_norm_()`` or
``step()``. The engine is then made anew holding it too (``_regroup.rebuild_holding``: every other
parameter's state carried across bitwise in torch's format); it starts as torch's does at its first step,
from zero moments with step count 1, and its master is the model's weights then. Until its first step
``opt.state[p]`` is ``{}`` as torch's, and a state_dict has no entry for it. Wanting state
(``requires_grad``) is enough, before any gradient, so that an unfreeze followed by ``zero_grad()`` gives
the next backward its hooks: the overlap schedule overlaps that iteration too, and declared micro-batches
are summed from the first. Made at ``step()`` instead, after a backward that the overlap schedule
speculated on, that step runs as sync's (exact); after micro-batches zoe summed in fp32
(``gradient_accumulation_steps``) or gradients of offloaded parameters that left the device, it cannot be
made without losing them, and ``step()`` refuses, saying to call ``zero_grad()`` after unfreezing.

Under zoe's own partition (world > 1) and FSDP2 the engine is not made anew (add_param_group is refused
there alike): a parameter frozen at construction that wants state is refused, naming it."""
from __future__ import annotations

from . import _regroup, _zoe
from ._flat import wants_state


def materialise(opt, at_step: bool = False) -> None:
    """Makes state for the parameters ``opt`` holds nothing for that want it now (see the module's doc).
    ``at_step``: ``step()`` is to follow at once, which refuses when the engine holds this iteration's
    micro-batch sums; elsewhere they stay as they are until then (a later call, or that refusal)."""
    flat = opt._flat
    if not flat.lazy:
        return
    due = [e for e in flat.lazy if wants_state(e.param)]
    if not due:
        return
    if not flat.whole:
        raise _zoe.UnsupportedError(
            f"zoe.torch.OffloadOptimizer: {_names(opt, due)}: frozen (requires_grad=False) when this optimizer was "
            "made, so without state in zoe, and wanting a gradient now. zoe makes such state later on one rank "
            "without FSDP2 only; here the state is partitioned across ranks. Unfreeze before creating the "
            "optimizer (a parameter is then held from the start), or save the state (torch.distributed."
            "checkpoint's get_state_dict for FSDP2, every rank's state_dict() joined by "
            "zoe.torch.consolidate_state_dicts otherwise), create the optimizer anew after unfreezing and load it")
    if _regroup.holds_iteration(opt):
        if not at_step:
            return
        raise RuntimeError(
            f"zoe.torch.OffloadOptimizer: {_names(opt, due)}: frozen when this optimizer was made, and wanting "
            "state now, but zoe holds gradients of this iteration that a new engine would lose (micro-batches it "
            "summed, gradient_accumulation_steps; offloaded parameters' gradients that left the device). Nothing "
            "was stepped and the iteration was given up. Call opt.zero_grad() after unfreezing parameters and "
            "before the iteration's first backward (zoe then makes their state), and run the iteration again")
    with opt._calls:  # scale_loss() is not serialised: a state_dict() on another thread waits for the new engine
        _regroup.rebuild_holding(opt, [e.param for e in due])


def _names(opt, entries) -> str:
    """The parameters of ``entries`` as an error names them: index, shape and name where the groups have one."""
    said = []
    for e in entries[:3]:
        group = opt.param_groups[e.group]
        name = ""
        if "param_names" in group:
            first = sum(len(g["params"]) for g in opt.param_groups[:e.group])  # the group's first index
            name = f" '{group['param_names'][e.index - first]}'"
        said.append(f"parameter {e.index}{name} (shape {tuple(e.param.shape)})")
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return ", ".join(said) + more


def hold_for_load(opt, indices: set[int]) -> None:
    """Before a load whose state has state for the parameters numbered ``indices``: those of them this
    optimizer holds nothing for are held first, so that the load gives them their state (a torch.optim.AdamW
    state_dict of a run where they were trainable, or zoe's of one that held them)."""
    take = [e for e in opt._flat.lazy if e.index in indices]
    if not take:
        return
    if not opt._flat.whole:
        raise _zoe.UnsupportedError(
            f"zoe.torch.OffloadOptimizer: this state_dict has state for {_names(opt, take)}, frozen when this "
            "optimizer was made (zoe holds nothing for them); under zoe's partition or FSDP2 zoe cannot make "
            "state after construction. Create the optimizer with them trainable (requires_grad=True)")
    _regroup.rebuild_holding(opt, [e.param for e in take])
