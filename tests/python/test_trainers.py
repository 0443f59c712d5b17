"""zoe.torch.OffloadOptimizer under the trainers people run: gradients clipped or edited by the trainer after
backward, gradient accumulation over several backward passes, zoe's own clip_grad_norm_, Hugging Face
Trainer and Accelerate's loop (tiny models built from local configs, no downloads)."""
import warnings

import pytest
import torch

from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, max_diff

# fp32 models: zoe against torch.optim.AdamW differs only by the order of float operations inside each
# element's update (see PARITY_TOL in test_optimizer.py: ~1e-7 measured); the bound.
TORCH_TOL = 1e-5
HYPER = dict(lr=1e-2, weight_decay=0.01)
SCHEDULES = ["sync", "overlap", "delayed"]


def loss_of(model, x, y, accumulation):
    return torch.nn.functional.mse_loss(model(x), y) / accumulation


def run(model, opt, data, accumulation=1, clip=None, between=None):
    """The usual loop: `accumulation` backward passes, then the trainer's own clipping (or `between`), step."""
    for i in range(0, len(data), accumulation):
        for x, y in data[i:i + accumulation]:
            loss_of(model, x, y, accumulation).backward()
        if clip == "torch":  # looked up at the call, as trainers do: zoe answers it for its optimizers
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif clip == "torch-bound":  # torch's own function, bound before: it clips p.grad in place
            torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 0.05)
        elif clip == "zoe":
            opt.clip_grad_norm_(0.05)
        if between:
            between(model)
        opt.step()
        opt.zero_grad()


def zoe_opt(model, schedule, **kw):
    # delayed here runs its sync warm-up throughout: comparable with torch; its staleness is tested below.
    return OffloadOptimizer(model.parameters(), schedule=schedule, delayed_warmup_steps=1000, **HYPER, **kw)


def torch_run(data, accumulation=1, clip=None):
    model = make_mlp()
    run(model, torch.optim.AdamW(model.parameters(), **HYPER), data, accumulation,
        "torch" if clip else None)
    return model


@pytest.mark.parametrize("clip", ["torch", "torch-bound"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trainer_clipping_after_backward_is_in_the_step(schedule, clip):
    data = batches(12)
    ref = torch_run(data, clip=True)
    mine = make_mlp()
    opt = zoe_opt(mine, schedule)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(mine, opt, data, clip=clip)
    assert max_diff(ref, mine) < TORCH_TOL
    told = [w for w in seen if "gradients changed after backward" in str(w.message)]
    if clip == "torch":
        # zoe answered: p.grad was not edited (overlap and delayed would have said so) — the clip is in the step.
        assert not told
    else:
        # Said once, and only where it costs something (sync reads the gradients at step() anyway).
        assert len(told) == (0 if schedule == "sync" else 1)
        assert "max_grad_norm" in str(told[0].message) if told else True


def test_overlap_with_trainer_clipping_equals_sync_bitwise():
    data = batches(12)
    sync, overlap = make_mlp(), make_mlp()
    run(sync, zoe_opt(sync, "sync"), data, clip="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(overlap, zoe_opt(overlap, "overlap"), data, clip="torch")
    assert max_diff(sync, overlap) == 0.0


def test_any_in_place_edit_is_seen():
    def edit(model):
        with torch.no_grad():
            model[0].weight.grad[3].mul_(-2.0)
    data = batches(8)
    ref = make_mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, between=edit)
    mine = make_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(mine, zoe_opt(mine, "overlap"), data, between=edit)
    assert max_diff(ref, mine) < TORCH_TOL


def test_replaced_gradient_tensor_is_seen():
    def replace(model):
        model[2].bias.grad = model[2].bias.grad * 3.0
    data = batches(8)
    ref = make_mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, between=replace)
    mine = make_mlp()
    run(mine, zoe_opt(mine, "overlap"), data, between=replace)
    assert max_diff(ref, mine) < TORCH_TOL


def test_mutation_without_the_detection_overlap_steps_unclipped_gradients():
    """The detection is what makes the tests above pass: turned off, overlap keeps its speculative steps."""
    data = batches(12)
    ref = torch_run(data, clip=True)
    mine = make_mlp()
    opt = zoe_opt(mine, "overlap")
    opt._check_changes = False
    run(mine, opt, data, clip="torch-bound")
    assert max_diff(ref, mine) > 100 * TORCH_TOL


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("accumulation", [2, 3])
@pytest.mark.parametrize("declared", [True, False])
def test_gradient_accumulation(schedule, accumulation, declared):
    data = batches(12)
    ref = torch_run(data, accumulation, clip=True)
    mine = make_mlp()
    opt = zoe_opt(mine, schedule, gradient_accumulation_steps=accumulation if declared else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(mine, opt, data, accumulation, clip="torch")
    assert max_diff(ref, mine) < TORCH_TOL
    assert opt.step_count == 12 // accumulation


@pytest.mark.parametrize("schedule", ["overlap", "delayed"])
def test_more_backward_passes_than_declared_is_an_error(schedule):
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), schedule=schedule, delayed_warmup_steps=0,
                           gradient_accumulation_steps=1, **HYPER)
    (x, y), (x2, y2) = batches(2)
    loss_of(model, x, y, 1).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        loss_of(model, x2, y2, 1).backward()


