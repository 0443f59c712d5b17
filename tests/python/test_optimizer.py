"""zoe.torch.OffloadOptimizer against torch.optim.AdamW/Adam: parity, param groups, LR schedulers, schedules,
clipping, fp16 loss scaling, state_dict round trips and the errors for misuse."""
import copy
import io

import pytest
import torch

import zoe
from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, master_bound, max_diff, train

# fp32 Adam in zoe and in torch differ only by the order of float operations inside one element's update
# (fused multiply-adds in the SIMD kernel). These fp32 trainings of a small MLP feed each run's weights back
# into its gradients, yet barely amplify such differences: after 50 steps zoe and torch's foreach AdamW are
# 7.5e-8 apart, torch's fused and foreach 4.5e-8 (an AVX-512 Xeon, all three ISAs alike). The bound leaves
# 100x for other CPUs and BLAS; the bf16 comparisons, where rounding amplifies, are teacher-forced instead.
PARITY_TOL = 1e-5
# Delayed parameter update against sync, 12 steps with 4 warm-up: one step stale, so a difference of the
# size of a few updates (lr 3e-3): 2.2e-3 measured on every ISA.
DELAYED_TOL = 0.05
# fp16 weights with dynamic loss scaling against fp32 torch: fp16 rounding of the weights (ulp 1e-3 near 1)
# over 30 steps; 2.4e-4 measured on every ISA.
FP16_VS_FP32_TOL = 2e-2
HYPER = dict(lr=3e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)


def test_parity_with_torch_adamw_50_steps_fp32():
    data = batches(50)
    ref, mine = make_mlp(), make_mlp()
    train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data)
    opt = OffloadOptimizer(mine.parameters(), **HYPER)
    train(mine, opt, data)
    diff = max_diff(ref, mine)
    print(f"max |w_zoe - w_torch| after 50 AdamW steps: {diff:.3e}")
    assert diff < PARITY_TOL
    assert opt.step_count == 50


def test_parity_with_torch_adam_l2():
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    train(ref, torch.optim.Adam(ref.parameters(), **HYPER), data)
    train(mine, OffloadOptimizer(mine.parameters(), adamw=False, **HYPER), data)
    assert max_diff(ref, mine) < PARITY_TOL


def _groups(model, adamw_key=False):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]


def test_param_groups_and_lr_scheduler():
    data = batches(30)
    ref, mine = make_mlp(), make_mlp()
    ro = torch.optim.AdamW(_groups(ref), lr=3e-3)
    mo = OffloadOptimizer(_groups(mine), lr=3e-3)
    rs = torch.optim.lr_scheduler.OneCycleLR(ro, max_lr=[5e-3, 2e-2], total_steps=30)
    ms = torch.optim.lr_scheduler.OneCycleLR(mo, max_lr=[5e-3, 2e-2], total_steps=30)
    for x, y in data:
        for model, opt, sched in ((ref, ro, rs), (mine, mo, ms)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    assert [g["lr"] for g in mo.param_groups] == [g["lr"] for g in ro.param_groups]
    assert max_diff(ref, mine) < PARITY_TOL


@pytest.mark.parametrize("late", [False, True])
def test_overlap_with_an_lr_scheduler_steps_the_bits_of_sync(late):
    # The overlap schedule steps during backward: with the scheduler stepped after step() it must already use
    # the new learning rates (no step redone); stepped late, between backward and step(), it redoes them.
    data = batches(12)
    runs = []
    for schedule in ("sync", "overlap"):
        model = make_mlp()
        opt = OffloadOptimizer(_groups(model), lr=3e-3, schedule=schedule)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[5e-3, 2e-2], total_steps=13)
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if late:
                sched.step()
            opt.step()
            if not late:
                sched.step()
        runs.append((model, opt))
    (sync, _), (overlap, opt) = runs
    assert max_diff(sync, overlap) == 0.0
    # The first step runs as sync (the backward passes per step are not known yet); each later one redoes its
    # speculative steps exactly when the rates changed after its backward.
    assert opt.stats()["redone"] == (len(data) - 1 if late else 0)


def test_clipping_matches_clip_grad_norm():
    data = batches(20)
    ref, mine = make_mlp(), make_mlp()
    ro = torch.optim.AdamW(ref.parameters(), **HYPER)
    mo = OffloadOptimizer(mine.parameters(), max_grad_norm=0.05, **HYPER)
    for x, y in data:
        ro.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ro.step()
        mo.zero_grad()
        torch.nn.functional.mse_loss(mine(x), y).backward()
        mo.step()
    assert mo.stats()["last_grad_norm"] > 0.05  # clipping was active
    assert max_diff(ref, mine) < PARITY_TOL


