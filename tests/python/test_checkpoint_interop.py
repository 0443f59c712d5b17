"""Checkpoints that move: torch.optim.AdamW's state into zoe and back, a run of W ranks resumed on W' ranks
(2 -> 1, 1 -> 2, 2 -> 3 gloo processes), the fp32 masters exported as safetensors, and bad input refused with
the optimizer unchanged."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batches, make_mlp  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
BATCH = 24  # halves and thirds alike
# zoe's kernel and torch's foreach AdamW round differently (a few fp32 ulps a step): measured 3e-8 after 15
# steps of this fp32 MLP on an AVX-512 Xeon; 1e-6 is the bound.
TORCH_ROUND_TRIP_TOL = 1e-6
# Averaging over 3 ranks instead of 2 sums each gradient in another order: an fp32 rounding per step, which
# Adam's normalisation turns into at most ~lr * 2^-20 per element and step: under 1e-7 over 7 steps (an fp32
# model: a bf16 weight could round the other way and move the rest of the run by more).
RESHARD_ORDER_TOL = 1e-6


def _loss(model, x, y):
    for layer in model:  # a layer may be bf16 (_mixed_mlp)
        x = layer(x.to(layer.weight.dtype)).float() if isinstance(layer, torch.nn.Linear) else layer(x)
    return torch.nn.functional.mse_loss(x, y)


def _mixed_mlp(seed):
    """The MLP with its middle layer in bf16: its fp32 masters hold more than its weights, so a resumed run
    is exact only if the masters travel with the checkpoint."""
    model = make_mlp(seed=seed)
    model[2].to(torch.bfloat16)
    return model


def _torch_steps(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()


def test_torch_to_zoe_to_torch_continues_as_torch_alone():
    from zoe.torch import OffloadOptimizer

    data = batches(15, batch=BATCH)
    ref = make_mlp(seed=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    _torch_steps(ref, ref_opt, data)

    model = make_mlp(seed=3)
    first = torch.optim.AdamW(model.parameters(), **HYPER)
    _torch_steps(model, first, data[:5])
    zoe_opt = OffloadOptimizer(model.parameters(), **HYPER)
    zoe_opt.load_state_dict(first.state_dict())
    assert zoe_opt.step_count == 5
    _torch_steps(model, zoe_opt, data[5:10])
    back = torch.optim.AdamW(model.parameters(), **HYPER)
    back.load_state_dict(zoe_opt.torch_state_dict())
    _torch_steps(model, back, data[10:])
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    print(f"torch -> zoe -> torch against torch alone after 15 steps: max weight difference {diff:.2e}")
    assert diff <= TORCH_ROUND_TRIP_TOL
    assert int(back.state_dict()["state"][0]["step"]) == 15


def test_a_torch_state_dict_of_another_model_changes_nothing():
    from zoe.torch import OffloadOptimizer

    model = make_mlp(seed=1)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    _torch_steps(model, opt, batches(2, batch=BATCH))
    before = {k: v.clone() for k, v in opt.read_state(model[0].weight).items()}
    other = torch.nn.Sequential(torch.nn.Linear(32, 65), torch.nn.GELU(), torch.nn.Linear(65, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    _torch_steps(other, other_opt, batches(1, batch=BATCH))
    with pytest.raises(ValueError, match="parameter 0: exp_avg has shape"):
        opt.load_state_dict(other_opt.state_dict())
    after = opt.read_state(model[0].weight)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt.param_groups[0]["lr"] == HYPER["lr"], "a refused state_dict changed the hyper-parameters"
    amsgrad = torch.optim.AdamW(make_mlp().parameters(), amsgrad=True)
    _torch_steps(make_mlp(), amsgrad, [])
    sd = amsgrad.state_dict()
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match="not an optimizer state_dict"):
        opt.load_state_dict({"weights": 1})


def test_torch_distributed_checkpoint_resumes_a_mixed_model_exactly(tmp_path):
    """get_state_dict + dcp.save, then dcp.load + set_state_dict into a new model and optimizer, in one
    process: the bf16 layer's fp32 masters travel in the optimizer state (as each parameter's zoe_master),
    so the resumed run equals the uninterrupted one bitwise. DCP's state initialisation (a step with zero
    gradients and lr 0 when no parameter has a gradient) must not step zoe."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from zoe.torch import OffloadOptimizer

    data = batches(8, batch=BATCH)
    straight = _mixed_mlp(seed=4)
    _torch_steps(straight, OffloadOptimizer(straight.parameters(), **HYPER), data)

    model = _mixed_mlp(seed=4)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    _torch_steps(model, opt, data[:4])
    model.zero_grad(set_to_none=True)  # no gradients: DCP runs its initialising step
    before = {k: v.clone() for k, v in opt.read_state(model[2].weight).items()}
    model_sd, optim_sd = get_state_dict(model, opt)
    assert opt.step_count == 4
    after = opt.read_state(model[2].weight)
    assert all(torch.equal(before[k], after[k]) for k in before), "get_state_dict changed the state"
    assert set(optim_sd["state"]["2.weight"]) == {"step", "exp_avg", "exp_avg_sq", "zoe_master"}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))

    resumed = _mixed_mlp(seed=5)
    opt = OffloadOptimizer(resumed.parameters(), **HYPER)
    model_sd, optim_sd = get_state_dict(resumed, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert opt.step_count == 4
    _torch_steps(resumed, opt, data[4:])
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(straight.parameters(), resumed.parameters()))
    print(f"DCP save at step 4 and resume, against 8 uninterrupted steps (bf16 middle layer): {diff:.2e}")
    assert diff == 0.0


