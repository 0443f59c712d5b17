"""Lion, Adagrad and AMSGrad across ranks (issues 50 and 53), on two gloo processes: zoe's own data-parallel
partition (each rank steps its shard of every state array; a resume from each rank's state_dict) equals one
process fed the averaged gradients, bit for bit; FSDP2 (fully_shard) equals FSDP2 with the torch optimizer or
the rule written in torch, and resumes exactly through each rank's state_dict and through
torch.distributed.checkpoint. One spawn runs every case (``_rank_main``); the tests read what it recorded."""
import io
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batches, make_mlp, spawn_ranks, worst  # noqa: E402
from test_fsdp2 import _diff, _fsdp_mlp, _local, _train  # noqa: E402
from test_rules import ADAGRAD, LION, lion_reference  # noqa: E402

WORLD = 2
STEPS = 10
AMSGRAD = dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05, amsgrad=True)
# FSDP2 + zoe against FSDP2 + the torch optimizer (or Lion written in torch) on the same shards: only the
# order of float operations inside each element's update differs (test_rules.py's and test_amsgrad.py's
# one-process tolerances, whose measurements were 1.5e-8 for Adagrad, 4.5e-8 for AMSGrad and 0.0 for Lion).
TORCH_TOL = {"adagrad": 1e-5, "amsgrad": 1e-5, "lion": 1e-6}


def _optimizer(rule):
    """(zoe's class, its keywords, the torch reference's factory) of a rule."""
    from zoe.torch import OffloadAdagrad, OffloadLion, OffloadOptimizer

    if rule == "adagrad":
        return OffloadAdagrad, ADAGRAD, lambda ps: torch.optim.Adagrad(ps, **ADAGRAD)
    if rule == "lion":
        return OffloadLion, LION, _LionReference
    return OffloadOptimizer, AMSGRAD, lambda ps: torch.optim.AdamW(ps, **AMSGRAD)


class _LionReference:
    """test_rules.lion_reference as an optimizer for _train (step, zero_grad) over DTensor parameters."""

    def __init__(self, params):
        self.params = list(params)
        self.step, _ = lion_reference(self.params, LION["lr"], LION["betas"], LION["weight_decay"])

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _halves(model, x, y, rank):
    half = slice(rank * 8, (rank + 1) * 8)
    torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()


def _partition(rank, out, rule):
    """zoe's partition: different weights per rank (rank 0's are broadcast), each rank half of every batch; at
    step 6 a new optimizer over a model with other weights resumes from this rank's state_dict."""
    cls, hyper, _ = _optimizer(rule)
    model = make_mlp(seed=rank)
    opt = cls(model.parameters(), **hyper)
    for t, (x, y) in enumerate(batches(STEPS), 1):
        if t == 6:
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            saved.seek(0)
            model = make_mlp(seed=rank + 10)
            opt = cls(model.parameters(), **hyper)
            opt.load_state_dict(torch.load(saved, weights_only=False))
        opt.zero_grad()
        _halves(model, x, y, rank)
        opt.step()
    out[f"partition_{rule}"] = [p.detach().clone() for p in model.parameters()]
    out[f"partition_{rule}_state"] = opt.state_dict()


def _fsdp(rank, out, folder, rule):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cls, hyper, reference = _optimizer(rule)
    ref = _fsdp_mlp(False)
    _train(ref, reference(list(ref.parameters())), rank)
    mine = _fsdp_mlp(False)
    _train(mine, cls(mine.parameters(), **hyper), rank)
    out[f"fsdp2_{rule}"] = _diff(_local(ref), _local(mine))
    out[f"fsdp2_{rule}_trained"] = _diff(_local(_fsdp_mlp(False)), _local(mine))
    # Each rank's own state_dict, and torch.distributed.checkpoint: 5 steps, save, 5 more on a new optimizer.
    for how in ("state_dict", "dcp"):
        first = _fsdp_mlp(False)
        opt = cls(first.parameters(), **hyper)
        _train(first, opt, rank, steps=5)
        resumed = _fsdp_mlp(False, seed=3)  # other weights: the load must bring them
        new = cls(resumed.parameters(), **hyper)
        if how == "state_dict":
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            saved.seek(0)
            new.load_state_dict(torch.load(saved, weights_only=False))
        else:
            path = os.path.join(folder, f"dcp_{rule}")
            model_sd, optim_sd = get_state_dict(first, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            model_sd, optim_sd = get_state_dict(resumed, new)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(resumed, new, model_state_dict=model_sd, optim_state_dict=optim_sd)
        _train(resumed, new, rank, steps=5, first=5)
        out[f"fsdp2_{rule}_{how}"] = _diff(_local(mine), _local(resumed))


def _rank_main(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    try:
        for rule in ("adagrad", "lion", "amsgrad"):
            _partition(rank, out, rule)
            _fsdp(rank, out, out_dir, rule)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, tmp_path_factory.mktemp("rules"), WORLD)


def _one_process(rule):
    """What the partition's ranks compute, in one process: the two halves' gradients averaged."""
    cls, hyper, _ = _optimizer(rule)
    model = make_mlp(seed=0)
    opt = cls(model.parameters(), **hyper)
    for x, y in batches(STEPS):
        halves = []
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            _halves(model, x, y, rank)
            halves.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=False)
        for p, g0, g1 in zip(model.parameters(), *halves):
            p.grad.copy_((g0 + g1) / 2)
        opt.step()
    return model, opt


@pytest.mark.parametrize("rule", ["adagrad", "lion", "amsgrad"])
def test_partition_equals_one_process_and_its_state_joins(ranks, rule):
    from zoe.torch import consolidate_state_dicts

    model, opt = _one_process(rule)
    for r in ranks:
        for a, b in zip(r[f"partition_{rule}"], model.parameters()):
            assert torch.equal(a, b)
    joined = consolidate_state_dicts([r[f"partition_{rule}_state"] for r in ranks])
    for i, p in enumerate(model.parameters()):
        assert set(joined["state"][i]) == {"step", *opt._flat.states}
        for k in opt._flat.states:
            assert torch.equal(joined["state"][i][k].reshape(-1), opt.state[p][k].reshape(-1)), k


@pytest.mark.parametrize("rule", ["adagrad", "lion", "amsgrad"])
def test_fsdp2_equals_the_torch_rule_and_resumes_exactly(ranks, rule):
    diff = worst(ranks, f"fsdp2_{rule}")
    print(f"FSDP2 {rule}: max weight difference against the rule in torch after {STEPS} steps {diff:.2e}")
    assert diff < TORCH_TOL[rule]
    assert min(r[f"fsdp2_{rule}_trained"] for r in ranks) > 100 * TORCH_TOL[rule]  # it trained
    assert worst(ranks, f"fsdp2_{rule}_state_dict") == 0.0
    assert worst(ranks, f"fsdp2_{rule}_dcp") == 0.0
