"""zoe.torch.OffloadOptimizer keeps torch.optim.AdamW's contract where a trainer leans on it without saying so:
a None gradient is not a zero gradient, each parameter has its own step, frozen parameters are held, the
model's weights are the truth between steps, fp16 is never unscaled by a scale that was never applied,
torch's keywords and errors. Each rule beside torch.optim.AdamW/Adam on the same gradients."""
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

import zoe
from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, max_diff

# fp32 zoe against fp32 torch: only the order of float operations in each element's update differs
# (test_optimizer.py's PARITY_TOL, measured 7.5e-8 after 50 steps).
PARITY_TOL = 1e-5
HYPER = dict(lr=3e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)

# Every schedule, tier and state dtype, with and without declared micro-batches: where a None gradient is
# stepped as a zero, the parameter moves (weight decay, and the moments' momentum), in all of them alike.
CONFIGS = [
    dict(dtype=torch.float32, schedule="sync"),
    dict(dtype=torch.float32, schedule="overlap"),
    dict(dtype=torch.float32, schedule="delayed", delayed_warmup_steps=1),
    dict(dtype=torch.bfloat16, schedule="sync", state_dtype="bf16"),
    dict(dtype=torch.bfloat16, schedule="overlap", state_dtype="int8"),
    dict(dtype=torch.float32, schedule="sync", gradient_accumulation_steps=2),
    dict(dtype=torch.bfloat16, schedule="sync", tier="nvme"),
    dict(dtype=torch.bfloat16, schedule="overlap", tier="nvme", state_dtype="int8"),
    dict(dtype=torch.float32, schedule="overlap", tier="nvme"),
]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _state(opt, p):
    st = opt.read_state(p)
    return {k: v.clone() for k, v in st.items()}


def _steps(opt) -> dict:
    return {i: int(s["step"]) for i, s in opt.torch_state_dict()["state"].items()}


def _make(cfg, tmp_path, model):
    kw = {k: v for k, v in cfg.items() if k != "dtype"}
    if kw.get("tier") == "nvme":
        kw["nvme_path"] = str(tmp_path / "swap")
    return OffloadOptimizer(model.parameters(), **HYPER, **kw)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c.values()))
def test_a_none_gradient_leaves_its_parameter_as_it_is(cfg, tmp_path):
    model = make_mlp(dtype=cfg["dtype"])
    opt = _make(cfg, tmp_path, model)
    micro = cfg.get("gradient_accumulation_steps", 1)
    last = model[4].weight
    data = batches(6 * micro)
    for t in range(6):
        # Before backward: the overlap schedule steps during it.
        before = _state(opt, last)  # waits for the delayed schedule's step: the weights are then its
        before_w = last.detach().clone()
        first_w = model[0].weight.detach().clone()
        opt.zero_grad()
        for x, y in data[t * micro:(t + 1) * micro]:
            _loss(model, x, y).backward()
        if t >= 3 and micro == 1:
            last.grad = None  # after backward: overlap has stepped it speculatively, and must undo that
        opt.step()
        opt._engine.wait()
        moved = not torch.equal(before_w, last.detach())
        if t >= 3 and micro == 1:
            after = _state(opt, last)
            assert not moved, f"step {t}: a parameter whose gradient is None moved"
            for k in before:
                assert torch.equal(before[k], after[k]), f"step {t}: its {k} changed"
        else:
            assert moved
        assert not torch.equal(first_w, model[0].weight.detach()), "the other parameters are stepped"
    if micro == 1:
        # zero_grad() sets None (torch's default): a step with no backward at all changes nothing.
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        weights = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt._engine.wait()
        assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
    steps = _steps(opt)
    index = [i for i, p in enumerate(model.parameters()) if p is last][0]
    assert steps[index] == (3 if micro == 1 else 6) and steps[0] == 6, steps