def test_fp16_loss_scale_travels_in_torch_format():
    """An fp16 run's dynamic loss scaler (scale, clean steps, hysteresis left) goes through
    torch_state_dict() -> load_state_dict() and through a torch.optim.AdamW that held it."""
    from zoe.torch import OffloadOptimizer

    model = make_mlp(seed=6, dtype=torch.float16)
    opt = OffloadOptimizer(model.parameters(), **HYPER, initial_scale=2.0 ** 12, growth_interval=3, hysteresis=2)
    for i, (x, y) in enumerate(batches(7, batch=BATCH)):
        opt.backward(_loss(model, x.half(), y))
        if i == 2:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")  # an overflow: one hysteresis step spent
        opt.step()
        opt.zero_grad()
    state = opt._engine.loss_scale_state
    assert state != (2.0 ** 12, 0, 2), "the scaler is at its start: the test would prove nothing"
    sd = opt.torch_state_dict()
    assert sd["param_groups"][0]["zoe_loss_scale"] == list(state)

    via_torch = torch.optim.AdamW(make_mlp(seed=6).parameters(), **HYPER)
    via_torch.load_state_dict(sd)
    other = OffloadOptimizer(make_mlp(seed=7, dtype=torch.float16).parameters(), **HYPER, initial_scale=2.0 ** 12,
                             growth_interval=3, hysteresis=2)
    other.load_state_dict(via_torch.state_dict())
    print(f"loss scaler (scale, clean steps, hysteresis left): saved {state}, loaded {other._engine.loss_scale_state}")
    assert other._engine.loss_scale_state == state and other.loss_scale == state[0]
    assert "zoe_loss_scale" not in other.param_groups[0]
    bad = opt.torch_state_dict()
    bad["param_groups"][0]["zoe_loss_scale"] = [float("nan"), 0, 2]
    with pytest.raises(ValueError, match="zoe_loss_scale"):
        other.load_state_dict(bad)
    assert other._engine.loss_scale_state == state


def test_export_fp32_loads_into_a_fresh_model_equal_to_zoes_masters(tmp_path):
    from safetensors.torch import load_file
    from zoe.torch import OffloadOptimizer, export_fp32

    model = make_mlp(seed=2, dtype=torch.bfloat16)
    opt = OffloadOptimizer(model.named_parameters(), **HYPER)
    for x, y in batches(4, batch=BATCH):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
    files = export_fp32(opt, tmp_path, moments=True)
    assert sorted(os.path.basename(f) for f in files) == ["exp_avg.safetensors", "exp_avg_sq.safetensors",
                                                          "model.safetensors"]
    fresh = make_mlp(seed=9)  # fp32, other weights
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(opt.read_state(p)["master"], q.detach()), name
    moments = load_file(tmp_path / "exp_avg.safetensors")
    assert torch.equal(moments["0.weight"], opt.read_state(model[0].weight)["exp_avg"])
    with pytest.raises(ValueError, match="no parameter names"):
        export_fp32(OffloadOptimizer(make_mlp().parameters()), tmp_path / "x")


