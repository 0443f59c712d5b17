"""What zoe's OffloadOptimizer adapts to in the trainers and libraries that drive it, in one place.

``ADAPTATIONS`` names each upstream function whose use of an optimizer zoe answers differently from a plain
``torch.optim`` optimizer, why, and how zoe tells that call from others: by a mechanism (what the call
itself passes through) where one exists, else by the caller found on the stack, with the reason no mechanism
works. The functions below are the only places that inspect the stack or replace a function of another
package.

Not listed: what makes OffloadOptimizer a torch.optim.Optimizer (torch's param-group flags, _torch_flags.py;
``opt.state``, _state_view.py; ``__setstate__``, where torch's load_state_dict ends) — torch's own contract,
which every caller gets alike — and zoe.hf, the callback and hooks a user hands to a trainer."""
from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch


class Adaptation(NamedTuple):
    upstream: str  # the function, as its package names it
    why: str
    how: str  # "mechanism: ..." or "caller detection: ... (why no mechanism works)"
    where: str  # the function here that does it, and who calls that


ADAPTATIONS: list[Adaptation] = [
    Adaptation(
        "torch.nn.utils.clip_grad_norm_",
        "Trainers clip through it, over model.parameters(), after backward (Hugging Face's Trainer also to log "
        "the norm with max_grad_norm=0). Done by torch it writes every p.grad (by 1 when nothing is clipped), "
        "an edit zoe cannot tell from a trainer's: the overlap and delayed schedules lose their overlap, "
        "declared micro-batches lose zoe's fp32 sum, and offloaded parameters' "
        "gradients are no longer in p.grad on a GPU. zoe answers it with the optimizer's clip_grad_norm_.",
        "mechanism: the function in torch.nn.utils is replaced (trainers look it up there at each call) by "
        "one that answers a call over exactly one optimizer's parameters and hands any other to torch's. "
        "A trainer that bound torch's function earlier gets torch's, and zoe sees the edit at step().",
        "route_clipping, from OffloadOptimizer._build (one rank, not FSDP2)"),
    Adaptation(
        "torch.nn.utils.clip_grads_with_norm_ (torch >= 2.6)",
        "Accelerate (1.16: Accelerator.clip_grad_norm_, which Hugging Face's Trainer calls) clips with "
        "get_total_norm and then this function rather than clip_grad_norm_: the same write to every p.grad, "
        "with the same costs.",
        "mechanism: replaced in torch.nn.utils as clip_grad_norm_ is (Accelerate imports it at each call). Over "
        "exactly one optimizer's parameters with the norm zoe answered get_total_norm with, the optimizer's "
        "clip_grad_norm_ answers it; any other call (a norm zoe did not give, other parameters) is torch's, and "
        "zoe sees the edit at step().",
        "route_clipping, from OffloadOptimizer._build (one rank, not FSDP2)"),
    Adaptation(
        "torch.nn.utils.get_total_norm (torch >= 2.6)",
        "Accelerate 1.16 takes the norm it clips with, and that the Trainer logs, with it over p.grad: scaled "
        "by zoe's fp16 loss scale, zeros where offloaded parameters' gradients left the device, in bf16 for "
        "bf16 gradients.",
        "mechanism: replaced in torch.nn.utils (Accelerate imports it at each call). Over exactly the p.grad "
        "of one optimizer's parameters the 2-norm is the optimizer's (clip_grad_norm_ with no limit of its "
        "own); any other call is torch's.",
        "route_clipping, from OffloadOptimizer._build (one rank, not FSDP2)"),
    Adaptation(
        "accelerate.optimizer.AcceleratedOptimizer.__init__ (Accelerator.prepare)",
        "It calls state_dict(), moves every tensor in it to the device (move_to_device) and hands it straight "
        "back to load_state_dict(): a round trip that needs no copy of the state, which would cost a save of "
        "the whole engine state and put its moments on the GPU.",
        "caller detection: the round trip passes no argument, flag or hook that tells it from a state_dict() "
        "taken to save, and state_dict() must return a full snapshot to every other caller (a lazy or "
        "non-tensor state object would change what state_dict() gives them). The state_dict then names this "
        "optimizer at this step ({'zoe': {'live': ...}}, a list move_to_device leaves as it is), and "
        "load_state_dict() takes it as our own state, unchanged.",
        "called_by_accelerate_prepare, from OffloadOptimizer.state_dict"),
    Adaptation(
        "torch.distributed.checkpoint.state_dict._get_optim_state_dict / _load_optim_state_dict "
        "(get_state_dict, get_optimizer_state_dict, set_state_dict, set_optimizer_state_dict)",
        "They keep only 'state' and 'param_groups' of the optimizer's state_dict(), with tensors they can "
        "save and reshard: zoe's own format keeps the state in 'zoe', which they would drop. zoe gives torch's "
        "format, with the fp32 masters in each parameter's state as 'zoe_master'.",
        "caller detection: they call the optimizer's plain state_dict() with no argument (only "
        "_patched_state_dict, which replaces the optimizer's state_dict by theirs, goes the other way). "
        "load_state_dict() needs none: torch's format is told by its lack of a 'zoe' entry.",
        "called_by_distributed_checkpoint, from OffloadOptimizer.state_dict"),
    Adaptation(
        "torch.distributed.checkpoint.state_dict._init_optim_state",
        "It steps with zero gradients and lr 0 to make a torch optimizer create its state. zoe's state exists "
        "from construction; the step would decay Adam's moments and advance the step count.",
        "caller detection: it steps unless optim.state is non-empty or some p.grad is set; zoe's state view "
        "is empty before the first step, as torch's is, and making it non-empty would change what "
        "len(opt.state) and `if opt.state` tell every other caller. step() then returns at once.",
        "called_to_initialise_state, from OffloadOptimizer.step"),
    Adaptation(
        "transformers.trainer.Trainer._save_optimizer_and_scheduler, "
        "accelerate.checkpointing.save_accelerator_state",
        "They save state_dict() from rank 0 only; a partitioned optimizer's state_dict() holds one rank's "
        "partition, so the others' would be lost. Refused, naming zoe.hf's callback and hooks (after "
        "save_to() the state_dict names each rank's file instead, and is not refused).",
        "caller detection: state_dict() cannot tell a rank-0-only save from a save every rank makes; the "
        "mechanism is zoe.hf's callback and hooks, and this names them when they are missing.",
        "refuse_rank0_only_save, from OffloadOptimizer.state_dict"),
    Adaptation(
        "transformers.trainer.Trainer._inner_training_loop",
        "With checkpoints due (save_strategy other than 'no') and no zoe.hf.ZoeCheckpointCallback for this "
        "optimizer, a partitioned optimizer's checkpoints would lack the other ranks' state. Refused at the "
        "first step, where every rank can stop together, rather than at the first save, on rank 0 alone.",
        "caller detection: the trainer (its args and callbacks) is reached only through its frame; the "
        "optimizer is not told which trainer drives it.",
        "refuse_trainer_without_callback, from OffloadOptimizer.step"),
]