@pytest.mark.parametrize("schedule", ["overlap", "delayed"])
def test_schedules(schedule):
    data = batches(12)
    sync, other = make_mlp(), make_mlp()
    train(sync, OffloadOptimizer(sync.parameters(), **HYPER), data)
    opt = OffloadOptimizer(other.parameters(), schedule=schedule, delayed_warmup_steps=4, **HYPER)
    train(other, opt, data)
    if schedule == "overlap":
        # Exact: the same bits as sync.
        assert max_diff(sync, other) == 0.0
    else:
        # One step stale after the warm-up: it trains, and every step was applied.
        opt.state_dict()  # waits for the step in flight
        assert opt.step_count == 12
        assert max_diff(sync, other) < DELAYED_TOL


def test_overlap_with_module_zero_grad_set_to_none():
    data = batches(10)
    ref, mine = make_mlp(), make_mlp()
    train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data)
    opt = OffloadOptimizer(mine.parameters(), schedule="overlap", **HYPER)
    for x, y in data:
        mine.zero_grad(set_to_none=True)  # autograd allocates fresh gradients: the hook adopts them
        torch.nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
    assert max_diff(ref, mine) < PARITY_TOL


def test_state_dict_round_trip_continues_identically(tmp_path):
    data = batches(30)
    straight = make_mlp()
    train(straight, OffloadOptimizer(straight.parameters(), **HYPER), data)

    first = make_mlp()
    opt = OffloadOptimizer(first.parameters(), **HYPER)
    train(first, opt, data[:13])
    path = tmp_path / "opt.pt"
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, path)
    del opt

    resumed = make_mlp(seed=123)  # different initial weights: everything must come from the checkpoint
    ck = torch.load(path, weights_only=False)
    resumed.load_state_dict(ck["model"])
    opt2 = OffloadOptimizer(resumed.parameters(), **HYPER)
    opt2.load_state_dict(ck["opt"])
    assert opt2.step_count == 13
    train(resumed, opt2, data[13:])
    assert max_diff(straight, resumed) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_between_backward_and_step_is_the_last_steps(dtype):
    """The overlap schedule steps during backward: a state_dict() taken before step() holds the state of the
    last step (what it stepped is undone, and step() takes it again), and the run still ends as sync's."""
    data = batches(8)
    runs = []
    for schedule in ("sync", "overlap"):
        model = make_mlp(dtype=dtype)
        opt = OffloadOptimizer(model.parameters(), **HYPER, schedule=schedule)
        for t, (x, y) in enumerate(data):
            opt.zero_grad()
            before = copy.deepcopy(opt.state_dict()["state"])
            torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            during = opt.state_dict()["state"]
            assert during.keys() == before.keys()
            for i in before:
                for k in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(before[i][k], during[i][k]), f"{schedule}, step {t}: {k} of {i}"
            opt.step()
        runs.append((model, opt))
    (sync, _), (overlap, opt) = runs
    assert max_diff(sync, overlap) == 0.0
    assert opt.stats()["redone"] == len(data) - 1  # the first step runs as sync


def test_state_dict_restores_weights_and_hyper():
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), lr=1e-2)
    train(model, opt, batches(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    snapshot = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.5
    train(model, opt, batches(2, seed=9))
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=False))
    assert opt.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), snapshot):
        assert torch.equal(p.detach(), q)  # the model's weights come back from the master weights


def test_read_state_matches_torch():
    data = batches(5)
    ref, mine = make_mlp(), make_mlp()
    ro = torch.optim.AdamW(ref.parameters(), **HYPER)
    mo = OffloadOptimizer(mine.parameters(), **HYPER)
    train(ref, ro, data)
    train(mine, mo, data)
    p_ref, p_mine = next(iter(ref.parameters())), next(iter(mine.parameters()))
    st = mo.read_state(p_mine)
    assert torch.allclose(st["exp_avg"], ro.state[p_ref]["exp_avg"], rtol=1e-5, atol=1e-9)
    assert torch.allclose(st["exp_avg_sq"], ro.state[p_ref]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert torch.equal(st["master"], p_mine.detach())


def test_bf16_weights_fp32_master():
    """bf16 model weights, fp32 master in zoe, against torch AdamW on an fp32 master copy kept by hand, fed the
    same gradients (those of the torch run): two bf16 trainings would part ways after the first weight that
    rounds differently, by an amount that depends on the CPU."""
    data = batches(20)
    ref = make_mlp(dtype=torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ro = torch.optim.AdamW(master, **HYPER)
    model = make_mlp(dtype=torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    for step, (x, y) in enumerate(data, 1):
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x.bfloat16()).float(), y).backward()
        for m, p, q in zip(master, ref.parameters(), model.parameters()):
            m.grad = p.grad.float()
            q.grad = p.grad.clone()
        ro.step()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters()):
                p.copy_(m)
        for p, m in zip(model.parameters(), master):
            mine = opt.read_state(p)["master"]
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), mine.bfloat16())  # the weights are zoe's master rounded
            assert ((mine - m.detach()).abs() <= master_bound(step, mine, m.detach(), HYPER["lr"])).all(), step
    master_diff = max((opt.read_state(p)["master"] - m.detach()).abs().max().item()
                      for p, m in zip(model.parameters(), master))
    print(f"bf16 weights: max |master_zoe - master_torch| after 20 steps: {master_diff:.3e}")