def _train_pair(ref, mine, ropt, mopt, data, drop=lambda t, i: False, **kw):
    """The same iterations on both; drop(t, i): parameter i's gradient is None at step t (after backward)."""
    _train([(ref, ropt), (mine, mopt)], data, drop, **kw)


def _train(pairs, data, drop=lambda t, i: False, before_backward=None, after_backward=None, set_to_none=True):
    """after_backward(model): the trainer's edit before step(); set_to_none: zero_grad's."""
    for t, (x, y) in enumerate(data):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=set_to_none)
            if not set_to_none:
                assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # None before a backward
            if before_backward is not None:
                before_backward(t, model)
            loss = _loss(model, x, y)
            if loss.requires_grad:
                loss.backward()
            if after_backward is not None:
                after_backward(model)
            for i, p in enumerate(model.parameters()):
                if drop(t, i):
                    p.grad = None
            opt.step()


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_missing_gradients_match_torch_including_a_parameter_first_used_late(schedule):
    """torch's own comparison pattern: no gradient at some iterations, a parameter whose first gradient
    comes at step 4 (its bias correction starts at t=1 there), and the per-parameter steps."""
    data = batches(10)
    ref, mine = make_mlp(), make_mlp()
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), schedule=schedule, **HYPER)
    drop = lambda t, i: (i == 5 and t < 4) or (i == 2 and t % 3 == 1) or t == 2  # noqa: E731
    _train_pair(ref, mine, ropt, mopt, data, drop)
    mopt._engine.wait()
    diff = max_diff(ref, mine)
    print(f"max |w_zoe - w_torch| with missing gradients ({schedule}): {diff:.3e}")
    assert diff < PARITY_TOL
    torch_steps = {i: int(ropt.state[p]["step"]) for i, p in enumerate(ref.parameters())}
    assert _steps(mopt) == torch_steps


def test_a_step_before_any_backward_changes_nothing():
    model = make_mlp()
    weights = [p.detach().clone() for p in model.parameters()]
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
    assert len(opt.state) == 0


def test_parameters_frozen_at_construction_are_held_and_stepped_once_unfrozen():
    data = batches(8)
    ref, mine = make_mlp(), make_mlp()
    for m in (ref, mine):
        m[0].requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)

    def unfreeze(t, model):
        if t == 4:
            model[0].requires_grad_(True)

    frozen = mine[0].weight.detach().clone()
    _train_pair(ref, mine, ropt, mopt, data[:4], before_backward=unfreeze)
    assert torch.equal(frozen, mine[0].weight.detach()), "a frozen parameter moved"
    _train_pair(ref, mine, ropt, mopt, data, before_backward=unfreeze)
    assert not torch.equal(frozen, mine[0].weight.detach()), "an unfrozen parameter with a gradient is stepped"
    assert max_diff(ref, mine) < PARITY_TOL


def test_zero_grad_set_to_none_false_zeroes_and_steps_every_parameter_as_torch():
    data = batches(4)
    ref, mine = make_mlp(), make_mlp()
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)

    def zero_last(model):
        model[4].weight.grad.zero_()  # a zero gradient is a gradient: stepped (decay, momentum)

    _train_pair(ref, mine, ropt, mopt, data, after_backward=zero_last, set_to_none=False)
    assert max_diff(ref, mine) < PARITY_TOL


def _edit_weights(model, other, edit: str) -> None:
    """The trainer's edit of layer 2's weights (of every weight for load_state_dict)."""
    p = model[2].weight
    if edit == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif edit == "init":
        torch.nn.init.constant_(p, 0.5)
    elif edit == "copy_":
        with torch.no_grad():
            p.copy_(other[2].weight)
    else:
        p.data = other[2].weight.detach().clone()


def _assert_kept(named: dict, want: dict, dtype) -> None:
    # One step at lr 1e-6 moves each weight by about 1e-6: within a 16-bit ulp of what was set. Reverted to
    # zoe's master, layer 2 is off by the distance between two random initialisations (~0.1).
    for n, t in named.items():
        tol = 1e-5 if dtype == torch.float32 else 1e-2 * want[n].abs().max().item() + 1e-3
        assert (t.float() - want[n].float()).abs().max().item() < tol, f"{n} went back to zoe's master"