def _callers(depth: int = 10) -> list[tuple[str, str]]:
    """(module, function) of the frames above the caller, nearest first."""
    out, frame = [], sys._getframe(1)
    while frame is not None and len(out) < depth:
        out.append((frame.f_globals.get("__name__", ""), frame.f_code.co_name))
        frame = frame.f_back
    return out


def called_by_accelerate_prepare() -> bool:
    """state_dict() called by Accelerate's AcceleratedOptimizer (prepare()), which moves it to the device and
    loads it straight back: a round trip that needs no copy of the state (and must not put it on a GPU)."""
    return any(module == "accelerate.optimizer" and name == "__init__" for module, name in _callers())


def called_by_distributed_checkpoint() -> bool:
    """A call from torch.distributed.checkpoint's get_/set_(optimizer_)state_dict: they keep only "state" and
    "param_groups" of an optimizer's state_dict, with tensors they can save and reshard — torch's format."""
    return any(module.startswith("torch.distributed.checkpoint") for module, _ in _callers(16))


def called_to_initialise_state() -> bool:
    """step() from torch.distributed.checkpoint's _init_optim_state, which steps with zero gradients and lr 0
    to make a torch optimizer create its state. zoe's state exists from construction; Adam's moments would
    decay and the step count advance."""
    return any(module.startswith("torch.distributed.checkpoint") and name == "_init_optim_state"
               for module, name in _callers(12))


