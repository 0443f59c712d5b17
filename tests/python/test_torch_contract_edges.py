"""The edges of torch.optim.AdamW's contract a trainer meets, each beside torch.optim.AdamW on the same
gradients: zero-size parameters, p.grad as torch.nn.utils.clip_grad_norm_ leaves it, load_state_dict into
parameters of another dtype, add_param_group after construction (Lightning's BaseFinetuning unfreezes layers
with it)."""
import warnings

import pytest
import torch

from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, max_diff

# fp32 zoe against fp32 torch: only the order of float operations in each element's update differs
# (test_optimizer.py's PARITY_TOL, measured 7.5e-8 after 50 steps).
PARITY_TOL = 1e-5
HYPER = dict(lr=3e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)
SCHEDULES = [dict(schedule="sync"), dict(schedule="overlap"), dict(schedule="sync", gradient_accumulation_steps=2),
             dict(schedule="overlap", gradient_accumulation_steps=2)]


def _ids(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


def _mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


# ---- zero-size parameters ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(schedule="sync"), dict(schedule="overlap"), dict(tier="nvme")], ids=_ids)
def test_zero_size_parameters_are_held_and_step_as_torchs(kw, tmp_path):
    """A zero-size parameter between others (torch steps it as nothing; before, zoe took the next
    parameter's gradient for it)."""
    if kw.get("tier") == "nvme":
        kw = dict(kw, nvme_path=str(tmp_path / "swap"))
    dtype = torch.bfloat16 if kw.get("tier") == "nvme" else torch.float32

    def params():
        torch.manual_seed(0)
        shapes = [(0,), (3, 4), (2, 0), (5,), (0, 7)]
        return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]

    ref, mine = params(), params()
    ro, mo = torch.optim.AdamW(ref, **HYPER), OffloadOptimizer(mine, **HYPER, **kw)
    for i in range(3):
        for ps, opt in ((ref, ro), (mine, mo)):
            g = torch.Generator().manual_seed(i)
            loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in ps)
            loss.backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(ref, mine):
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().max().item() < (1e-2 if dtype == torch.bfloat16 else PARITY_TOL) \
            if a.numel() else True
    assert len(mo.state_dict()["param_groups"][0]["params"]) == 5


# ---- clip_grad_norm_ and p.grad -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", SCHEDULES, ids=_ids)
def test_clip_grad_norm_leaves_p_grad_as_torch_does_and_the_step_exact(kw):
    """torch.nn.utils.clip_grad_norm_ over the model's parameters (zoe answers it): afterwards p.grad holds
    torch's clipped values, the step is AdamW's on them, and nothing is taken again or warned about."""
    data = batches(6)
    ref, mine = make_mlp(), make_mlp()
    ro, mo = torch.optim.AdamW(ref.parameters(), **HYPER), OffloadOptimizer(mine.parameters(), **HYPER, **kw)
    micro = kw.get("gradient_accumulation_steps", 1)
    clipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "the gradients changed after backward" would be a warning
        for t, (x, y) in enumerate(data):
            for model in (ref, mine):
                for k in range(micro):
                    half = slice(k * len(x) // micro, (k + 1) * len(x) // micro)
                    (_mse(model, x[half], y[half]) / micro).backward()
            max_norm = 0.02 if t % 2 else 1e3  # clipping on every other step
            # What torch's clip makes of zoe's model's own gradients (the two models' weights, and so their
            # gradients, differ by the optimizers' rounding after the first step).
            expected = [p.grad.detach().clone() for p in mine.parameters()]
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected]))
            torch._foreach_mul_(expected, torch.clamp(max_norm / (total + 1e-6), max=1.0))
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            n_mine = torch.nn.utils.clip_grad_norm_(mine.parameters(), max_norm)
            assert abs(float(n_ref) - float(n_mine)) <= 1e-5 * float(n_ref)
            clipped += float(n_ref) > max_norm
            for e, b in zip(expected, mine.parameters()):
                # zoe's norm is summed in double, torch's in fp32: the coefficients differ in the last bits.
                assert torch.allclose(e, b.grad, rtol=1e-5, atol=1e-9)
            ro.step()
            mo.step()
            ro.zero_grad()
            mo.zero_grad()
    assert clipped == 3
    assert max_diff(ref, mine) < PARITY_TOL
    if kw["schedule"] == "overlap":
        # Only the clipped steps are redone (their speculative steps assumed no clipping); not the others.
        assert mo.stats()["redone"] <= clipped