# The overlap and delayed schedules write weights into the model during backward (a speculative step, the
# last step's new weights): the edit is read before that, at the iteration's first gradient report.
# Tier nvme: an fp32 parameter's master in the swap store, its weights a copy the edit must replace too.
EDIT_CONFIGS = [(dict(schedule=s, **kw), dtype)
                for s, kw in (("sync", {}), ("overlap", {}), ("delayed", dict(delayed_warmup_steps=1)))
                for dtype in (torch.float32, torch.bfloat16, torch.float16)]
EDIT_CONFIGS += [(dict(schedule="overlap", tier="nvme"), dtype)
                 for dtype in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("cfg,dtype", EDIT_CONFIGS,
                         ids=["-".join([*(c[k] for k in ("schedule", "tier") if k in c), str(d)[6:]]) for c, d in EDIT_CONFIGS])
@pytest.mark.parametrize("edit", ["load_state_dict", "init", "copy_", "assign_data"])
def test_an_edit_of_the_weights_after_construction_is_taken_not_reverted(cfg, dtype, edit, tmp_path):
    model, other = make_mlp(dtype=dtype), make_mlp(seed=5, dtype=dtype)
    kw = dict(cfg, nvme_path=str(tmp_path / "swap")) if "tier" in cfg else cfg
    opt = OffloadOptimizer(model.parameters(), lr=1e-6, weight_decay=0.0, loss_scale=False, **kw)
    for x, y in batches(2):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    _edit_weights(model, other, edit)
    want = {n: t.detach().clone() for n, t in model.named_parameters()}
    x, y = batches(1, seed=9)[0]
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    opt._engine.wait()
    _assert_kept({n: t.detach() for n, t in model.named_parameters()}, want, dtype)
    master = opt.read_state(model[2].weight)["master"]
    assert (master - want["2.weight"].float()).abs().max().item() < 1e-3


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_a_step_after_an_edit_is_the_same_in_overlap_as_in_sync(tier, tmp_path):
    """Exactly: overlap's steps during backward started from the old master, and are undone and redone from
    the edited one (the step's own update of the edited weights is kept, not dropped)."""
    finals = []
    for schedule in ("sync", "overlap"):
        model, other = make_mlp(dtype=torch.bfloat16), make_mlp(seed=5, dtype=torch.bfloat16)
        opt = OffloadOptimizer(model.parameters(), **HYPER, schedule=schedule, tier=tier,
                               nvme_path=str(tmp_path / schedule) if tier == "nvme" else None)
        for t, (x, y) in enumerate(batches(4)):
            if t == 2:
                _edit_weights(model, other, "load_state_dict")
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
        opt._engine.wait()
        finals.append([p.detach().clone() for p in model.parameters()] + [_state(opt, p)["master"] for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_an_offloaded_parameters_edit_in_gathered_is_taken_and_one_outside_is_refused(schedule, dtype, home, tmp_path):
    from zoe.torch import offload_parameters

    model, other = make_mlp(dtype=dtype), make_mlp(seed=5, dtype=dtype)
    (tmp_path / "params").mkdir()
    offload = offload_parameters(model, device=home, nvme_path=str(tmp_path / "params") if home == "nvme" else None)
    kw = dict(delayed_warmup_steps=1) if schedule == "delayed" else {}
    opt = OffloadOptimizer(model.parameters(), lr=1e-6, weight_decay=0.0, schedule=schedule, **kw)
    data = batches(4, seed=9)
    for x, y in data[:2]:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    with offload.gathered():
        model.load_state_dict(other.state_dict())
    want = offload.full_state_dict()
    for x, y in data[2:3]:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    opt._engine.wait()
    _assert_kept(offload.full_state_dict(), want, dtype)
    assert (opt.read_state(model[2].weight)["master"] - want["2.weight"].float()).abs().max().item() < 1e-3

    # Outside gathered() p is an empty placeholder: the edit changed nothing, and is refused, not ignored.
    with torch.no_grad():
        torch.nn.init.zeros_(model[2].weight)
    x, y = data[3]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"parameter '2.weight' was changed in place outside offload.gathered"):
        _loss(model, x, y)
    with torch.no_grad():
        torch.nn.init.zeros_(model[0].weight)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' was changed in place outside offload.gathered"):
        opt.step()
    assert opt.step_count == 3
    # And inside materialize() (a read-only copy), the edit is dropped, which is said.
    with pytest.raises(RuntimeError, match=r"'2.weight' was changed in place inside materialize\(\)"):
        with offload.materialize():
            torch.nn.init.zeros_(model[2].weight)
    _assert_kept(offload.full_state_dict(), want, dtype)
    del opt
    offload.remove()


def test_the_model_moved_to_another_dtype_after_construction_is_refused_naming_it():
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    model.to(torch.float16)
    x, y = batches(1)[0]
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="Convert or move the model first"):
        opt.step()
    assert opt.step_count == 0


def test_a_gradient_whose_data_is_replaced_is_stepped_with_the_new_values():
    data = batches(3)
    ref, mine = make_mlp(), make_mlp()
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)

    def replace_data(model):
        g = model[0].weight.grad
        g.data = torch.full_like(g, 1e-3)

    _train_pair(ref, mine, ropt, mopt, data, after_backward=replace_data, set_to_none=False)
    assert max_diff(ref, mine) < PARITY_TOL


