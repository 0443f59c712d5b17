"""zoe.torch.offload_parameters with zoe's own OffloadOptimizer and parameter tier (C++), as a user runs them:
a 12-layer GPT whose 16-bit weights are 8x the device pool trains bit-identically to the same model with its
weights resident, for the cpu and nvme homes and the sync and overlap schedules. The optimizer writes the
updated weights into the tier; the pool's peak (counted by the tier) stays within its budget."""
import copy
import math

import pytest
import torch

from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, Block, GPTConfig
from zoe.torch import OffloadOptimizer, offload_parameters

# Small enough for CI's 2 cores; 12 layers, so that a pool of 1/8 of the weights holds the root block (embeddings,
# final norm: in use for the whole forward) and one layer.
CONFIG = dict(seq=32, d_model=128, n_layer=12, n_head=4, compute_dtype=torch.float32)
STEPS = 20


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG)).to(torch.bfloat16)


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _train(model, schedule, tier_args, steps=STEPS):
    opt = OffloadOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01, schedule=schedule, **tier_args)
    data = ByteBatches(model.config.seq, 4, seed=0)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return opt, losses


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_gpt_trains_bitwise_as_resident(home, schedule, tmp_path):
    reference = _gpt()
    model = copy.deepcopy(reference)
    budget = _weight_bytes(model) // 8
    nvme = dict(nvme_path=str(tmp_path / "params")) if home == "nvme" else {}
    if nvme:
        (tmp_path / "params").mkdir()
    off = offload_parameters(model, device=home, prefetch=2, budget_bytes=budget, block_modules=(Block,), **nvme)
    assert len(off.blocks) == 1 + CONFIG["n_layer"]
    assert all(p.numel() == 0 for p in model.parameters())  # the weights are in the tier between uses

    ref_opt, want = _train(reference, schedule, {})
    opt, got = _train(model, schedule, {})
    assert [float(x) for x in got] == [float(x) for x in want]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    full = off.full_state_dict()
    for name, w in reference.state_dict().items():
        assert torch.equal(full[name], w), name
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        a, b = opt.read_state(p), ref_opt.read_state(p_ref)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    s = off.stats()
    assert s["budget_bytes"] <= budget and s["pool_peak_bytes"] <= s["budget_bytes"]
    assert all(off.tier.in_use(b) == 0 for b in range(len(off.blocks)))
    assert opt.step_count == STEPS
    del opt, ref_opt
    off.remove()
    for name, w in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], w), name  # remove() puts the trained weights back


def test_the_optimizer_step_writes_the_tier_and_the_next_forward_sees_it():
    model = _gpt()
    off = offload_parameters(model, prefetch=1, budget_bytes=_weight_bytes(model) // 4, block_modules=(Block,))
    opt = OffloadOptimizer(model.parameters(), lr=1e-2)
    x, y = ByteBatches(model.config.seq, 2, seed=3).next()
    before = off.full_state_dict()
    _, loss = model(x, y)
    loss.backward()
    loss = loss.detach()
    opt.step()
    after = off.full_state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every weight moved, in the tier
    with torch.no_grad():
        _, loss2 = model(x, y)
    assert math.isfinite(float(loss2)) and float(loss2) != float(loss)


def test_remove_waits_for_the_optimizer_that_writes_into_the_tier(tmp_path):
    model = _gpt()
    off = offload_parameters(model, device="nvme", nvme_path=str(tmp_path), block_modules=(Block,))
    opt = OffloadOptimizer(model.parameters())
    with pytest.raises(RuntimeError, match="delete the optimizer first"):
        off.remove()
    assert all(p.numel() == 0 for p in model.parameters())  # nothing was undone
    del opt
    off.remove()
    assert list(tmp_path.iterdir()) == []  # the NVMe parameter file went with the tier
    assert all(p.numel() > 0 for p in model.parameters())


def test_a_budget_below_one_block_is_refused_naming_it():
    model = _gpt()
    with pytest.raises(Exception, match=r"block '\(root\)' needs \d+ bytes on the device, more than the pool's budget"):
        offload_parameters(model, budget_bytes=4096, block_modules=(Block,))
    assert all(p.numel() > 0 for p in model.parameters())  # refused before anything was moved


def test_gradient_accumulation_with_offloaded_parameters_is_bitwise():
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    losses = []
    for m in (reference, model):
        opt = OffloadOptimizer(m.parameters(), lr=3e-3, gradient_accumulation_steps=2, schedule="overlap")
        data = ByteBatches(m.config.seq, 2, seed=5)
        run = []
        for _ in range(4):
            opt.zero_grad()
            for _ in range(2):
                x, y = data.next()
                _, loss = m(x, y)
                (loss / 2).backward()
                run.append(float(loss.detach()))
            opt.step()
        losses.append(run)
        del opt
    assert losses[0] == losses[1]
    full = off.full_state_dict()
    for name, w in reference.state_dict().items():
        assert torch.equal(full[name], w), name