def test_a_trainer_that_edits_p_grad_after_zoes_clipping_gets_its_edit_stepped_once():
    """After zoe's clipping the trainer scales p.grad itself: the step uses p.grad as it is then, clipped
    once (not clipped again by the coefficient zoe applied for it)."""
    data = batches(3)
    ref, mine = make_mlp(), make_mlp()
    ro, mo = torch.optim.AdamW(ref.parameters(), **HYPER), OffloadOptimizer(mine.parameters(), **HYPER,
                                                                           schedule="overlap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the edit costs the overlap, and says so
        for x, y in data:
            for model, opt in ((ref, ro), (mine, mo)):
                _mse(model, x, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                for p in model.parameters():
                    p.grad.mul_(0.5)
                opt.step()
                opt.zero_grad()
    assert max_diff(ref, mine) < PARITY_TOL


# ---- load_state_dict across parameter dtypes --------------------------------------------------------------

@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16])
def test_load_state_dict_into_parameters_of_another_dtype(to):
    """An fp32 run's state_dict loaded by an optimizer over the same model in bf16/fp16: torch casts the state
    to the parameters' dtype; zoe keeps its fp32 state as it is (masters, moments, each parameter's step),
    and the model's weights become the masters rounded."""
    data = batches(3)
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    for x, y in data:
        _mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    other = make_mlp(seed=3, dtype=to)
    again = OffloadOptimizer(other.parameters(), **HYPER, loss_scale=False)  # no fp16 scale to carry across
    again.load_state_dict(sd)
    for p, q in zip(model.parameters(), other.parameters()):
        a, b = opt.read_state(p), again.read_state(q)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(q, a["master"].to(to))
        assert again.state[q]["step"] == opt.state[p]["step"]
    # And the step after it: torch's, from the fp32 state, on the new dtype's gradients.
    x, y = batches(1, seed=9)[0]
    _mse(other, x, y).backward()
    again.step()
    assert again.step_count == 4


# ---- add_param_group after construction -------------------------------------------------------------------

def _unfreeze_run(make, at=2, steps=5):
    torch.manual_seed(0)
    model = make_mlp()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head, body = layers[-1], layers[:-1]
    for m in body:
        m.requires_grad_(False)
    opt = make(list(head.parameters()))
    for t, (x, y) in enumerate(batches(steps)):
        if t == at:
            for m in body:
                m.requires_grad_(True)
            opt.add_param_group({"params": [p for m in body for p in m.parameters()], "lr": HYPER["lr"] / 10})
        _mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("kw", [dict(schedule="sync"), dict(schedule="overlap"), dict(schedule="delayed",
                                                                                         delayed_warmup_steps=1)],
                         ids=_ids)
def test_add_param_group_after_steps_gives_torchs_steps(kw):
    ref, ro = _unfreeze_run(lambda ps: torch.optim.AdamW(ps, **HYPER))
    mine, mo = _unfreeze_run(lambda ps: OffloadOptimizer(ps, **HYPER, **kw))
    assert [g["lr"] for g in mo.param_groups] == [g["lr"] for g in ro.param_groups]
    ref_steps = {i: float(s["step"]) for i, s in ro.state_dict()["state"].items()}
    mine_steps = {i: float(mine_state["step"]) for i, mine_state in mo.torch_state_dict()["state"].items()}
    assert mine_steps == ref_steps  # the head's 5, the body's 3
    if kw["schedule"] != "delayed":  # one step stale by design
        assert max_diff(ref, mine) < PARITY_TOL


def test_add_param_group_keeps_the_state_of_the_others_bitwise():
    model = make_mlp()
    params = list(model.parameters())
    opt = OffloadOptimizer(params[:2], **HYPER, state_dtype="int8")
    for x, y in batches(2):
        _mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    before = {i: opt.read_state(p) for i, p in enumerate(params[:2])}
    steps = opt.step_count
    opt.add_param_group({"params": params[2:]})
    assert opt.step_count == steps
    for i, p in enumerate(params[:2]):
        after = opt.read_state(p)
        assert all(torch.equal(before[i][k], after[k]) for k in after)
    assert params[2] not in opt.state  # no state before its first step, as torch's


def test_add_param_group_refuses_a_bad_group_and_keeps_the_optimizer():
    model = make_mlp()
    params = list(model.parameters())
    opt = OffloadOptimizer(params[:2], **HYPER)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": params[2:], "lr": -1.0})
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": params[:1]})
    assert len(opt.param_groups) == 1
    x, y = batches(1)[0]
    _mse(model, x, y).backward()
    opt.step()
    assert opt.step_count == 1