def test_fp16_with_a_plain_backward_is_refused_not_unscaled_by_65536():
    model = make_mlp(dtype=torch.float16)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"opt\.backward\(loss\)"):
        opt.step()
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
    assert opt.step_count == 0
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    opt.step()
    assert opt.step_count == 1
    # Without zoe's scaling (torch's GradScaler, or none) the gradients are stepped as they are.
    plain = make_mlp(dtype=torch.float16)
    popt = OffloadOptimizer(plain.parameters(), loss_scale=False, **HYPER)
    _loss(plain, x, y).backward()
    popt.step()
    assert popt.step_count == 1


def test_fp16_overlap_refuses_at_the_first_report_before_stepping_anything():
    model = make_mlp(dtype=torch.float16)
    opt = OffloadOptimizer(model.parameters(), schedule="overlap", **HYPER)
    x, y = batches(1)[0]
    opt.backward(_loss(model, x, y))  # the first step runs as sync: it learns when backward ends
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="was not scaled"):
        _loss(model, x, y).backward()  # reported during backward: refused before the engine steps it


def test_defaults_and_torch_keywords():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = OffloadOptimizer([p])
    torch_defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
              "fused"):
        assert opt.defaults[k] == torch_defaults[k], k
    for ok in (dict(foreach=False), dict(foreach=None), dict(fused=None), dict(fused=False), dict(fused=True),
               dict(foreach=True), dict(amsgrad=False, maximize=False, capturable=False, differentiable=False)):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], **ok)
    OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], amsgrad=True)  # test_amsgrad.py tests it
    for flag in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=flag):
            OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], **{flag: True})
        with pytest.raises(ValueError, match=flag):
            OffloadOptimizer([{"params": [torch.nn.Parameter(torch.zeros(4))], flag: True}])
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], foreach=True, fused=True)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], weight_decay=-0.1)
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], eps=-1.0)


def test_a_one_element_tensor_lr_steps_as_torch():
    data = batches(5)
    ref, mine = make_mlp(), make_mlp()
    hyper = dict(HYPER, lr=torch.tensor(3e-3))
    _train_pair(ref, mine, torch.optim.AdamW(ref.parameters(), **hyper),
                OffloadOptimizer(mine.parameters(), **hyper), data)
    assert max_diff(ref, mine) < PARITY_TOL


