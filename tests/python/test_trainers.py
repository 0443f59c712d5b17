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
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
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


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trainer_clipping_after_backward_is_in_the_step(schedule):
    data = batches(12)
    ref = torch_run(data, clip=True)
    mine = make_mlp()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(mine, zoe_opt(mine, schedule), data, clip="torch")
    assert max_diff(ref, mine) < TORCH_TOL
    told = [w for w in seen if "gradients changed after backward" in str(w.message)]
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
    run(mine, opt, data, clip="torch")
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zoe's own clipping changes no gradient: nothing to warn about
        for x, y in data:
            for model, opt in ((ref, ro), (mine, mo)):
                loss_of(model, x, y, 1).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            got = mo.clip_grad_norm_(0.05)
            # The norm in float32 by torch, in double by zoe: float32 roundings of a sum of squares.
            assert abs(got.item() - want.item()) <= 1e-5 * want.item()
            for opt in (ro, mo):
                opt.step()
                opt.zero_grad()
    assert max_diff(ref, mine) < TORCH_TOL
    # One-shot: the next step, without a call, is not clipped.
    assert mo.stats()["last_grad_norm"] > 0.05


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
