"""``zoe.torch.OffloadLion`` and ``zoe.torch.OffloadAdagrad``: OffloadOptimizer with the engine's other update
rules (_rules.py). Each has its rule's torch-style constructor and shares everything else with
OffloadOptimizer — tiers, schedules, clipping, loss scaling, accumulation, offloaded parameters, zoe's
data-parallel partition and FSDP2 parameters, state_dict in zoe's and torch's formats (with the rule's state
keys), torch.distributed.checkpoint."""
from __future__ import annotations

import inspect

from . import _rules
from .torch import OffloadOptimizer

# OffloadOptimizer's keywords that are zoe's, not Adam's: the new classes take them by the same names, with
# the same defaults (read from OffloadOptimizer's signature, so the two cannot drift apart).
_ADAM_ONLY = {"self", "params", "lr", "betas", "eps", "weight_decay", "adamw", "amsgrad", "maximize", "foreach",
              "fused", "capturable", "differentiable", "decoupled_weight_decay"}
ZOE_KEYWORDS = {name: p.default for name, p in inspect.signature(OffloadOptimizer.__init__).parameters.items()
                if name not in _ADAM_ONLY}


def _zoe_options(cls_name: str, given: dict) -> dict:
    """zoe's keywords, the given ones over OffloadOptimizer's defaults; an unknown one is Python's TypeError."""
    unknown = sorted(set(given) - set(ZOE_KEYWORDS))
    if unknown:
        raise TypeError(f"{cls_name}.__init__() got an unexpected keyword argument '{unknown[0]}'")
    return {**ZOE_KEYWORDS, **given}


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675) with its state (the momentum ``exp_avg``) offloaded to zoe:
    ``u = sign(beta1 * m + (1 - beta1) * g)``, ``p <- p * (1 - lr * weight_decay) - lr * u``,
    ``m <- beta2 * m + (1 - beta2) * g`` (``maximize``: the gradient negated). torch has no Lion class; the
    param-group keys are ``lr``, ``betas``, ``weight_decay`` and ``maximize``, and ``opt.state[p]`` holds
    ``step`` and ``exp_avg``. zoe's keywords (tier, nvme_path, schedule, max_grad_norm, loss_scale, threads,
    ...) are OffloadOptimizer's; ``state_dtype="int8"`` keeps the momentum in zoe's 8-bit code, as Adam's
    ``exp_avg`` (one byte per element and an fp32 scale per 2048)."""

    _rule = _rules.LION

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False, **zoe_options):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        self._rule.check(defaults, "OffloadLion")
        self._start(params, defaults, _zoe_options("OffloadLion", zoe_options))


class OffloadAdagrad(OffloadOptimizer):
    """torch.optim.Adagrad with its state (``sum``, the running sum of squared gradients) offloaded to zoe: the
    same constructor, param-group keys, checks and ``opt.state[p]`` keys (``step``, ``sum``; present once a
    parameter is stepped, where torch fills them at construction). ``foreach`` and ``fused`` choose torch's
    implementation and zoe's step is its own whatever they say; ``differentiable=True`` is refused (zoe's step
    is not part of autograd). zoe's keywords are OffloadOptimizer's; ``state_dtype="int8"`` is refused (zoe's
    8-bit codes are for moments, not a growing sum of squares)."""

    _rule = _rules.ADAGRAD

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None, **zoe_options):
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        self._rule.check(defaults, "OffloadAdagrad")
        self._start(params, defaults, _zoe_options("OffloadAdagrad", zoe_options))