# ---- resharding: gloo processes ------------------------------------------------------------------------------

def _rank_main(rank, world, init_file, out_dir, job):
    from zoe.torch import OffloadOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # Rank 0's weights are broadcast; a resumed run takes the checkpoint's.
    model = (_mixed_mlp if job["mixed"] else make_mlp)(seed=rank + 20)
    tier = {}
    if job.get("nvme"):  # the NVMe tier keeps 16-bit weights on the device
        model = model.to(torch.bfloat16)
        tier = dict(tier="nvme", nvme_path=os.path.join(out_dir, "swap"))
    opt = OffloadOptimizer(model.named_parameters(), **HYPER, **tier)
    if job["load"]:
        opt.load_state_dict([torch.load(p, weights_only=False) for p in job["load"]])
    if job.get("dcp_load"):
        _dcp_load(model, opt, job["dcp_load"])
    data = batches(15, batch=BATCH)[job["first"]:job["last"]]
    part = BATCH // world
    for x, y in data:
        opt.zero_grad()
        _loss(model, x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]).backward()
        opt.step()
    torch.save(opt.state_dict(), os.path.join(out_dir, f"state{rank}.pt"))
    opt.save_checkpoint(os.path.join(out_dir, f"rank{rank}.zoe"))
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out_dir, f"weights{rank}.pt"))
    _dcp_save(model, opt, os.path.join(out_dir, "dcp"))
    dist.barrier()
    dist.destroy_process_group()


def _dcp_save(model, opt, path):
    """torch.distributed.checkpoint of model and optimizer: zoe's partitioned state is gathered into whole
    tensors per parameter (collective), which DCP writes once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def _dcp_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _run(tmp_path, name, world, first, last, load=(), mixed=True, nvme=False, dcp_load=None):
    out = tmp_path / name
    out.mkdir()
    if world == 1:
        _single(out, first, last, load, nvme, dcp_load)
    else:
        job = {"first": first, "last": last, "load": list(load), "mixed": mixed, "nvme": nvme,
               "dcp_load": str(dcp_load) if dcp_load else None}
        mp.spawn(_rank_main, args=(world, str(out / "init"), str(out), job), nprocs=world, join=True)
    return out


def _single(out, first, last, load, nvme=False, dcp_load=None):
    """One process stepping on the average of two halves' gradients: what 2 ranks give, bitwise."""
    from zoe.torch import OffloadOptimizer

    model = _mixed_mlp(seed=20)
    tier = {}
    if nvme:
        model = model.to(torch.bfloat16)
        tier = dict(tier="nvme", nvme_path=str(out / "swap"))
    opt = OffloadOptimizer(model.parameters(), **HYPER, **tier)
    if load:
        opt.load_state_dict([torch.load(p, weights_only=False) for p in load])
    if dcp_load:
        _dcp_load(model, opt, dcp_load)
    for x, y in batches(15, batch=BATCH)[first:last]:
        halves = []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            _loss(model, x[r * 12:(r + 1) * 12], y[r * 12:(r + 1) * 12]).backward()
            halves.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=False)  # p.grad kept, zeroed: written below
        for p, g0, g1 in zip(model.parameters(), *halves):
            p.grad.copy_((g0 + g1) / 2)
        opt.step()
    torch.save(opt.state_dict(), out / "state0.pt")
    torch.save([p.detach().clone() for p in model.parameters()], out / "weights0.pt")


def _weights(out, rank=0):
    return torch.load(out / f"weights{rank}.pt", weights_only=False)


def _states(out, world):
    return [out / f"state{r}.pt" for r in range(world)]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    return {"whole": _run(tmp, "whole", 2, 0, 15), "first": _run(tmp, "first", 2, 0, 8), "tmp": tmp}


def test_reshard_2_to_1_equals_the_uninterrupted_run(two_rank_runs):
    r = two_rank_runs
    resumed = _run(r["tmp"], "to1", 1, 8, 15, load=_states(r["first"], 2))
    for a, b in zip(_weights(resumed), _weights(r["whole"])):
        assert torch.equal(a, b)