@pytest.mark.parametrize("where", ["constructor", "group"])
def test_decoupled_weight_decay_false_is_adams_l2(where):
    data = batches(10)
    ref, mine = make_mlp(), make_mlp()
    ropt = torch.optim.Adam(ref.parameters(), **HYPER)
    if where == "constructor":
        mopt = OffloadOptimizer(mine.parameters(), decoupled_weight_decay=False, **HYPER)
    else:
        mopt = OffloadOptimizer([{"params": list(mine.parameters()), "decoupled_weight_decay": False}], **HYPER)
    _train_pair(ref, mine, ropt, mopt, data)
    assert max_diff(ref, mine) < PARITY_TOL
    with pytest.raises(ValueError, match="contradict"):
        OffloadOptimizer(make_mlp().parameters(), adamw=False, decoupled_weight_decay=True)


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam-L2"])
@pytest.mark.parametrize("where", ["constructor", "group"])
def test_maximize_ascends_as_torch(decoupled, where):
    """maximize=True as torch.optim.AdamW / Adam have it: the gradient negated before anything else (before
    Adam's L2 term is added; AdamW's decoupled decay unchanged); torch's parity tolerance, and per group."""
    data = batches(10)
    ref, mine = make_mlp(), make_mlp()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if where == "constructor":
        ropt = cls(ref.parameters(), maximize=True, **HYPER)
        mopt = OffloadOptimizer(mine.parameters(), maximize=True, decoupled_weight_decay=decoupled, **HYPER)
    else:  # the weights ascend, the biases descend
        ropt = cls(_split(ref, maximize=True), **HYPER)
        mopt = OffloadOptimizer(_split(mine, maximize=True), decoupled_weight_decay=decoupled, **HYPER)
    _train_pair(ref, mine, ropt, mopt, data)
    assert max_diff(ref, mine) < PARITY_TOL
    descended = make_mlp()
    _train([(descended, OffloadOptimizer(descended.parameters(), decoupled_weight_decay=decoupled, **HYPER))], data)
    assert max_diff(descended, mine) > 100 * PARITY_TOL, "maximize is really in effect"
    assert [g["maximize"] for g in mopt.state_dict()["param_groups"]] == [g["maximize"] for g in ropt.param_groups]
    assert [g["maximize"] for g in mopt.torch_state_dict()["param_groups"]] == [g["maximize"] for g in
                                                                                ropt.param_groups]


def _split(model, maximize: bool) -> list[dict]:
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "maximize": maximize},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")]}]


def _negated_loss_run(model, opt, data, negate: bool) -> None:
    for x, y in data:
        opt.zero_grad()
        loss = _loss(model, x, y)
        (-loss if negate else loss).backward()
        opt.step()