def test_fp16_overflow_skips_step_and_lowers_scale():
    model = make_mlp(dtype=torch.float16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, hysteresis=1)
    assert opt.loss_scale == 2.0 ** 16
    train(model, opt, batches(2), scale_loss=True)
    assert opt.step_count == 2 and not opt.last_step_skipped
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.loss_scale
    opt.zero_grad(set_to_none=False)  # zeroed gradients, one of them edited below
    next(iter(model.parameters())).grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped
    assert opt.step_count == 2
    assert opt.loss_scale == scale / 2
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_nan_gradient_is_refused_and_changes_nothing(schedule):
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, schedule=schedule)
    train(model, opt, batches(2))
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()["zoe"]
    opt.zero_grad(set_to_none=False)  # zeroed gradients, one of them edited below
    list(model.parameters())[2].grad[3] = float("nan")
    with pytest.raises(zoe.InvalidArgumentError, match="NaN/Inf"):
        opt.step()
    assert opt.step_count == 2
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)
    assert torch.equal(opt.state_dict()["zoe"]["checkpoint"], state["checkpoint"])
    # As torch.optim.AdamW does, on request.
    lenient = OffloadOptimizer(make_mlp().parameters(), lr=1e-3, refuse_non_finite=False)
    next(iter(lenient.param_groups[0]["params"])).grad = torch.full_like(lenient.param_groups[0]["params"][0], float("nan"))
    lenient.step()
    assert torch.isnan(lenient.param_groups[0]["params"][0]).all()


def test_fp16_loss_scaling_trains_like_fp32():
    data = batches(30)
    ref, mine = make_mlp(), make_mlp(dtype=torch.float16)
    train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data)
    opt = OffloadOptimizer(mine.parameters(), **HYPER)
    train(mine, opt, data, scale_loss=True)
    assert max_diff(ref, mine) < FP16_VS_FP32_TOL


# ---- misuse ----------------------------------------------------------------------------------------------

def test_error_mixed_devices():
    a = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        OffloadOptimizer([a, b])


def test_error_sparse_gradients():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OffloadOptimizer(emb.parameters())
    emb.zero_grad(set_to_none=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_error_state_dict_of_another_model():
    a, b = make_mlp(), torch.nn.Linear(32, 8)
    oa = OffloadOptimizer(a.parameters())
    ob = OffloadOptimizer(b.parameters())
    with pytest.raises(ValueError, match="different model"):
        ob.load_state_dict(oa.state_dict())
    # A torch.optim state_dict is taken over (test_checkpoint_interop.py), but only for its own model.
    with pytest.raises(ValueError, match="param group 0 of this state_dict has 6 parameters, the optimizer's 2"):
        ob.load_state_dict(torch.optim.AdamW(a.parameters()).state_dict())


def test_error_state_dict_of_another_partitioning():
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters())
    sd = opt.state_dict()
    sd["zoe"]["world_size"], sd["zoe"]["rank"] = 2, 1
    with pytest.raises(ValueError, match="rank 1 of 2"):
        opt.load_state_dict(sd)


def test_error_unsupported_options():
    model = make_mlp()
    with pytest.raises(ValueError, match="amsgrad"):
        OffloadOptimizer([{"params": model.parameters(), "amsgrad": True}])
    with pytest.raises(ValueError, match="nvme_path"):
        OffloadOptimizer(model.parameters(), tier="nvme")
    with pytest.raises(ValueError, match="schedule"):
        OffloadOptimizer(model.parameters(), schedule="eager")


