"""Data-parallel partitioning: two gloo processes, each owning half of the optimizer state and stepping on
half of every batch, end with the weights a single process gets from the same averaged gradients."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batches, make_mlp  # noqa: E402

STEPS = 15
HYPER = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _rank_main(rank, world, init_file, out_dir, options):
    from zoe.torch import OffloadOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # Different seeds per rank: the optimizer must broadcast rank 0's weights first.
    model = make_mlp(seed=rank)
    opt = OffloadOptimizer(model.parameters(), **HYPER, **options)
    for x, y in batches(STEPS, batch=16):
        half = slice(rank * 8, (rank + 1) * 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.step()
    torch.save({"weights": [p.detach().clone() for p in model.parameters()], "steps": opt.step_count,
                "state": opt.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _single_process(options):
    from zoe.torch import OffloadOptimizer

    model = make_mlp(seed=0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, **options)
    for x, y in batches(STEPS, batch=16):
        halves = []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[r * 8:(r + 1) * 8]), y[r * 8:(r + 1) * 8]).backward()
            halves.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad()
        for p, g0, g1 in zip(model.parameters(), *halves):
            p.grad.copy_((g0 + g1) / 2)  # what the all-reduce and the division by W give
        opt.step()
    return [p.detach() for p in model.parameters()]


def _run(tmp_path, options):
    init_file = tmp_path / "init"
    mp.spawn(_rank_main, args=(2, str(init_file), str(tmp_path), options), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

# One more rounding per gradient element and step (scaled by the clip coefficient in its own pass) in an fp32
# MLP training of STEPS steps: measured 3.0e-8 on an AVX-512 Xeon under scalar and avx512 alike.
SEPARATE_CLIP_PASS_TOL = 1e-6


def test_two_process_gloo_equals_single_process(tmp_path):
    ranks = _run(tmp_path, {})
    single = _single_process({})
    for r in ranks:
        assert r["steps"] == STEPS
        for a, b in zip(r["weights"], single):
            assert torch.equal(a, b)
    # Each rank holds only its partition: the two checkpoints are halves of one state.
    assert ranks[0]["state"]["zoe"]["rank"] == 0 and ranks[1]["state"]["zoe"]["world_size"] == 2


def test_two_process_gloo_with_clipping(tmp_path):
    # The global norm is summed across ranks before clipping; the gradients are then scaled in a separate
    # pass instead of the kernel's fused one, hence a tolerance instead of equality.
    ranks = _run(tmp_path, {"max_grad_norm": 0.05})
    single = _single_process({"max_grad_norm": 0.05})
    for r in ranks:
        diff = max((a - b).abs().max().item() for a, b in zip(r["weights"], single))
        print(f"two ranks with clipping against one process: max weight difference {diff:.2e}")
        assert diff <= SEPARATE_CLIP_PASS_TOL


def test_partitioned_state_dict_is_refused_by_single_process(tmp_path):
    from zoe.torch import OffloadOptimizer

    ranks = _run(tmp_path, {})
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    with pytest.raises(ValueError, match="rank 1 of 2"):
        opt.load_state_dict(ranks[1]["state"])