# The trainers' save paths that call state_dict() on rank 0 only (transformers' Trainer; Accelerate's
# save_state, which writes the main process's state_dict).
_RANK0_SAVERS = {("transformers.trainer", "_save_optimizer_and_scheduler"),
                 ("accelerate.checkpointing", "save_accelerator_state")}


def refuse_rank0_only_save(world: int) -> None:
    """A partitioned optimizer's state_dict() holds one rank's partition: saved from rank 0 alone, the others'
    would be lost. Refused at save time, naming the fix."""
    if world > 1 and any(caller in _RANK0_SAVERS for caller in _callers()):
        raise RuntimeError(
            f"zoe.torch.OffloadOptimizer: the trainer saves state_dict() from rank 0 only, but each of the {world} "
            "ranks holds its own partition of the optimizer state, so the checkpoint would lack the others'. With "
            "transformers' Trainer add the callback: Trainer(..., callbacks=[zoe.hf.ZoeCheckpointCallback(opt)]); "
            "with Accelerate: zoe.hf.register_accelerator_hooks(accelerator, opt). Each rank then saves its own "
            "file beside the checkpoint.")


def refuse_trainer_without_callback(opt, world: int) -> None:
    """On every rank at the first step of a partitioned optimizer (``opt``, over ``world`` ranks) under
    transformers' Trainer that will save checkpoints: without zoe.hf.ZoeCheckpointCallback only rank 0's
    partition would be saved. Refused here, where every rank can stop together, rather than at the first
    save, where rank 0 alone would."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "transformers.trainer" and frame.f_code.co_name == "_inner_training_loop":
            break
        frame = frame.f_back
    if frame is None:
        return
    trainer = frame.f_locals.get("self")
    strategy = str(getattr(getattr(trainer, "args", None), "save_strategy", "no"))
    if strategy.lower().endswith("no"):
        return
    from .hf import ZoeCheckpointCallback

    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    if any(isinstance(c, ZoeCheckpointCallback) and c.optimizer is opt for c in callbacks):
        return
    raise RuntimeError(
        f"zoe.torch.OffloadOptimizer: transformers' Trainer saves the optimizer's state_dict() from rank 0 only, "
        f"but each of the {world} ranks holds its own partition of the optimizer state, so its checkpoints "
        "would lack the others'. Add the callback: Trainer(..., callbacks=[zoe.hf.ZoeCheckpointCallback(opt)]); "
        "each rank then saves its own file beside the checkpoint.")


# torch's own, kept before zoe routes it to its optimizers (route_clipping).
torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
# Each answering optimizer's answers_clipping(params) -> bool, held weakly: a route must not keep an
# optimizer (and its engine's memory) alive.
_answering: list[weakref.WeakMethod] = []


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` while an OffloadOptimizer exists: over exactly one optimizer's
    parameters — what trainers pass, ``model.parameters()`` — it is that optimizer's ``clip_grad_norm_``,
    which computes the norm of the gradients zoe takes and clips ``p.grad`` as torch does without it
    counting as a trainer's edit. Any other call is torch's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for ref in list(_answering):
        answers = ref()
        if answers is not None and answers(params):
            return answers.__self__.clip_grad_norm_(max_norm, norm_type=norm_type,
                                                    error_if_nonfinite=error_if_nonfinite)
    return torch_clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                 foreach=foreach)


# torch's get_total_norm and clip_grads_with_norm_ (torch >= 2.6; None before), kept as clip_grad_norm_ is.
torch_get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
torch_clip_grads_with_norm_ = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
# The norm zoe last answered get_total_norm with, and whose: (weak reference to the optimizer, value). A
# clip_grads_with_norm_ given that norm is the same caller's clip (Accelerate stacks the per-mesh norms, so
# the tensor is a new one of the same value).
_answered_norm: list[tuple[weakref.ref, float]] = []


def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.get_total_norm`` while an OffloadOptimizer exists: the 2-norm of exactly the p.grad of
    one optimizer's parameters is that optimizer's norm (``clip_grad_norm_(inf)``, which clips nothing but
    by the optimizer's own max_grad_norm): the gradients it takes, unscaled from zoe's loss scale, also where
    they left p.grad (offloaded parameters on a device with memory of its own: p.grad holds zeros). What
    Accelerate 1.16 clips with and Hugging Face's Trainer logs. Any other call is torch's."""
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    _answered_norm.clear()
    if float(norm_type) == 2.0 and grads:
        given = {id(g) for g in grads}
        for ref in list(_answering):
            answers = ref()
            opt = answers.__self__ if answers is not None else None
            if opt is not None and given == {id(s.param.grad) for s in opt._flat.slots if s.param.grad is not None}:
                norm = opt.clip_grad_norm_(float("inf"), error_if_nonfinite=error_if_nonfinite)
                _answered_norm.append((weakref.ref(opt), float(norm)))
                return norm
    return torch_get_total_norm(grads, norm_type, error_if_nonfinite, foreach)