def test_nvme_tier_passes_through(tmp_path):
    """tier='nvme' reaches the engine: it trains like ram where the engine has the tier, and where it does
    not yet the engine's own refusal comes through as UnsupportedError."""
    data = batches(5)
    # The NVMe tier keeps the master weights on disk and sends the device 16-bit weights.
    ram, nvme = make_mlp(dtype=torch.bfloat16), make_mlp(dtype=torch.bfloat16)
    train(ram, OffloadOptimizer(ram.parameters(), **HYPER), data)
    try:
        opt = OffloadOptimizer(nvme.parameters(), tier="nvme", nvme_path=str(tmp_path), **HYPER)
    except zoe.UnsupportedError as e:
        assert "nvme" in str(e)
        return
    train(nvme, opt, data)
    assert max_diff(ram, nvme) == 0.0


def trained_on_nvme_beside_ram(tmp_path, **nvme_options):
    """A bf16 MLP trained 4 steps on tier nvme with `nvme_options`, asserted equal to the same on tier ram."""
    data = batches(4)
    ram, nvme = make_mlp(dtype=torch.bfloat16), make_mlp(dtype=torch.bfloat16)
    train(ram, OffloadOptimizer(ram.parameters(), **HYPER), data)
    try:
        opt = OffloadOptimizer(nvme.parameters(), tier="nvme", nvme_path=str(tmp_path), **nvme_options, **HYPER)
    except zoe.UnsupportedError:
        pytest.skip("this build has no NVMe tier")
    train(nvme, opt, data)
    assert max_diff(ram, nvme) == 0.0
    return opt, nvme


@pytest.mark.parametrize("durability", ["step", "checkpoint"])
def test_nvme_durability_changes_no_result(tmp_path, durability):
    """durability= reaches the engine and changes when the swap files are synced, never what is stepped;
    a state_dict (which saves, and so makes the swap files durable) round-trips as with the default."""
    opt, _ = trained_on_nvme_beside_ram(tmp_path, durability=durability)
    assert opt.state_dict()["zoe"]["checkpoint"].numel() > 0


@pytest.mark.parametrize("keep_resident", [True, False])
def test_nvme_keep_resident_changes_no_result(tmp_path, keep_resident):
    """keep_resident= reaches the engine: a state that fits in the buffers is never read back from the swap
    files (True) or is streamed from them each step (False); the same bits either way, and the files hold
    them (a state_dict, which makes them durable, round-trips)."""
    opt, nvme = trained_on_nvme_beside_ram(tmp_path, keep_resident=keep_resident)
    stats = opt.stats()
    assert stats["nvme_write_bytes"] > 0
    assert (stats["nvme_read_bytes"] == 0) == keep_resident, stats
    state = opt.state_dict()
    again = OffloadOptimizer(make_mlp(dtype=torch.bfloat16).parameters(), tier="nvme", nvme_path=str(tmp_path / "b"),
                             keep_resident=not keep_resident, **HYPER)
    again.load_state_dict(state)
    for p, q in zip(opt.param_groups[0]["params"], again.param_groups[0]["params"]):
        assert torch.equal(opt.read_state(p)["exp_avg_sq"], again.read_state(q)["exp_avg_sq"])
    with pytest.raises(ValueError, match="keep_resident = 'yes' is invalid"):
        OffloadOptimizer(nvme.parameters(), tier="nvme", nvme_path=str(tmp_path), keep_resident="yes")


def test_error_bad_durability():
    model = make_mlp()
    with pytest.raises(ValueError, match="durability = 'never' is unknown: use 'step'"):
        OffloadOptimizer(model.parameters(), durability="never")
    opts = zoe._zoe.EngineOptions()
    opts.nvme_durability = "sometimes"
    with pytest.raises(ValueError, match="durability 'sometimes' is unknown"):
        zoe._zoe.Engine(zoe.cpu_device(), [dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                                 adamw=True)], [], opts)