@pytest.mark.parametrize("cfg", [dict(schedule="sync"), dict(schedule="overlap"),
                                 dict(schedule="delayed", delayed_warmup_steps=2),
                                 dict(schedule="overlap", max_grad_norm=0.05),
                                 dict(schedule="sync", tier="nvme", state_dtype="int8")],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_maximize_is_descent_on_the_negated_loss_bitwise(cfg, tmp_path):
    """Ascending the loss is descending its negation bit for bit (autograd negates every gradient exactly),
    in every schedule, with clipping (the norm of -g is g's) and on tier nvme."""
    data = batches(6)
    up, down = make_mlp(dtype=torch.bfloat16), make_mlp(dtype=torch.bfloat16)
    kw = dict(cfg)
    if kw.get("tier") == "nvme":
        kw["nvme_path"] = str(tmp_path / "swap")
    uopt = OffloadOptimizer(up.parameters(), maximize=True, **HYPER, **kw)
    _negated_loss_run(up, uopt, data, negate=False)
    uopt.state_dict()  # waits for a step in flight (delayed)
    if "nvme_path" in kw:
        kw["nvme_path"] = str(tmp_path / "swap2")
    dopt = OffloadOptimizer(down.parameters(), **HYPER, **kw)
    _negated_loss_run(down, dopt, data, negate=True)
    dopt.state_dict()
    for p, q in zip(up.parameters(), down.parameters()):
        assert torch.equal(p, q)
        a, b = uopt.read_state(p), dopt.read_state(q)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_maximize_round_trips_through_state_dicts():
    """A zoe state_dict keeps each group's maximize (a fresh optimizer created without it continues as the
    uninterrupted run, bit for bit), and torch.optim.AdamW continues from zoe's as from its own."""
    data = batches(8)
    whole = make_mlp()
    _train([(whole, OffloadOptimizer(_split(whole, maximize=True), **HYPER))], data)
    first = make_mlp()
    fopt = OffloadOptimizer(_split(first, maximize=True), **HYPER)
    _train([(first, fopt)], data[:4])
    sd = fopt.state_dict()
    resumed = make_mlp()
    resumed.load_state_dict(first.state_dict())
    ropt = OffloadOptimizer(_split(resumed, maximize=False), **HYPER)
    ropt.load_state_dict(sd)
    assert [g["maximize"] for g in ropt.param_groups] == [True, False]
    _train([(resumed, ropt)], data[4:])
    assert max_diff(whole, resumed) == 0.0

    straight = make_mlp()
    _train([(straight, torch.optim.AdamW(_split(straight, maximize=True), **HYPER))], data)
    tresumed = make_mlp()
    tresumed.load_state_dict(first.state_dict())
    topt = torch.optim.AdamW(_split(tresumed, maximize=False), **HYPER)
    topt.load_state_dict(fopt.torch_state_dict())
    assert [g["maximize"] for g in topt.param_groups] == [True, False]
    _train([(tresumed, topt)], data[4:])
    assert max_diff(straight, tresumed) < PARITY_TOL


def test_deepcopy_and_pickle_are_refused_naming_why():
    opt = OffloadOptimizer(make_mlp().parameters(), **HYPER)
    with pytest.raises(TypeError, match="cannot be deep-copied.*state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot be pickled.*state_dict"):
        pickle.dumps(opt)


def test_per_parameter_steps_round_trip_through_torch_and_zoe_state_dicts():
    """torch's state with parameters at different steps continues in zoe as in torch, and zoe's own
    checkpoint keeps each parameter's step."""
    data = batches(8)
    ref, mine = make_mlp(), make_mlp()
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    drop = lambda t, i: i == 3 and t < 3  # noqa: E731
    _train([(ref, ropt)], data[:4], drop)
    mine.load_state_dict(ref.state_dict())
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)
    mopt.load_state_dict(ropt.state_dict())
    assert _steps(mopt) == {i: int(ropt.state[p]["step"]) for i, p in enumerate(ref.parameters())}
    saved = mopt.state_dict()
    _train_pair(ref, mine, ropt, mopt, data[4:])
    assert max_diff(ref, mine) < PARITY_TOL
    again = OffloadOptimizer(make_mlp().parameters(), **HYPER)
    again.load_state_dict(saved)
    assert _steps(again)[3] == 1 and _steps(again)[0] == 4


_FSDP2_OFFLOAD = r"""
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from zoe.torch import offload_parameters
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
offload = offload_parameters(model)
y = model(torch.randn(2, 8))
y.sum().backward()
print("offloaded:", type(offload).__name__, tuple(y.shape), all(p.grad is not None for p in model.parameters()))
dist.destroy_process_group()
"""