def test_bad_gradient_accumulation_steps():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            OffloadOptimizer(make_mlp().parameters(), gradient_accumulation_steps=bad)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_clip_grad_norm_is_torchs_and_keeps_the_overlap(schedule):
    data = batches(12)
    ref = make_mlp()
    ro = torch.optim.AdamW(ref.parameters(), **HYPER)
    mine = make_mlp()
    mo = zoe_opt(mine, schedule)
    norms = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zoe's own clipping is no trainer's edit: nothing to warn about
        for x, y in data:
            for model, opt in ((ref, ro), (mine, mo)):
                loss_of(model, x, y, 1).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            got = mo.clip_grad_norm_(0.05)
            # The norm in float32 by torch, in double by zoe: float32 roundings of a sum of squares.
            assert abs(got.item() - want.item()) <= 1e-5 * want.item()
            norms.append(got.item())
            for opt in (ro, mo):
                opt.step()
                opt.zero_grad()
    assert max_diff(ref, mine) < TORCH_TOL
    assert max(norms) > 0.05  # clipping was active


def test_delayed_with_accumulation_trains_like_sync():
    data = batches(24, batch=64)
    finals = {}
    for schedule in ("sync", "delayed"):
        model = make_mlp()
        opt = OffloadOptimizer(model.parameters(), schedule=schedule, delayed_warmup_steps=2,
                               gradient_accumulation_steps=2, lr=3e-3)
        run(model, opt, data, 2)
        opt.state_dict()  # waits for the step in flight: its weights are in the model
        with torch.no_grad():
            finals[schedule] = sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in data) / len(data)
    # One step stale, 12 steps: the final loss within 2% of sync's (the bound).
    assert abs(finals["delayed"] - finals["sync"]) <= 0.02 * finals["sync"]


def test_bf16_micro_batches_are_summed_in_fp32_on_the_host():
    """8 micro-batches of a bf16 model, accumulation declared: the gradient zoe steps with is the float64 sum
    of the micro-batch gradients to within fp32 roundings; torch's .grad accumulation in bf16 is shown beside."""
    k, beta1 = 8, 0.9
    data = batches(k, batch=32)
    # Each micro-batch's own bf16 gradient, computed alone.
    ref = make_mlp(dtype=torch.bfloat16)
    per_batch = []
    for x, y in data:
        ref.zero_grad(set_to_none=True)
        loss_of(ref, x.bfloat16(), y.bfloat16(), k).backward()
        per_batch.append([p.grad.clone() for p in ref.parameters()])
    exact = [sum(g[i].double() for g in per_batch) for i in range(len(per_batch[0]))]
    magnitude = [sum(g[i].double().abs() for g in per_batch) for i in range(len(per_batch[0]))]
    # torch: the same micro-batches accumulated in p.grad, in bf16.
    ref.zero_grad(set_to_none=True)
    for x, y in data:
        loss_of(ref, x.bfloat16(), y.bfloat16(), k).backward()
    torch_err = max(((p.grad.double() - e).abs() / m.clamp_min(1e-30)).max().item()
                    for p, e, m in zip(ref.parameters(), exact, magnitude))
    mine = make_mlp(dtype=torch.bfloat16)
    opt = OffloadOptimizer(mine.parameters(), lr=1e-3, betas=(beta1, 0.999), gradient_accumulation_steps=k)
    for x, y in data:
        loss_of(mine, x.bfloat16(), y.bfloat16(), k).backward()
    # The trainer's view after the last micro-batch: the fp32 sum (micro-batch order, one rounding per
    # addition, as torch's float32 additions round) rounded once to bf16.
    for i, p in enumerate(mine.parameters()):
        fp32_sum = per_batch[0][i].float()
        for g in per_batch[1:]:
            fp32_sum = fp32_sum + g[i].float()
        assert torch.equal(p.grad, fp32_sum.bfloat16())
    opt.step()
    # After step 1, exp_avg = (1 - beta1) g rounded once: the stepped gradient to within 2^-24 relative.
    zoe_err = 0.0
    for p, e, m in zip(mine.parameters(), exact, magnitude):
        stepped = opt.read_state(p)["exp_avg"].double() / (1 - beta1)
        err = (stepped - e).abs()
        # k - 1 fp32 additions (2^-24 of the running sum's size, at most the sum of magnitudes) and the moment's
        # rounding (2^-23 of the result).
        assert (err <= (k - 1) * 2.0 ** -24 * m + 2.0 ** -22 * e.abs()).all()
        zoe_err = max(zoe_err, (err / m.clamp_min(1e-30)).max().item())
    print(f"8 bf16 micro-batches, error of the accumulated gradient relative to the sum of magnitudes: zoe (fp32 on "
          f"the host) {zoe_err:.2e}, torch .grad in bf16 {torch_err:.2e}")
    assert zoe_err < 1e-6
