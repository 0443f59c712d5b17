"""The update rules zoe.torch's optimizers run, as torch meets them: for each of the engine's rules (Adam/AdamW,
Lion, Adagrad; ``_zoe.optimizer_table()``, include/zoe/optimizers.h) how a torch param group maps to the
engine's hyper-parameter fields, which checks a group passes (torch's own messages), and which state keys
``opt.state[p]`` and torch's state_dict format hold. ``OffloadOptimizer`` (Adam) and its subclasses
``OffloadLion`` and ``OffloadAdagrad`` (_rule_optimizers.py) each name one ``TorchRule``; everything else
(tiers, schedules, clipping, checkpoints) reads the rule from ``FlatState.rule`` instead of naming Adam's
moments itself."""
from __future__ import annotations

import torch

from . import _torch_flags, _zoe

# The engine's table by zoe's rule name: the state arrays' names (torch's keys, in the engine's order) come
# from there, so the Python side and the checkpoints agree with the C++ side by construction.
TABLE = {entry["name"]: entry for entry in _zoe.optimizer_table()}

# State arrays that hold values >= 0 only (a second moment, a sum of squares): a state_dict with negative
# ones is refused before anything changes, as the engine refuses them from write_state.
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum"})


def _number(value, what: str) -> float:
    """A hyper-parameter as a float (a one-element tensor's value too, as torch accepts for lr)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        value = value.item()
    return float(value)


class TorchRule:
    """One engine rule as a torch optimizer class sees it. Subclasses give ``name`` (the engine's), ``title``
    (for messages), ``group_hyper`` and ``check``; the rest is common."""

    name = ""
    title = ""
    amsgrad = False  # Adam's third state array (max_exp_avg_sq); the engine fixes it when it is made

    @property
    def states(self) -> tuple[str, ...]:
        """torch's state keys beside ``step``, in the engine's order (its read_state/write_state arrays)."""
        return tuple(TABLE[self.name]["states"]) + (("max_exp_avg_sq",) if self.amsgrad else ())

    @property
    def non_negative(self) -> tuple[str, ...]:
        return tuple(k for k in self.states if k in _NON_NEGATIVE)

    def prepare(self, group: dict) -> None:
        """A group as given, before torch.optim.Optimizer fills in the defaults."""

    def check(self, group: dict, where: str) -> None:
        raise NotImplementedError

    def check_amsgrad(self, group: dict, where: str, owner: str) -> None:
        """A group's amsgrad must be the optimizer's: the engine makes max_exp_avg_sq for all of its
        parameters or for none, when it is made."""
        if bool(group.get("amsgrad", False)) != self.amsgrad:
            if self.name != "adam":
                raise ValueError(f"{owner}: {where} has amsgrad=True, which is Adam's (a maximum of exp_avg_sq); "
                                 f"{self.title} has no such state")
            raise ValueError(
                f"{owner}: {where} has amsgrad={bool(group.get('amsgrad', False))}, and this optimizer was made "
                f"with amsgrad={self.amsgrad}: zoe keeps max_exp_avg_sq for every parameter of an optimizer or "
                "for none. Give all groups one amsgrad (the constructor's), or use two optimizers")

    def group_hyper(self, group: dict) -> dict:
        """The engine's fields (set_hyper's keywords) of a torch param group."""
        raise NotImplementedError

    @staticmethod
    def hyper_key(hyper: dict) -> tuple:
        """What tells whether a group's fields changed since they were sent to the engine."""
        return tuple(hyper.values())

    def fresh_state(self, key: str, group: dict) -> float:
        """The value of state array ``key`` of a parameter never stepped, in ``group``."""
        return 0.0

    def torch_group(self, group: dict) -> dict:
        """A param group in torch's format for torch_state_dict(): torch's keys (its flags at their defaults)."""
        d = {k: v for k, v in group.items() if k not in ("params", "zoe_loss_scale")}
        d["maximize"] = bool(group.get("maximize", False))
        return d

    def state_hint(self) -> str:
        """What a state_dict of this rule holds per parameter, for the error on one that lacks a key."""
        return f"a {self.title} state_dict has step and {' and '.join(self.states)}"


class AdamRule(TorchRule):
    """torch.optim.Adam/AdamW; with ``amsgrad`` (Reddi, Kale & Kumar 2018) a third state array,
    ``max_exp_avg_sq``, as torch's ``amsgrad=True`` keeps."""

    name = "adam"

    def __init__(self, amsgrad: bool = False):
        self.amsgrad = amsgrad
        self.title = "Adam/AdamW with amsgrad" if amsgrad else "Adam/AdamW"

    def prepare(self, group: dict) -> None:
        _torch_flags.normalise_group(group)

    def check(self, group: dict, where: str) -> None:
        _torch_flags.decoupled(group)
        _torch_flags.check_group(group, where)
        self.check_amsgrad(group, where, "zoe.torch.OffloadOptimizer")
        _torch_flags.check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def group_hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw=_torch_flags.decoupled(group),
                    maximize=bool(group.get("maximize", False)), amsgrad=self.amsgrad)

    def torch_group(self, group: dict) -> dict:
        d = {k: v for k, v in group.items() if k not in ("params", "adamw", "zoe_loss_scale")}
        d.update(amsgrad=self.amsgrad, maximize=bool(group.get("maximize", False)), foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=bool(group.get("adamw", True)))
        return d

    def state_hint(self) -> str:
        return f"an {self.title} state_dict has step, {', '.join(self.states)}"


