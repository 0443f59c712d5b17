"""zoe.torch.OffloadLion and OffloadAdagrad (the engine's other update rules, issue 53) against their rules in
torch: torch.optim.Adagrad, and Lion written out below in a few lines of fp32 torch. Tiers ram and nvme, the
schedules the CPU runs (sync, overlap, delayed), fp32 and bf16 state, state_dict round trips with torch's
state keys, and the refusals: another rule's state, int8 state, bad hyper-parameters."""
import io

import pytest
import torch

import zoe
from zoe.torch import OffloadAdagrad, OffloadLion, OffloadOptimizer

from conftest import batches, make_mlp, max_diff, train

ADAGRAD = dict(lr=0.05, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.3)
LION = dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1)
# fp32 Adagrad in zoe and in torch differ by the order of float operations inside one element's update (fused
# multiply-adds in the SIMD kernel, a reciprocal square root); over 20 steps of the small MLP, which feeds the
# weights back into the gradients, that stays at 1.5e-8 in measurements (tiers ram and nvme) — 1e-5 leaves
# a wide margin for other CPUs and BLAS.
PARITY_TOL = 1e-5
# Lion's update is lr * sign(...): the same bits in both implementations unless a sign flips where the
# interpolation is within rounding of zero, which would cost 2 * lr in that element. Otherwise only the
# momentum's and the decay's fp32 roundings differ, a few ulps of the weights; measured 0.0 (the same bits).
LION_TOL = 1e-6
# bf16 state: zoe rounds `sum` to bf16 (8 bits of mantissa, relative error up to 2^-9) after each fp32 update,
# torch keeps it fp32. The step divides by sqrt(sum): up to 2^-10 relative per update, so about lr * steps *
# 2^-10 = 1e-3 after 20 steps at lr 0.05 in the worst case, if every rounding went one way; measured 5.7e-5.
# Bounded at 5e-4. (Lion's bf16 momentum is compared with a reference that rounds it the same way instead:
# a rounding can flip a sign, which no tolerance below 2 * lr would absorb.)
ADAGRAD_BF16_TOL = 5e-4
# The delayed schedule steps one iteration stale after its warm-up (4 sync steps): its weights drift from
# sync's by a few updates' size. Measured 5.2e-4 (Adagrad) and 1.2e-3 (Lion, where 8 stale steps apart in
# every element would be 2 * lr * 8 = 4.8e-3).
DELAYED_TOL = {"adagrad": 5e-3, "lion": 3e-3}


def lion_reference(params, lr: float, betas, weight_decay: float):
    """Lion (Chen et al. 2023, arXiv 2302.06675) in fp32 torch, as a function to call after each backward:
    u = sign(b1*m + (1-b1)*g); p <- p*(1 - lr*wd) - lr*u; m <- b2*m + (1-b2)*g. Returns (step, momenta)."""
    b1, b2 = betas
    momenta = {p: torch.zeros_like(p) for p in params}

    @torch.no_grad()
    def step():
        for p, m in momenta.items():
            u = (b1 * m + (1 - b1) * p.grad).sign()
            p.mul_(1 - lr * weight_decay).add_(u, alpha=-lr)
            m.mul_(b2).add_(p.grad, alpha=1 - b2)
    return step, momenta


def train_lion_reference(model, data, momenta_bf16: bool = False):
    step, momenta = lion_reference(list(model.parameters()), LION["lr"], LION["betas"], LION["weight_decay"])
    for x, y in data:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()
        if momenta_bf16:  # zoe's bf16 state: each momentum rounded to nearest even after its fp32 update
            for m in momenta.values():
                m.copy_(m.bfloat16().float())
    return momenta