def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """``torch.nn.utils.clip_grads_with_norm_`` while an OffloadOptimizer exists: over exactly one optimizer's
    parameters with the norm zoe answered get_total_norm with (relative 1e-6: Accelerate's stack and
    vector_norm of that one value may round it), the optimizer's ``clip_grad_norm_`` clips (its coefficient
    from the same norm, p.grad multiplied as torch does, the step exact and overlapped). Any other call — a
    norm zoe did not give, other parameters — is torch's, and zoe sees the edit at step()."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    answered = _answered_norm.pop() if _answered_norm else None
    for ref in list(_answering):
        answers = ref()
        if answers is not None and answers(params):
            opt = answers.__self__
            given = float(total_norm)
            if answered is not None and answered[0]() is opt and abs(given - answered[1]) <= 1e-6 * abs(answered[1]):
                opt.clip_grad_norm_(float(max_norm))
                return None
            break
    return torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach=foreach)


def route_clipping(answers_clipping) -> None:
    """Trainers clip through ``torch.nn.utils.clip_grad_norm_``, looked up at each call; Hugging Face's Trainer
    also computes the norm with it to log it, even with max_grad_norm=0. Done by torch, that is a write to
    every p.grad (a multiplication, by 1 when nothing is clipped) after backward, which costs the overlap and
    delayed schedules their overlap and, with declared micro-batches, replaces zoe's fp32 sum by p.grad's
    rounding of it; and offloaded parameters' gradients are no longer in p.grad on a GPU. So zoe answers it
    for its optimizers (one rank, not FSDP2). A trainer that bound torch's function earlier still works as
    before: zoe sees the edit at step() (or refuses it, for gradients that left the device).

    ``answers_clipping``: an optimizer's bound method telling whether a call over these parameters is its
    own; the optimizer's ``clip_grad_norm_`` then answers it."""
    _answering[:] = [ref for ref in _answering if ref() is not None]
    _answering.append(weakref.WeakMethod(answers_clipping))
    if torch.nn.utils.clip_grad_norm_ is torch_clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
    if torch_clip_grads_with_norm_ is not None and torch.nn.utils.clip_grads_with_norm_ is torch_clip_grads_with_norm_:
        torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_
    if torch_get_total_norm is not None and torch.nn.utils.get_total_norm is torch_get_total_norm:
        torch.nn.utils.get_total_norm = _get_total_norm