def test_config_nvme_durability():
    assert zoe.parse_config('{"zoe": {"nvme_durability": "checkpoint"}}')["options"]["nvme_durability"] == "checkpoint"
    assert zoe.parse_config("{}")["options"]["nvme_durability"] == "step"
    with pytest.raises(zoe.InvalidArgumentError, match="zoe.nvme_durability"):
        zoe.parse_config('{"zoe": {"nvme_durability": "never"}}')
    assert zoe.parse_config("{}")["options"]["nvme_keep_resident"] is True
    assert zoe.parse_config('{"zoe": {"nvme_keep_resident": false}}')["options"]["nvme_keep_resident"] is False
    with pytest.raises(zoe.InvalidArgumentError, match="zoe.nvme_keep_resident"):
        zoe.parse_config('{"zoe": {"nvme_keep_resident": "no"}}')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_bindings_refuse_memory_and_streams_of_another_device():
    device = zoe.cuda_device(0)
    on_host, on_gpu = torch.zeros(8), torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match=r"weights: the array is on the host, the engine's device is cuda:0"):
        zoe.Engine(device, [dict(lr=1e-3)], [(8, "f32", on_host, on_gpu, 0, "w", [8])], zoe.EngineOptions())
    engine = zoe.Engine(device, [dict(lr=1e-3)], [(8, "f32", on_gpu, torch.zeros(8, device="cuda"), 0, "w", [8])],
                        zoe.EngineOptions())
    with pytest.raises(ValueError, match=r"set_grad_sources: parameter 0 gradient: the array is on the host"):
        engine.set_grad_sources([0], [on_host])
    with pytest.raises(ValueError, match=r"use_compute_stream: need a torch.cuda.Stream, not int"):
        device.use_compute_stream(torch.cuda.current_stream().cuda_stream)
    device.use_compute_stream(torch.cuda.Stream())
    engine.step()
    engine.wait()
    device.use_compute_stream(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_parity():
    data = batches(20)
    ref, mine = make_mlp().cuda(), make_mlp().cuda()
    ro = torch.optim.AdamW(ref.parameters(), **HYPER)
    mo = OffloadOptimizer(mine.parameters(), **HYPER)
    for x, y in data:
        for model, opt in ((ref, ro), (mine, mo)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            opt.step()
    assert max_diff(ref, mine) < PARITY_TOL


# Host waits per step on the trainer's thread that each schedule may make on CUDA: sync reads every gradient
# (one wait) and sends the weights up (one more: the staging is rewritten by the next step); overlap and
# delayed read the step's decision.
CUDA_TRAINER_WAITS = {"sync": 2, "overlap": 2, "delayed": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
def test_cuda_schedules_step_as_on_the_cpu(schedule):
    """Gradients every device computes to the same bits (g = p * c: one correctly rounded bf16 product, which
    depends on the weights, so stale or early weights change it): zoe on CUDA, its copies ordered by torch's
    stream, steps exactly as zoe on the CPU, the delayed schedule's one-step-old weights included; and the
    trainer's thread waits for the GPU at most CUDA_TRAINER_WAITS times per step."""
    g = torch.Generator().manual_seed(0)
    sizes = (4096, (1 << 20) + 3, 17)
    init = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    coef = [(torch.rand(n, generator=g) + 0.5).to(torch.bfloat16) for n in sizes]
    steps, warmup = 8, 2

    def run(device):
        ps = [torch.nn.Parameter(t.to(device).clone()) for t in init]
        cs = [c.to(device) for c in coef]
        opt = OffloadOptimizer(ps, lr=1e-2, weight_decay=0.1, schedule=schedule, delayed_warmup_steps=warmup)
        waits = []
        for _ in range(steps):
            opt.zero_grad()
            before = opt.stats()["host_waits_trainer"]
            sum((p * (p.detach() * c)).float().sum() for p, c in zip(ps, cs)).backward()
            opt.step()
            waits.append(opt.stats()["host_waits_trainer"] - before)
        moments = [opt.read_state(p)["exp_avg_sq"] for p in ps]  # waits for the step in flight (delayed)
        return [p.detach().cpu() for p in ps], moments, waits

    want, want_v, _ = run("cpu")
    got, got_v, waits = run("cuda")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(want_v, got_v))
    steady = waits[warmup + 1:] if schedule == "delayed" else waits[1:]
    assert max(steady) <= CUDA_TRAINER_WAITS[schedule], waits


def test_tile_defaults_to_larger_pieces_on_cuda_with_tier_ram(tmp_path):
    """tile=None: 4M-element pieces where each piece is a device copy (CUDA, tier ram), the engine's 1M
    elsewhere; a tile given is used as given. engine_options is what OffloadOptimizer makes its engine from."""
    from zoe import _options

    def tile(cuda, **kw):
        o = dict(OffloadOptimizer(make_mlp(dtype=torch.bfloat16).parameters(), **kw)._options)
        opts, _, _ = _options.engine_options(o, partition=(1, 0), accumulation_steps=1, reduce=False,
                                             sharded=False, dtypes=[torch.float32], cuda=cuda)
        return opts.tile

    default = zoe.EngineOptions().tile
    assert default == 1 << 20
    assert tile(True) == _options.CUDA_TILE == 1 << 22
    assert tile(False) == default
    assert tile(True, tile=4096) == tile(False, tile=4096) == 4096
    nvme = dict(tier="nvme", nvme_path=str(tmp_path))
    assert tile(True, **nvme) == default  # tier nvme's tiles are its RAM buffers: they stay the engine's