def zoe_options(tier, tmp_path, **extra):
    return dict(tier=tier, nvme_path=str(tmp_path) if tier == "nvme" else None, **extra)


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_adagrad_matches_torch(tier, schedule, tmp_path):
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    torch_opt = torch.optim.Adagrad(ref.parameters(), **ADAGRAD)
    train(ref, torch_opt, data)
    opt = OffloadAdagrad(mine.parameters(), schedule=schedule, **ADAGRAD, **zoe_options(tier, tmp_path))
    train(mine, opt, data)
    assert max_diff(ref, mine) < PARITY_TOL
    assert opt.step_count == 20
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert set(opt.state[q]) == set(torch_opt.state[p]) == {"step", "sum"}
        assert float(opt.state[q]["step"]) == float(torch_opt.state[p]["step"]) == 20.0
        assert (opt.state[q]["sum"] - torch_opt.state[p]["sum"]).abs().max() < PARITY_TOL


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_lion_matches_its_rule_in_torch(tier, schedule, tmp_path):
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    momenta = train_lion_reference(ref, data)
    opt = OffloadLion(mine.parameters(), schedule=schedule, **LION, **zoe_options(tier, tmp_path))
    train(mine, opt, data)
    assert max_diff(ref, mine) < LION_TOL
    assert max_diff(ref, make_mlp()) > 100 * LION_TOL  # it trained: the comparison is not of untouched weights
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert set(opt.state[q]) == {"step", "exp_avg"}
        assert (opt.state[q]["exp_avg"] - momenta[p]).abs().max() < LION_TOL


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_bf16_state(tier, tmp_path):
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    train(ref, torch.optim.Adagrad(ref.parameters(), **ADAGRAD), data)
    train(mine, OffloadAdagrad(mine.parameters(), state_dtype="bf16", **ADAGRAD, **zoe_options(tier, tmp_path)),
          data)
    assert max_diff(ref, mine) < ADAGRAD_BF16_TOL
    # Lion against its rule with the momentum rounded to bf16 after each update, as zoe keeps it: the same
    # rounding on both sides, so fp32's tolerance holds.
    ref, mine = make_mlp(), make_mlp()
    train_lion_reference(ref, data, momenta_bf16=True)
    train(mine, OffloadLion(mine.parameters(), state_dtype="bf16", **LION, **zoe_options(tier, tmp_path / "lion")),
          data)
    assert max_diff(ref, mine) < LION_TOL


@pytest.mark.parametrize("cls,hyper", [(OffloadAdagrad, ADAGRAD), (OffloadLion, LION)], ids=["adagrad", "lion"])
def test_delayed_schedule(cls, hyper):
    data = batches(12)
    sync, delayed = make_mlp(), make_mlp()
    train(sync, cls(sync.parameters(), **hyper), data)
    opt = cls(delayed.parameters(), schedule="delayed", delayed_warmup_steps=4, **hyper)
    train(delayed, opt, data)
    opt.state_dict()  # waits for the step in flight
    assert opt.step_count == 12
    assert 0 < max_diff(sync, delayed) < DELAYED_TOL[cls._rule.name]
    # Its warm-up steps are sync's, bit for bit.
    sync, delayed = make_mlp(), make_mlp()
    train(sync, cls(sync.parameters(), **hyper), data[:4])
    train(delayed, cls(delayed.parameters(), schedule="delayed", delayed_warmup_steps=4, **hyper), data[:4])
    assert max_diff(sync, delayed) == 0.0


