"""zoe.torch.offload_parameters with zoe's own OffloadOptimizer and parameter tier (C++), as a user runs them:
a 12-layer GPT whose 16-bit weights are 8x the device pool trains bit-identically to the same model with its
weights resident, for the cpu and nvme homes and the sync and overlap schedules. The optimizer writes the
updated weights into the tier; the pool's peak (counted by the tier) stays within its budget."""
import copy
import json
import math

import pytest
import torch

import zoe
from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, Block, GPTConfig
from zoe.torch import OffloadOptimizer, full_shape, offload_parameters

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


def test_a_deepspeed_offload_param_section_configures_offload_parameters(tmp_path):
    # A DeepSpeed user's zero_optimization.offload_param, read by zoe's config reader, is offload_parameters'
    # arguments: buffer_count blocks of buffer_size 16-bit elements make the pool, buffer_count - 2 of them are
    # fetched ahead (one more is in use and one released).
    model = _gpt()
    reference = copy.deepcopy(model)
    per_buffer = -(-_weight_bytes(model) // 8 // 4 // 2)  # elements: four buffers hold 1/8 of the weights
    ds = {"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4, "buffer_size": per_buffer,
        "max_in_cpu": 10**9, "pin_memory": True}}}
    cfg = zoe.parse_config(json.dumps(ds), "ds.json")
    assert cfg["offload_param"] == {"device": "nvme", "nvme_path": [str(tmp_path)], "prefetch": 2,
                                    "budget_bytes": 4 * per_buffer * 2}
    assert any("max_in_cpu" in n for n in cfg["notes"])  # read, and said to be unused
    off = offload_parameters(model, **cfg["offload_param"], block_modules=(Block,))
    # The parameter file on the configured path, and its owner lock (one tier per file).
    assert sorted(f.suffix for f in tmp_path.iterdir()) == [".lock", ".zoe-params"]
    s = off.stats()
    assert 0 < s["budget_bytes"] <= 4 * per_buffer * 2
    _, want = _train(reference, "sync", {}, steps=3)
    opt, got = _train(model, "sync", {}, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert off.stats()["pool_peak_bytes"] <= s["budget_bytes"]
    assert zoe.parse_config('{"zero_optimization": {"offload_param": {"device": "none"}}}')["offload_param"] is None
    del opt
    off.remove()


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


# ---- a device with memory of its own: gradients leave it as each parameter's backward ends ------------------

@pytest.fixture
def own_memory(monkeypatch):
    """The engine on the host stand-in (zoe.host_device: memory of its own, copy streams), as it runs on a GPU:
    the offloaded parameters' gradients go down when reported and share one window on the device."""
    import zoe
    monkeypatch.setattr(zoe.torch, "_cpu_device", zoe.host_device)


def _largest_param_bytes(model) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def _train_steps(model, data, opt, steps, micro=1, clip=None):
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            x, y = data.next()
            _, loss = model(x, y)
            (opt.scale_loss(loss) / micro).backward()
            losses.append(loss.detach().clone())
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
    return losses, norms


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
def test_gradients_leave_a_device_with_its_own_memory_bitwise(own_memory, schedule, micro):
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    args = dict(lr=3e-3, weight_decay=0.01, schedule=schedule, delayed_warmup_steps=3,
                gradient_accumulation_steps=micro if micro > 1 else None)
    runs = []
    for m in (reference, model):
        opt = OffloadOptimizer(m.parameters(), **args)
        losses, norms = _train_steps(m, ByteBatches(m.config.seq, 2, seed=7), opt, 8, micro=micro, clip=0.5)
        runs.append((losses, norms, opt))
    (want, want_norms, ref_opt), (got, got_norms, opt) = runs
    assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)
    assert got_norms == want_norms  # zoe's clip_grad_norm_ over the gradients that went down
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        a, b = opt.read_state(p), ref_opt.read_state(p_ref)
        assert all(torch.equal(a[k], b[k]) for k in a)
    full = off.full_state_dict()
    assert all(torch.equal(full[name], w) for name, w in reference.state_dict().items())
    # Every weight of this model is offloaded: the device holds one window, the largest parameter's gradient,
    # where the resident optimizer holds all of them.
    assert opt.stats()["device_grad_bytes"] == _largest_param_bytes(reference)
    assert ref_opt.stats()["device_grad_bytes"] == _weight_bytes(reference)
    assert _largest_param_bytes(reference) * 8 <= _weight_bytes(reference)
    # torch's form of the state (state_dict for torch.distributed.checkpoint) reads each parameter's own.
    a, b = opt.torch_state_dict(), ref_opt.torch_state_dict()
    for i, st in b["state"].items():
        assert all(torch.equal(st[k], a["state"][i][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_gradients_that_left_the_device_read_as_zeros_and_a_resumed_run_is_exact(own_memory):
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    data = [ByteBatches(model.config.seq, 2, seed=9) for _ in range(2)]
    ref_opt = OffloadOptimizer(reference.parameters(), lr=3e-3)
    opt = OffloadOptimizer(model.parameters(), lr=3e-3)
    _train_steps(reference, data[0], ref_opt, 3)
    _train_steps(model, data[1], opt, 3)
    saved = opt.state_dict()
    x, y = data[1].next()
    _, loss = model(x, y)
    loss.backward()
    assert all(p.grad.shape == full_shape(p) and not p.grad.any() for p in model.parameters())
    del opt
    resumed = OffloadOptimizer(model.parameters(), lr=3e-3)  # zoe's state_dict, into a new optimizer
    resumed.load_state_dict(saved)
    _train_steps(model, data[1], resumed, 3)
    x2, y2 = data[0].next()  # the batch the offloaded run's extra backward took
    assert torch.equal(x, x2) and torch.equal(y, y2)
    _train_steps(reference, data[0], ref_opt, 3)
    full = off.full_state_dict()
    assert all(torch.equal(full[name], w) for name, w in reference.state_dict().items())


def test_a_trainer_clipping_p_grad_of_offloaded_parameters_is_refused(own_memory):
    model = _gpt()
    off = offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    opt = OffloadOptimizer(model.parameters(), lr=3e-3)
    x, y = ByteBatches(model.config.seq, 2, seed=1).next()
    before = off.full_state_dict()
    _, loss = model(x, y)
    loss.backward()
    # torch's own function, as bound before zoe routed torch.nn.utils.clip_grad_norm_ (which zoe answers)
    torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"p\.grad of an offloaded parameter .* was changed after backward.*"
                                           r"Nothing was stepped.*a copy of torch's function bound before"):
        opt.step()
    assert opt.step_count == 0
    after = off.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt.zero_grad()  # the next iteration runs as usual
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    assert opt.step_count == 1


def test_undeclared_micro_batches_of_offloaded_parameters_are_refused(own_memory):
    model = _gpt()
    offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    opt = OffloadOptimizer(model.parameters(), lr=3e-3)
    data = ByteBatches(model.config.seq, 2, seed=1)
    _, loss = model(*data.next())
    loss.backward()
    _, loss = model(*data.next())
    with pytest.raises(RuntimeError, match=r"backward pass 2 since the last step reached offloaded parameter .*"
                                           r"gradient_accumulation_steps=<micro-batches per step>"):
        loss.backward()


def test_torch_clip_grad_norm_over_offloaded_parameters_is_zoes(own_memory):
    reference = _gpt()
    model = copy.deepcopy(reference)
    offload_parameters(model, budget_bytes=_weight_bytes(model) // 8, block_modules=(Block,))
    ref_opt = OffloadOptimizer(reference.parameters(), lr=3e-3)
    opt = OffloadOptimizer(model.parameters(), lr=3e-3)
    x, y = ByteBatches(model.config.seq, 2, seed=1).next()
    for m, o in ((reference, ref_opt), (model, opt)):
        _, loss = m(x, y)
        loss.backward()
    want = ref_opt.clip_grad_norm_(0.1)
    with pytest.raises(RuntimeError, match="must be given this optimizer's parameters .* 0 given with gradients "
                                           "are not the optimizer's, 3 of the optimizer's are not given"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[3:], 0.1)
    with pytest.raises(RuntimeError, match="norm_type=1.0 over offloaded parameters"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=1.0)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert float(got) == float(want) and float(got) > 0.1
    ref_opt.step()
    opt.step()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        assert torch.equal(opt.read_state(p)["master"], ref_opt.read_state(p_ref)["master"])
    # Over part of a resident optimizer's parameters it is torch's.
    part = list(reference.parameters())[3:]
    assert torch.equal(torch.nn.utils.clip_grad_norm_(part, math.inf),
                       torch.nn.utils.clip_grad.clip_grad_norm_(part, math.inf))