# ---- what a review found (each failed before its fix) ---------------------------------------------------------

def _host_device(monkeypatch):
    """The host stand-in: a device with memory of its own, where the engine steps copies of the gradients
    (the paths a GPU takes, without one)."""
    import zoe
    import zoe.torch

    monkeypatch.setattr(zoe.torch, "_cpu_device", zoe.host_device)


@pytest.mark.parametrize("where", ["cpu", "host", "accumulated"])
def test_a_second_clip_in_one_iteration_sees_the_first(where, monkeypatch):
    """torch clips twice as told: the second norm is the first-clipped gradients', and p.grad holds both
    coefficients. zoe the same, where it steps p.grad in place, a copy, or its fp32 sum of micro-batches."""
    if where == "host":
        _host_device(monkeypatch)
    kw = dict(gradient_accumulation_steps=2) if where == "accumulated" else {}
    x, y = batches(1)[0]
    ref, mine = make_mlp(), make_mlp()
    ro, mo = torch.optim.AdamW(ref.parameters(), **HYPER), OffloadOptimizer(mine.parameters(), **HYPER, **kw)
    norms = {}
    for name, model, opt in (("torch", ref, ro), ("zoe", mine, mo)):
        for k in range(2 if kw else 1):
            (_mse(model, x[k::2] if kw else x, y[k::2] if kw else y) / (2 if kw else 1)).backward()
        norms[name] = [float(torch.nn.utils.clip_grad_norm_(model.parameters(), m)) for m in (0.2, 0.05)]
        opt.step()
    assert norms["zoe"] == pytest.approx(norms["torch"], rel=1e-5)
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-9)
    assert max_diff(ref, mine) < PARITY_TOL


def test_clipping_a_gradient_zoe_copied_clips_it_once():
    """A p.grad the engine cannot read where it is (not contiguous) is copied into zoe's buffer: clipped
    there too, not twice."""
    data = batches(3)
    ref, mine = make_mlp(), make_mlp()
    ro, mo = torch.optim.AdamW(ref.parameters(), **HYPER), OffloadOptimizer(mine.parameters(), **HYPER)
    for x, y in data:
        for model, opt in ((ref, ro), (mine, mo)):
            _mse(model, x, y).backward()
            w = model[0].weight
            w.grad = w.grad.t().contiguous().t()  # the same values, not contiguous
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
    assert max_diff(ref, mine) < PARITY_TOL


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_a_gradient_that_arrives_after_the_norm_is_stepped(device, monkeypatch):
    """An unused parameter has no gradient when the trainer logs the norm, then gets one before step():
    torch steps it, and so does zoe."""
    if device == "host":
        _host_device(monkeypatch)

    def run(make):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt = make(list(a.parameters()) + list(b.parameters()))
        for t in range(3):
            x = torch.randn(2, 4)
            a(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(list(a.parameters()) + list(b.parameters()), 1e6)
            if t == 2:
                b(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return b.weight.detach().clone()

    ref = run(lambda ps: torch.optim.AdamW(ps, **HYPER))
    mine = run(lambda ps: OffloadOptimizer(ps, **HYPER))
    assert (ref - mine).abs().max().item() < PARITY_TOL


def test_add_param_group_keeps_a_weight_edit_since_the_last_step():
    model = make_mlp(dtype=torch.bfloat16)
    params = list(model.parameters())
    opt = OffloadOptimizer(params[:2], **HYPER)
    x, y = batches(1)[0]
    _mse(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        params[0].fill_(1.0)  # a trainer's edit (model.load_state_dict, nn.init) between steps
    opt.add_param_group({"params": params[2:]})
    assert bool((params[0] == 1.0).all())
    assert bool((opt.read_state(params[0])["master"] == 1.0).all())


def test_add_param_group_keeps_the_group_dicts_and_other_state():
    model = make_mlp()
    params = list(model.parameters())
    opt = OffloadOptimizer(params[:2], **HYPER)
    first, groups = opt.param_groups[0], opt.param_groups
    opt.state["my_hook_key"] = {"seen": 1}
    new = {"params": params[2:], "lr": 1e-4}
    opt.add_param_group(new)
    assert opt.param_groups is groups and opt.param_groups[0] is first and opt.param_groups[1] is new
    assert opt.state["my_hook_key"] == {"seen": 1}
    first["lr"] = 0.0  # a scheduler's write through the dict it holds reaches the step
    before = params[0].detach().clone()
    x, y = batches(1)[0]
    _mse(model, x, y).backward()
    opt.step()
    assert torch.equal(params[0], before)