def test_offload_parameters_on_an_fsdp2_model_offloads_its_shards_without_crashing():
    """Once a SIGSEGV (the DTensor's global size written from the local shard's pointer); now each rank's shards
    go to its tier (tests/python/test_fsdp_offload.py tests that path on two ranks). A process of its own, so
    that a crash fails the test rather than the run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", _FSDP2_OFFLOAD], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PORT=str(port)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "offloaded: ShardOffload (2, 2) True" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_has_torchs_keys_and_values(state_dtype):
    data = batches(4)
    ref, mine = make_mlp(), make_mlp()
    mine[0].requires_grad_(False)
    ref[0].requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), state_dtype=state_dtype, **HYPER)
    _train_pair(ref, mine, ropt, mopt, data)
    frozen, p = mine[0].weight, mine[2].weight
    assert frozen not in mopt.state and mopt.state[frozen] == {}, "never stepped: no state, as torch"
    assert len(mopt.state) == len(ropt.state) == 4
    st, rst = mopt.state[p], ropt.state[ref[2].weight]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert int(st["step"]) == int(rst["step"]) == 4
    # The weights agree to ~1e-7 (PARITY_TOL's measure), so the gradients, and the moments made of them, agree
    # to about 1e-6 of the largest (1.1e-6 measured); bf16 moments are rounded to 8 bits of mantissa each update.
    tol = 1e-4 if state_dtype == "fp32" else 1e-2
    for k in ("exp_avg", "exp_avg_sq"):
        assert st[k].shape == p.shape
        assert (st[k] - rst[k]).abs().max().item() <= tol * rst[k].abs().max().item(), k
    mopt.state["note"] = 7  # a hook's own entry: kept and saved, as torch keeps it
    assert mopt.state_dict()["state"]["note"] == 7
    with pytest.raises(TypeError, match="lives in zoe's engine"):
        mopt.state[p] = {}
    before = mopt.read_state(p)["exp_avg"].clone()
    st["exp_avg"].mul_(0.5)
    after = mopt.read_state(p)["exp_avg"]
    if state_dtype == "fp32":
        assert torch.equal(after, before * 0.5), "fp32 moments in RAM: state[p] is a view of zoe's memory"
    else:
        assert torch.equal(after, before), "bf16 moments: state[p] is a copy"


def test_torch_adamw_continues_from_zoes_state_dict_as_from_its_own():
    data = batches(10)
    straight = make_mlp()
    sopt = torch.optim.AdamW(straight.parameters(), **HYPER)
    _train([(straight, sopt)], data)

    mine = make_mlp()
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)
    _train([(mine, mopt)], data[:5])
    sd = mopt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    resumed = make_mlp(seed=3)
    resumed.load_state_dict(mine.state_dict())
    ropt = torch.optim.AdamW(resumed.parameters(), **HYPER)
    ropt.load_state_dict(sd)
    _train([(resumed, ropt)], data[5:])
    diff = max_diff(straight, resumed)
    print(f"zoe 5 steps -> torch.optim.AdamW.load_state_dict -> 5 torch steps, against 10 torch steps: {diff:.2e}")
    assert diff < PARITY_TOL


def test_named_and_unnamed_parameters_give_the_same_state_dict():
    data = batches(3)
    a, b = make_mlp(), make_mlp()
    oa = OffloadOptimizer(a.parameters(), **HYPER)
    ob = OffloadOptimizer(b.named_parameters(), **HYPER)
    _train([(a, oa), (b, ob)], data)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert torch.equal(sa["zoe"]["checkpoint"], sb["zoe"]["checkpoint"])
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    strip = lambda groups: [{k: v for k, v in g.items() if k != "param_names"} for g in groups]  # noqa: E731
    assert strip(sa["param_groups"]) == strip(sb["param_groups"])
    assert "param_names" in sb["param_groups"][0]


def test_grads_are_never_replaced_or_written_by_step():
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    for x, y in batches(3):
        opt.zero_grad()
        _loss(model, x, y).backward()
        grads = [(p.grad, p.grad._version, p.grad.clone()) for p in model.parameters()]
        opt.step()
        for p, (g, version, values) in zip(model.parameters(), grads):
            assert p.grad is g and g._version == version and torch.equal(g, values)