def test_reshard_1_to_2_equals_the_uninterrupted_run(two_rank_runs):
    r = two_rank_runs
    single = _run(r["tmp"], "single8", 1, 0, 8)
    resumed = _run(r["tmp"], "to2", 2, 8, 15, load=_states(single, 1))
    for rank in range(2):
        for a, b in zip(_weights(resumed, rank), _weights(r["whole"])):
            assert torch.equal(a, b)


def test_partitioned_state_through_torch_distributed_checkpoint_2_to_2_and_2_to_1(two_rank_runs):
    """zoe's own partitioning (plain parameters, 2 gloo ranks) saved with DCP's get_state_dict + dcp.save at
    step 8: resumed with dcp.load + set_state_dict on 2 ranks and on 1, equal to the uninterrupted run."""
    r = two_rank_runs
    checkpoint = r["first"] / "dcp"
    on2 = _run(r["tmp"], "dcp2", 2, 8, 15, dcp_load=checkpoint)
    on1 = _run(r["tmp"], "dcp1", 1, 8, 15, dcp_load=checkpoint)
    for out, ranks in ((on2, 2), (on1, 1)):
        for rank in range(ranks):
            for a, b in zip(_weights(out, rank), _weights(r["whole"])):
                assert torch.equal(a, b)


def test_reshard_on_the_nvme_tier_2_to_1_and_1_to_2(tmp_path):
    # bf16 weights, fp32 masters and moments in swap files: resharded through write_state into each tier.
    whole = _run(tmp_path, "whole", 2, 0, 15, nvme=True)
    first = _run(tmp_path, "first", 2, 0, 8, nvme=True)
    to1 = _run(tmp_path, "to1", 1, 8, 15, load=_states(first, 2), nvme=True)
    for a, b in zip(_weights(to1), _weights(whole)):
        assert torch.equal(a, b)
    single = _run(tmp_path, "single8", 1, 0, 8, nvme=True)
    to2 = _run(tmp_path, "to2", 2, 8, 15, load=_states(single, 1), nvme=True)
    for rank in range(2):
        for a, b in zip(_weights(to2, rank), _weights(whole)):
            assert torch.equal(a, b)


def test_reshard_2_to_3(two_rank_runs):
    r = two_rank_runs
    whole = _run(r["tmp"], "whole32", 2, 0, 15, mixed=False)
    first = _run(r["tmp"], "first32", 2, 0, 8, mixed=False)
    resumed = _run(r["tmp"], "to3", 3, 8, 15, load=_states(first, 2), mixed=False)
    for rank in range(3):
        diff = max((a - b).abs().max().item() for a, b in zip(_weights(resumed, rank), _weights(whole)))
        print(f"2 -> 3 ranks at step 8, against 2 ranks throughout at step 15: max weight difference {diff:.2e}")
        assert diff <= RESHARD_ORDER_TOL


def test_bad_partition_sets_are_refused(two_rank_runs):
    from zoe.torch import OffloadOptimizer, consolidate_state_dicts

    r = two_rank_runs
    s0, s1 = (torch.load(p, weights_only=False) for p in _states(r["first"], 2))
    with pytest.raises(ValueError, match=r"missing rank\(s\) \[1\]"):
        consolidate_state_dicts([s0])
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\] given twice"):
        consolidate_state_dicts([s0, s0, s1])
    single = torch.load(_run(r["tmp"], "single2", 1, 0, 2) / "state0.pt", weights_only=False)
    with pytest.raises(ValueError, match="different sizes"):
        consolidate_state_dicts([s0, single])
    # FSDP2 shards are torch.distributed.checkpoint's to reshard; a state_dict whose map of pieces is not what
    # its engine checkpoint holds is refused, not joined into the wrong places.
    with pytest.raises(ValueError, match="FSDP2 shards"):
        consolidate_state_dicts([s0, dict(s1, zoe=dict(s1["zoe"], pieces=None))])
    with pytest.raises(ValueError, match="other pieces than its state_dict names"):
        consolidate_state_dicts([dict(s0, zoe=dict(s0["zoe"], pieces=s1["zoe"]["pieces"])), s1])
    # A damaged checkpoint names what failed its check; the optimizer that was to load it is unchanged.
    damaged = dict(s1)
    damaged["zoe"] = dict(s1["zoe"])
    blob = s1["zoe"]["checkpoint"].clone()
    blob[len(blob) // 2] ^= 0xFF
    damaged["zoe"]["checkpoint"] = blob
    model = _mixed_mlp(seed=20)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Exception, match="(?i)crc|checksum|corrupt"):
        opt.load_state_dict([s0, damaged])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.step_count == 0