class LionRule(TorchRule):
    """Lion (Chen et al. 2023): torch has no class of its own; the group keys are lr, betas, weight_decay,
    maximize, as the paper's reference implementations name them."""

    name = "lion"
    title = "Lion"

    def check(self, group: dict, where: str) -> None:
        _torch_flags.check_group(group, where)
        self.check_amsgrad(group, where, "zoe.torch.OffloadLion")
        # Adam's checks of the same fields, with torch's messages; Lion has no eps (0 passes them).
        _torch_flags.check_hyper(group["lr"], group["betas"], 0.0, group["weight_decay"])

    def group_hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=_number(group["lr"], "lr"), beta1=_number(beta1, "beta1"), beta2=_number(beta2, "beta2"),
                    weight_decay=float(group["weight_decay"]), maximize=bool(group.get("maximize", False)))


class AdagradRule(TorchRule):
    """torch.optim.Adagrad's group keys and checks (its messages)."""

    name = "adagrad"
    title = "Adagrad"
    _FIELDS = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    _MESSAGES = {"lr": "Invalid learning rate: {}", "lr_decay": "Invalid lr_decay value: {}",
                 "weight_decay": "Invalid weight_decay value: {}",
                 "initial_accumulator_value": "Invalid initial_accumulator_value value: {}",
                 "eps": "Invalid epsilon value: {}"}

    def check(self, group: dict, where: str) -> None:
        _torch_flags.check_group(group, where)
        self.check_amsgrad(group, where, "zoe.torch.OffloadAdagrad")
        for field in self._FIELDS:
            value = _number(group[field], field)
            if not 0.0 <= value:
                raise ValueError(self._MESSAGES[field].format(value))

    def group_hyper(self, group: dict) -> dict:
        out = {field: _number(group[field], field) for field in self._FIELDS}
        out["maximize"] = bool(group.get("maximize", False))
        return out

    def fresh_state(self, key: str, group: dict) -> float:
        # torch.optim.Adagrad fills `sum` with the group's initial_accumulator_value at construction.
        return float(group.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0

    def torch_group(self, group: dict) -> dict:
        d = super().torch_group(group)
        d.update(foreach=None, differentiable=False, fused=None)
        return d


ADAM, AMSGRAD, LION, ADAGRAD = AdamRule(), AdamRule(amsgrad=True), LionRule(), AdagradRule()
RULES = {r.name: r for r in (ADAM, LION, ADAGRAD)}  # by the engine's rule name (AMSGRAD is "adam" there)
_ALL = (ADAM, AMSGRAD, LION, ADAGRAD)


def rule_of_meta(meta: dict) -> TorchRule | None:
    """The rule a zoe state_dict's "zoe" entry names (its "optimizer", Adam's when absent, and "amsgrad")."""
    rule = RULES.get(meta.get("optimizer", "adam"))
    return AMSGRAD if rule is ADAM and meta.get("amsgrad") else rule


def rule_of_state(st: dict) -> TorchRule | None:
    """The rule whose state keys a parameter's torch-format state holds (None: no rule's, or empty)."""
    keys = set(st) - {"step", "zoe_master"}
    return next((r for r in _ALL if set(r.states) == keys), None)


def rule_of_group(group: dict) -> TorchRule | None:
    """The rule a torch-format param group was written by, told by keys only that rule's groups have: Adagrad's
    lr_decay/initial_accumulator_value, Adam's betas with eps, Lion's betas without (None: none of them)."""
    if "lr_decay" in group or "initial_accumulator_value" in group:
        return ADAGRAD
    if "betas" in group:
        if "eps" not in group:
            return LION
        return AMSGRAD if group.get("amsgrad") else ADAM
    return None


def refuse_other_rule(rule: TorchRule, state_dict: dict) -> None:
    """A torch-format state_dict of another rule is refused by name before anything changes: zoe does not
    turn one rule's state into another's (Adam's exp_avg is no Lion momentum), and the groups' fields differ."""
    found = None
    for st in (state_dict.get("state") or {}).values():
        found = rule_of_state(st) if isinstance(st, dict) else None
        if found is not None:
            break
    if found is None:
        found = next((r for r in map(rule_of_group, state_dict.get("param_groups") or []) if r is not None), None)
    if found is not None and found is not rule:
        raise ValueError(
            f"this state_dict is of {found.title} (state {', '.join(found.states)}), and this optimizer runs "
            f"{rule.title} (state {', '.join(rule.states)}): zoe does not convert one optimizer's state into "
            f"another's. {load_hint(found, rule)}")


def load_hint(saved: TorchRule | None, running: TorchRule) -> str:
    """Where a state_dict of rule `saved` loads, for the error that refuses it in an optimizer of `running`."""
    if saved is not None and saved.name == running.name:  # Adam with the other amsgrad
        return f"Load it into an optimizer made with amsgrad={saved.amsgrad}"
    return "Load it into the optimizer class that saved it"