def test_adagrad_param_groups_and_lr_scheduler():
    """Hyper-parameters that change between steps (a scheduler's lr, a group's own) reach the engine."""
    data = batches(15)
    ref, mine = make_mlp(), make_mlp()

    def groups(model):
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.05},
                {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.02, "lr_decay": 0.0}]
    ro = torch.optim.Adagrad(groups(ref), **ADAGRAD)
    mo = OffloadAdagrad(groups(mine), **ADAGRAD)
    rs, ms = (torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (ro, mo))
    for (x, y) in data:
        for model, opt, sched in ((ref, ro, rs), (mine, mo, ms)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    assert max_diff(ref, mine) < PARITY_TOL
    assert mo._engine.hyper(1)["lr"] == pytest.approx(0.02 * 0.5 ** 3)


def _round_trip(cls, hyper, tmp_path, tier, torch_format: bool):
    data = batches(10)
    whole = make_mlp()
    train(whole, cls(whole.parameters(), **hyper, **zoe_options(tier, tmp_path / "whole")), data)
    first = make_mlp()
    opt = cls(first.parameters(), **hyper, **zoe_options(tier, tmp_path / "first"))
    train(first, opt, data[:5])
    buffer = io.BytesIO()
    torch.save(opt.torch_state_dict() if torch_format else opt.state_dict(), buffer)
    del opt
    resumed = make_mlp(seed=7)  # other weights: the load must bring the masters, not keep these
    resumed.load_state_dict(first.state_dict())
    opt = cls(resumed.parameters(), **hyper, **zoe_options(tier, tmp_path / "resumed"))
    opt.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    keys = {"step", *cls._rule.states}
    assert all(set(opt.state[p]) == keys for p in resumed.parameters())
    train(resumed, opt, data[5:])
    assert max_diff(whole, resumed) == 0.0
    return opt


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("cls,hyper", [(OffloadAdagrad, ADAGRAD), (OffloadLion, LION)], ids=["adagrad", "lion"])
def test_state_dict_round_trip_is_bitwise(cls, hyper, tier, tmp_path):
    opt = _round_trip(cls, hyper, tmp_path, tier, torch_format=False)
    sd = opt.state_dict()
    keys = {"step", *cls._rule.states}
    assert all(set(st) == keys for st in sd["state"].values()) and len(sd["state"]) == 6
    assert sd["zoe"]["optimizer"] == cls._rule.name


@pytest.mark.parametrize("cls,hyper", [(OffloadAdagrad, ADAGRAD), (OffloadLion, LION)], ids=["adagrad", "lion"])
def test_torch_format_round_trip_is_bitwise(cls, hyper, tmp_path):
    _round_trip(cls, hyper, tmp_path, "ram", torch_format=True)


def test_torch_adagrad_state_dict_loads_and_continues_as_torch():
    data = batches(10)
    ref, mine = make_mlp(), make_mlp()
    torch_opt = torch.optim.Adagrad(ref.parameters(), **ADAGRAD)
    train(ref, torch_opt, data[:5])
    mine.load_state_dict(ref.state_dict())
    opt = OffloadAdagrad(mine.parameters(), **ADAGRAD)
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.step_count == 5
    train(ref, torch_opt, data[5:])
    train(mine, opt, data[5:])
    assert max_diff(ref, mine) < PARITY_TOL
    # And back: zoe's torch-format state is what torch.optim.Adagrad loads.
    back = torch.optim.Adagrad(make_mlp().parameters(), **ADAGRAD)
    back.load_state_dict(opt.torch_state_dict())
    assert all(torch.equal(back.state[p]["sum"], opt.state[q]["sum"])
               for p, q in zip(back.param_groups[0]["params"], mine.parameters()))


def _stepped(cls, hyper, steps: int = 2):
    model = make_mlp()
    opt = cls(model.parameters(), **hyper)
    train(model, opt, batches(steps))
    return opt


@pytest.mark.parametrize("source,target", [
    ((OffloadOptimizer, dict(lr=1e-3)), (OffloadLion, LION)),
    ((OffloadLion, LION), (OffloadAdagrad, ADAGRAD)),
    ((OffloadAdagrad, ADAGRAD), (OffloadOptimizer, dict(lr=1e-3))),
], ids=["adam-into-lion", "lion-into-adagrad", "adagrad-into-adam"])
@pytest.mark.parametrize("form", ["zoe", "torch"])
def test_another_rules_state_is_refused(source, target, form):
    saved = _stepped(*source)
    sd = saved.state_dict() if form == "zoe" else saved.torch_state_dict()
    opt = _stepped(*target)
    before = {k: v.clone() for k, v in opt.read_state(opt.param_groups[0]["params"][0]).items()}
    with pytest.raises(ValueError, match="does not convert one optimizer's state into another's"):
        opt.load_state_dict(sd)
    after = opt.read_state(opt.param_groups[0]["params"][0])
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before anything changed


def test_torch_adam_state_dict_is_refused_by_lion():
    model = make_mlp()
    adam = torch.optim.AdamW(model.parameters())
    train(model, adam, batches(1))
    with pytest.raises(ValueError, match=r"Adam/AdamW \(state exp_avg, exp_avg_sq\).*runs Lion"):
        OffloadLion(model.parameters()).load_state_dict(adam.state_dict())


def test_refusals_by_name():
    params = list(make_mlp().parameters())
    with pytest.raises(zoe.UnsupportedError, match="state_dtype i8 is not supported for adagrad"):
        OffloadAdagrad(params, state_dtype="int8")  # a sum of squares has no 8-bit code (Lion's and Adam's m do)
    for cls in (OffloadLion, OffloadAdagrad):
        with pytest.raises(TypeError, match="unexpected keyword argument 'amsgrad'"):
            cls(params, amsgrad=True)
        with pytest.raises(ValueError, match="param group 0 has amsgrad=True, which is Adam's"):
            cls([{"params": params, "amsgrad": True}])
    with pytest.raises(ValueError, match="Invalid lr_decay value: -1.0"):
        OffloadAdagrad(params, lr_decay=-1.0)
    with pytest.raises(ValueError, match="Invalid initial_accumulator_value value: -0.5"):
        OffloadAdagrad([{"params": params, "initial_accumulator_value": -0.5}])
    with pytest.raises(ValueError, match="differentiable=True"):
        OffloadAdagrad(params, differentiable=True)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        OffloadLion(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid learning rate: -0.1"):
        OffloadLion(params, lr=-0.1)


def test_adagrad_initial_accumulator_per_group():
    """Each group's sum starts at its own initial_accumulator_value (the engine fills it per group)."""
    model = make_mlp()
    named = list(model.named_parameters())
    opt = OffloadAdagrad([{"params": [p for n, p in named if n.endswith("weight")]},
                          {"params": [p for n, p in named if n.endswith("bias")], "initial_accumulator_value": 2.0}],
                         initial_accumulator_value=0.5)
    train(model, opt, batches(1))
    for n, p in named:
        grad_sq = p.grad.float() ** 2
        expected = (2.0 if n.endswith("bias") else 0.5) + grad_sq
        assert torch.allclose(opt.state[p]["sum"], expected, rtol=1e-6, atol=0), n


def test_adagrad_param_group_added_later_starts_at_its_accumulator():
    """add_param_group after construction makes the engine anew (_regroup.py): the old parameters' state goes
    across, and the new ones' sum starts at their group's initial_accumulator_value."""
    model = make_mlp()
    first, last = list(model[0].parameters()), list(model[2].parameters()) + list(model[4].parameters())
    opt = OffloadAdagrad(first, **ADAGRAD)
    train(model, opt, batches(2))
    kept = {id(p): opt.state[p]["sum"].clone() for p in first}
    opt.add_param_group({"params": last, "initial_accumulator_value": 1.5, "weight_decay": 0.0})
    assert all(torch.equal(opt.state[p]["sum"], kept[id(p)]) for p in first)
    train(model, opt, batches(1, seed=5))
    for p in last:
        assert float(opt.state[p]["step"]) == 1.0
        assert torch.allclose(opt.state[p]["sum"], 1.5 + p.grad.float() ** 2, rtol=1e-6, atol=0)


def test_export_writes_the_rules_state_files(tmp_path):
    model = make_mlp()
    opt = OffloadLion(model.named_parameters(), **LION)
    train(model, opt, batches(2))
    files = zoe.torch.export_fp32(opt, tmp_path, moments=True)
    assert sorted(p.rsplit("/", 1)[1] for p in files) == ["exp_avg.safetensors", "model.safetensors"]
    from safetensors.torch import load_file
    momenta = load_file(str(tmp_path / "exp_avg.safetensors"))
    assert torch.equal(momenta["0.weight"], opt.state[model[0].weight]["exp_avg"])


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_lion_with_clipping_and_declared_accumulation(schedule):
    """OffloadOptimizer's machinery under another rule: two micro-batches summed in zoe's fp32 accumulator and
    the global norm clipped (max_grad_norm) before Lion's step — torch's clip_grad_norm_ and a summed gradient
    on the reference side. Clipping matters to Lion: the momentum mixes scaled and unscaled gradients."""
    data = batches(16)
    ref, mine = make_mlp(), make_mlp()
    step, _ = lion_reference(list(ref.parameters()), LION["lr"], LION["betas"], LION["weight_decay"])
    opt = OffloadLion(mine.parameters(), schedule=schedule, max_grad_norm=0.05, gradient_accumulation_steps=2,
                      **LION)
    norms = []
    for k in range(0, len(data), 2):
        ref.zero_grad()
        opt.zero_grad()
        for x, y in data[k:k + 2]:
            torch.nn.functional.mse_loss(ref(x), y).backward()
            torch.nn.functional.mse_loss(mine(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        step()
        opt.step()
    assert min(norms) > 0.05  # every step was clipped
    assert max_diff(ref, mine) < LION_TOL


@pytest.mark.parametrize("cls", [OffloadAdagrad, OffloadLion], ids=["adagrad", "lion"])
def test_fp16_weights_with_dynamic_loss_scaling(cls):
    """fp16 weights: zoe scales the loss (its default for fp16), unscales the gradients and steps the fp32
    masters. Against the fp32 rule, apart by the fp16 rounding the forward pass and the gradients see (and, for
    Lion, the signs it flips: 2 * lr each) over 20 steps: measured 1.2e-4 (Adagrad) and 6.2e-4 (Lion), bounded
    at 2e-3 — while each training moved the weights by 3.8e-2 and 6.1e-3, which the bound must stay below."""
    data = batches(20)
    ref, mine = make_mlp(), make_mlp(dtype=torch.float16)
    if cls is OffloadAdagrad:
        train(ref, torch.optim.Adagrad(ref.parameters(), **ADAGRAD), data)
    else:
        train_lion_reference(ref, data)
    opt = cls(mine.parameters(), **(ADAGRAD if cls is OffloadAdagrad else LION))
    train(mine, opt, data, scale_loss=True)
    assert opt._flat.loss_scaling and opt.loss_scale > 1
    assert max_diff(ref, mine) < 2e-3
    assert max_diff(ref, make_mlp()) > 2 * 2e-3


def test_engine_groups_and_set_hyper_by_the_table():
    """The binding's groups and set_hyper read the optimizer table: a rule's own fields only, and the rule and
    amsgrad fixed once the engine is made (its state arrays were allocated for them)."""
    import numpy as np
    w, g = np.zeros(8, dtype=np.float32), np.ones(8, dtype=np.float32)
    params = [(8, "f32", w, g, 0, "w", [8])]
    with pytest.raises(ValueError, match="eps is not a hyper-parameter of lion"):
        zoe.Engine(zoe.host_device(), [dict(optimizer="lion", eps=1e-3)], params, zoe.EngineOptions())
    engine = zoe.Engine(zoe.host_device(), [dict(optimizer="lion", lr=1e-3)], params, zoe.EngineOptions())
    assert engine.hyper(0)["optimizer"] == "lion" and engine.hyper(0)["beta2"] == pytest.approx(0.99)
    engine.set_hyper(0, lr=2e-3)
    assert engine.hyper(0)["lr"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="fixed when the engine is made"):
        engine.set_hyper(0, optimizer="adam")
    assert engine.hyper(0)["optimizer"] == "lion"
    adam = zoe.Engine(zoe.host_device(), [dict(lr=1e-3)], params, zoe.EngineOptions())
    with pytest.raises(ValueError, match="fixed when the engine is made"):
        adam.set_hyper(0, amsgrad=True)
    assert adam.hyper(0)["amsgrad"] is False


@pytest.mark.parametrize("cls,hyper", [(OffloadAdagrad, ADAGRAD), (OffloadLion, LION)], ids=["adagrad", "lion"])
def test_a_load_across_parameter_dtypes_and_a_join_carry_the_rules_state(cls, hyper):
    """An fp32 run's state_dict resumed on a bf16 model (torch's format inside, through the join of
    consolidate_state_dicts): the masters and the rule's state arrays go across unrounded."""
    from zoe.torch import consolidate_state_dicts

    model = make_mlp()
    opt = cls(model.parameters(), **hyper)
    train(model, opt, batches(4))
    bf16 = make_mlp(dtype=torch.bfloat16)
    bopt = cls(bf16.parameters(), **hyper)
    bopt.load_state_dict(opt.state_dict())
    joined = consolidate_state_dicts([opt.state_dict()])
    for i, (p, q) in enumerate(zip(model.parameters(), bf16.parameters())):
        assert set(bopt.state[q]) == set(opt.state[p])
        for k in opt._flat.states:
            assert torch.equal(opt.state[p][k], bopt.state[q][k]), k
            assert torch.equal(joined["state"][i][k], opt.state[p][k]), k
        assert torch.equal(bopt.read_state(q)["master"], opt.read_state(p)["master"])
    adam = OffloadOptimizer(make_mlp().parameters())
    with pytest.raises(ValueError, match="state_dict 1 was saved by an optimizer running Adam/AdamW"):
        consolidate_state_dicts([opt.state_dict(), adam.state_dict()])


def _int8_codes(m: torch.Tensor) -> torch.Tensor:
    """zoe's 8-bit code of a moment (simd/kernels.h), written out in fp32 torch: per block of 2048 elements
    from the tensor's first, scale = max |m|, code = round-half-even(m * (127 / scale)), m' = code * (scale /
    127) — each a single fp32 operation, as in the kernels."""
    flat = m.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), 2048):
        block = flat[start:start + 2048]
        scale = block.abs().max()
        if scale == 0:
            out[start:start + 2048] = 0.0
            continue
        code = torch.round(block * (torch.tensor(127.0) / scale)).clamp(-127, 127)
        out[start:start + 2048] = code * (scale / torch.tensor(127.0))
    return out.view_as(m)


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_lion_int8_moment(tier, tmp_path):
    """Lion's momentum in zoe's 8-bit code against the rule in torch with the same code applied after each
    update (one fp32 operation at a time, as the kernels do): the same bits unless a rounding lands on a
    code boundary, LION_TOL as for fp32; tiers and schedules bit for bit; a state_dict resumes bit for bit."""
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    step, momenta = lion_reference(list(ref.parameters()), LION["lr"], LION["betas"], LION["weight_decay"])
    for x, y in data:
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        step()
        with torch.no_grad():
            for m in momenta.values():
                m.copy_(_int8_codes(m))
    opt = OffloadLion(mine.parameters(), state_dtype="int8", **LION, **zoe_options(tier, tmp_path))
    train(mine, opt, data)
    assert max_diff(ref, mine) < LION_TOL
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert (opt.state[q]["exp_avg"] - momenta[p]).abs().max() < LION_TOL
    fp32 = make_mlp()
    train(fp32, OffloadLion(fp32.parameters(), **LION), data)
    assert max_diff(fp32, mine) > 0, "the codes are in effect"
    overlap = make_mlp()
    train(overlap, OffloadLion(overlap.parameters(), state_dtype="int8", schedule="overlap", **LION,
                               **zoe_options(tier, tmp_path / "overlap")), data)
    assert max_diff(overlap, mine) == 0.0
    # Resume: 10 steps, state_dict, a new optimizer, 10 more, as the 20 uninterrupted.
    first = make_mlp()
    fopt = OffloadLion(first.parameters(), state_dtype="int8", **LION, **zoe_options(tier, tmp_path / "a"))
    train(first, fopt, data[:10])
    resumed = make_mlp()
    resumed.load_state_dict(first.state_dict())
    ropt = OffloadLion(resumed.parameters(), state_dtype="int8", **LION, **zoe_options(tier, tmp_path / "b"))
    ropt.load_state_dict(fopt.state_dict())
    train(resumed, ropt, data[10:])
    assert max_diff(resumed, mine) == 0.0