# ---- zoe export: the command line joins every rank's checkpoint file ------------------------------------------

ZOE = __import__("pathlib").Path(__file__).resolve().parents[2] / "build" / "zoe"


def _export(*args):
    import subprocess

    return subprocess.run([str(ZOE), "export", *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not ZOE.exists(), reason="build/zoe is not built")
def test_zoe_export_joins_the_ranks_into_safetensors(two_rank_runs, tmp_path):
    from safetensors.torch import load_file
    from zoe.torch import consolidate_state_dicts

    first = two_rank_runs["first"]
    r = _export(first / "rank1.zoe", first / "rank0.zoe", "--out", tmp_path, "--moments")
    assert r.returncode == 0, r.stderr
    print(r.stdout.strip())
    masters = load_file(tmp_path / "model.safetensors")
    joined = consolidate_state_dicts([torch.load(p, weights_only=False) for p in _states(first, 2)])
    names = [n for n, _ in _mixed_mlp(0).named_parameters()]
    assert sorted(masters) == sorted(names)
    for i, name in enumerate(names):
        assert torch.equal(masters[name], joined["zoe_masters"][i]), name
    exp_avg = load_file(tmp_path / "exp_avg.safetensors")
    assert torch.equal(exp_avg["2.weight"], joined["state"][2]["exp_avg"])
    fresh = make_mlp(seed=5)  # loads into a model's state_dict by name
    fresh.load_state_dict(masters)


@pytest.mark.skipif(not ZOE.exists(), reason="build/zoe is not built")
def test_zoe_export_refuses_what_is_not_one_runs_ranks(two_rank_runs, tmp_path):
    first, whole = two_rank_runs["first"], two_rank_runs["whole"]
    cases = [
        ([first / "rank0.zoe"], 2, "rank 1 of 2 is missing"),
        ([first / "rank0.zoe", first / "rank0.zoe"], 2, "are both rank 0"),
        ([first / "rank0.zoe", whole / "rank1.zoe"], 2, "not of one run"),
    ]
    damaged = tmp_path / "damaged.zoe"
    data = bytearray((first / "rank1.zoe").read_bytes())
    data[len(data) // 3] ^= 0xFF  # in one of the state blobs: every one is checked before anything is written
    damaged.write_bytes(bytes(data))
    cases.append(([first / "rank0.zoe", damaged], 1, str(damaged)))
    for files, code, message in cases:
        r = _export(*files, "--out", tmp_path / "out", "--moments")
        assert r.returncode == code, (files, r.stderr)
        assert message in r.stderr, r.stderr
        assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.skipif(not ZOE.exists(), reason="build/zoe is not built")
def test_zoe_export_removes_what_killed_exports_left_and_nothing_of_a_live_one(tmp_path):
    """An export killed mid-write leaves `model.safetensors.tmp-<scope>-<pid>-<random>` (a model's size): the next
    export beside it removes it once that writer is gone from this scope, and never a live writer's."""
    import json
    import subprocess
    from zoe.torch import OffloadOptimizer

    model = make_mlp(seed=2, dtype=torch.bfloat16)
    opt = OffloadOptimizer(model.named_parameters(), tier="nvme", nvme_path=str(tmp_path / "swap"), **HYPER)
    scope = json.loads((tmp_path / "swap" / "zoe-optimizer.zoe-swap.json").read_text())["owner"]["scope"]
    if not scope:
        pytest.skip("no process scope on this machine (no /proc): writers are never judged")
    opt.save_checkpoint(str(tmp_path / "state.zoe"))
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = out / f"model.safetensors.tmp-{scope}-{gone.pid}-0123456789abcdef"
    live = out / f"model.safetensors.tmp-{scope}-{os.getpid()}-0123456789abcdef"
    other = out / f"model.safetensors.tmp-{'0' * 16}-{gone.pid}-0123456789abcdef"  # another host or container
    for f in (dead, live, other):
        f.write_bytes(b"x" * 100)
    r = _export(tmp_path / "state.zoe", "--out", out)
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and live.exists() and other.exists()
    assert (out / "model.safetensors").exists()
