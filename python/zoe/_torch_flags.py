"""torch.optim.AdamW's keywords and checks, as OffloadOptimizer meets them: the same errors for bad
hyper-parameters (torch's own messages, which code and tests match), torch's flags accepted where zoe runs
what they ask and refused by name where it does not — never accepted and ignored."""
from __future__ import annotations

import torch

# torch's name for zoe's ``adamw``: decoupled (AdamW) or L2 (Adam) weight decay.
DECOUPLED = "decoupled_weight_decay"

# Flags whose True zoe cannot run, and why (the error says it).
_REFUSED = {
    "capturable": "zoe's step runs on the host and cannot be captured in a CUDA graph",
    "differentiable": "zoe's step is not part of autograd",
}


def check_hyper(lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's checks of its hyper-parameters, with its messages."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = lr.item()
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    betas = tuple(betas)
    if len(betas) != 2:
        raise ValueError(f"betas must hold two values, got {betas}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    for k, b in enumerate(betas):
        b = b.item() if isinstance(b, torch.Tensor) else b
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {b}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def normalise_group(group: dict) -> None:
    """A group given with torch's ``decoupled_weight_decay`` or zoe's ``adamw`` gets the other, equal (before
    the optimizer's defaults fill in the rest)."""
    if group.get(DECOUPLED) is not None:
        group.setdefault("adamw", bool(group[DECOUPLED]))
    elif "adamw" in group:
        group[DECOUPLED] = bool(group["adamw"])


def decoupled(group: dict) -> bool:
    """Whether a group's weight decay is AdamW's (decoupled) or Adam's L2; the two names must agree."""
    adamw = bool(group.get("adamw", True))
    torch_name = group.get(DECOUPLED)
    if torch_name is not None and bool(torch_name) != adamw:
        raise ValueError(f"a param group has adamw={adamw} and {DECOUPLED}={torch_name}: they name the same choice "
                         "(AdamW's decoupled decay, or Adam's L2) and must agree; set one of them")
    return adamw


def check_group(group: dict, where: str) -> None:
    """Refuses, by name, a flag zoe cannot honour; foreach and fused choose torch's implementation, and zoe's
    step is a fused multi-tensor kernel whatever they say (both True is torch's error too)."""
    for flag, why in _REFUSED.items():
        if group.get(flag, False):
            raise ValueError(f"zoe.torch.OffloadOptimizer: {where} has {flag}=True, which zoe does not run: {why}")
    if group.get("foreach") and group.get("fused"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    for flag in ("foreach", "fused"):
        if group.get(flag) not in (None, False, True):
            raise ValueError(f"zoe.torch.OffloadOptimizer: {where} has {flag}={group.get(flag)!r}: None, False or True")
