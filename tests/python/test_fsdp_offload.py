"""Parameter offload of FSDP2 models (zoe.torch.offload_parameters on a fully_shard model) on two gloo ranks:
each rank's local shards in its own tier (RAM, or NVMe files under nvme_path/rank<r>), fetched by FSDP2's
all-gather extension and stepped by zoe's OffloadOptimizer into the tier.

A tiny Llama from a local config (vocabulary 67: its embedding and head shard unevenly, 34 + 33 rows), one
fully_shard per decoder layer and one at the root. One spawn runs every case on both ranks (``_rank_main``);
the tests read what each rank recorded. This file is also the conformance test of the FSDP2 internals that
zoe/_fsdp_offload.py relies on (its TESTED_TORCH)."""
import io
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import spawn_ranks, worst  # noqa: E402

WORLD = 2
STEPS = 10
MICRO = 2  # micro-batches per step, the first without gradient sync
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
# zoe against torch.optim.AdamW: only the order of float operations in each element's update differs; the
# issue's bound (as tests/python/test_fsdp2.py).
TORCH_TOL = 1e-5
PREFETCH = 2

# name -> (home, how the model is made: _llama's keywords). Together: both homes, both reshard_after_forward
# values, activation checkpointing, explicit prefetch, 16-bit weights in the tier, FSDP2's mixed precision.
CONFIGS = {
    "ram_reshard": ("cpu", dict(reshard=True)),
    "nvme_keep": ("nvme", dict(reshard=False)),
    "ram_checkpointed_prefetched": ("cpu", dict(reshard=True, checkpointing=True, prefetch=True)),
    "nvme_bf16": ("nvme", dict(reshard=True, dtype=torch.bfloat16)),
    "ram_bf16_compute": ("cpu", dict(reshard=True, compute=torch.bfloat16)),
    # The gradients to the host as FSDP2 reduce-scatters them (on a GPU, their way off it); pinning needs CUDA.
    "nvme_cpu_offload_policy": ("nvme", dict(reshard=True, offload_policy="cpu")),
    # ZeRO-Infinity: the optimizer's state on NVMe as well, stepped window by window from FSDP2's gradients.
    "nvme_state_on_nvme": ("nvme", dict(reshard=True, dtype=torch.bfloat16, state="nvme")),
}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _llama(reshard=True, checkpointing=False, prefetch=False, wrap_root=True, dtype=torch.float32, compute=None,
           **kw):
    """The tiny Llama, fully_shard per decoder layer and at the root. dtype: its weights'; compute: FSDP2's
    MixedPrecisionPolicy param_dtype (None: none)."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    if kw.get("offload_policy") == "cpu":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if compute is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = list(model.model.layers)
    mesh = _mesh()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
    if wrap_root:
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    if prefetch:
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _ids(rank, step, micro, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 67, (2, 16), generator=g).to(device)


def _train(model, opt, rank, offload=None, steps=STEPS, first=0, device="cpu", between=None):
    """MICRO micro-batches per step (gradient sync on the last only), clipping by torch's clip_grad_norm_, and
    ``between()`` after each step. Returns the tier's fetch counters after each step (None without an offload)."""
    counters = []
    for step in range(first, first + steps):
        for m in range(MICRO):
            model.set_requires_gradient_sync(m == MICRO - 1)
            ids = _ids(rank, step, m, device)
            (model(input_ids=ids, labels=ids).loss / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if offload is not None:
            s = offload.stats()
            counters.append((s["fetches"], s["hits"], s["pool_peak_bytes"], s["budget_bytes"]))
        if between is not None:
            between()
    return counters


def _shards(model, offload=None):
    """Each parameter's local shard, on the CPU (the tier's weights are; a resident shard may be on a GPU)."""
    return [offload.weights(p) if offload is not None and hasattr(p, "_zoe_param_offload")
            else p.to_local().detach().cpu().clone() for p in model.parameters()]


def _diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"
    return ""


# ---- what each rank runs ------------------------------------------------------------------------------

def _parity(rank, out, tmp):
    from zoe.torch import OffloadOptimizer, offload_parameters

    for name, (home, kw) in CONFIGS.items():
        kw = dict(kw)
        state = kw.pop("state", "ram")  # the offloaded run's optimizer tier; the resident run's is ram
        resident = _llama(**kw)
        _train(resident, OffloadOptimizer(resident.parameters(), **HYPER), rank)
        model = _llama(**kw)
        off = offload_parameters(model, home, nvme_path=os.path.join(tmp, name) if home == "nvme" else None,
                                 prefetch=PREFETCH)
        opt = OffloadOptimizer(model.parameters(), **HYPER, tier=state,
                               nvme_path=os.path.join(tmp, f"{name}_state") if state == "nvme" else None)
        counters = _train(model, opt, rank, off)
        out[f"{name}_d2h_bytes"] = opt.stats()["d2h_bytes"]
        out[f"{name}_vs_resident"] = _diff(_shards(resident), _shards(model, off))
        out[f"{name}_counters"] = counters
        out[f"{name}_groups"] = len(off.blocks)
        out[f"{name}_largest_block"] = max(off._block_bytes)
        if name in READ_CONFIGS:
            out[f"{name}_final"] = _shards(model, off)
        if home == "nvme":
            out[f"{name}_files"] = [os.path.relpath(f, tmp) for f in off.tier.files()]
        if name == "ram_reshard":
            torch_model = _llama(**kw)
            _train(torch_model, torch.optim.AdamW(torch_model.parameters(), **HYPER), rank)
            out[f"{name}_vs_torch"] = _diff(_shards(torch_model), _shards(model, off))
            # remove(): the shards back in FSDP's hands, as the tier held them, and training goes on.
            held = _shards(model, off)
            del opt
            off.remove()
            out["removed_equal"] = _diff(held, _shards(model)) == 0.0
            x = _ids(rank, 0, 0)
            model(input_ids=x, labels=x).loss.backward()
            out["removed_trains"] = all(p.grad is not None for p in model.parameters())


def _bad_input(rank, out, tmp):
    import zoe
    from zoe import _fsdp_offload
    from zoe.torch import offload_parameters

    out["err_root_not_wrapped"] = _error(lambda: offload_parameters(_llama(wrap_root=False)))
    tested = _fsdp_offload.TESTED_TORCH
    _fsdp_offload.TESTED_TORCH = ((9, 0), (9, 1))
    try:
        out["err_torch_range"] = _error(lambda: offload_parameters(_llama()))
    finally:
        _fsdp_offload.TESTED_TORCH = tested
    # A DeepSpeed config's stage 3 offload_param, as zoe reads it, is this call's arguments.
    config = os.path.join(tmp, f"ds{rank}.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": os.path.join(tmp, "ds"), "buffer_count": 5}}}, f)
    section = zoe.load_config(config)["offload_param"]
    from_config = offload_parameters(_llama(), **section)
    out["ds_config"] = (type(from_config).__name__, section["prefetch"], len(from_config.tier.files()))
    from_config.remove()

    model = _llama()
    off = offload_parameters(model)
    p = model.model.layers[0].mlp.up_proj.weight
    out["err_in_place"] = _error(lambda: p.data.add_(1))
    out["err_twice"] = _error(lambda: offload_parameters(model))
    # The tier's bindings take the array itself: a DTensor, a non-contiguous view and a buffer longer than
    # the entry are refused, and the entry keeps its bytes.
    before = off.weights(p)
    local = before.clone()
    out["err_write_dtensor"] = _error(lambda: off.tier.write(0, 0, model.model.norm.weight))
    # A strided source is written by value (nanobind copies it contiguous); a strided destination is refused,
    # since the copy it would fill would be dropped.
    shape = (local.shape[1], local.shape[0])
    off.tier.write(*off.param_location(p), local.reshape(shape).t())
    out["strided_write_by_value"] = torch.equal(off.weights(p), local.reshape(shape).t().contiguous().view(local.shape))
    off.tier.write(*off.param_location(p), local)
    out["err_read_strided"] = _error(lambda: off.tier.read(*off.param_location(p), torch.zeros(shape).t()))
    out["err_write_long"] = _error(lambda: off.tier.write(*off.param_location(p), torch.zeros(local.numel() + 1)))
    out["err_read_long"] = _error(lambda: off.tier.read(*off.param_location(p), torch.zeros(local.numel() + 1)))
    out["kept_after_bad_writes"] = torch.equal(before, off.weights(p))
    # CpuAdam given the DTensor itself (its bytes are nowhere in this process).
    norm = model.model.norm.weight
    state = [torch.zeros(norm.shape) for _ in range(3)]  # its global size, as DLPack gives it
    out["err_adam_dtensor"] = _error(lambda: zoe.CpuAdam().step([norm], [state[0]], [state[1]], [state[2]], step=1))
    # The engine's weights and gradients, and its gradient sources, are arrays checked the same way.
    n = norm.numel()
    spec = [(n, "f32", norm, torch.zeros(n), 0, "norm", [n])]
    out["err_engine_dtensor"] = _error(lambda: zoe.Engine(zoe.cpu_device(), [dict(lr=1e-3)], spec, zoe.EngineOptions()))
    engine = zoe.Engine(zoe.cpu_device(), [dict(lr=1e-3)], [(n, "f32", torch.zeros(n), torch.zeros(n), 0, "norm", [n])],
                        zoe.EngineOptions())
    out["err_grad_source_dtensor"] = _error(lambda: engine.set_grad_sources([0], [norm]))


# Reads outside materialize() between training steps, on both homes: the configurations of test_fetches_per_step,
# whose counters and weights without reads _parity records.
READ_CONFIGS = ("ram_reshard", "nvme_keep")
WRITTEN = "model.layers.0.mlp.up_proj.weight"


def _tier_counters(offload):
    s = offload.stats()
    return s["fetches"], s["hits"], s["pool_peak_bytes"]


def _read_all(model) -> dict:
    """What logging, evaluation and state_dict code read of an FSDP2 model outside materialize(): each
    parameter's full tensor; its local shard cloned, summed, its norm printed, on the CPU, compared, in NumPy;
    model.state_dict()'s values as full tensors; and torch.save of the state dict (its DTensors and their full
    tensors), loaded back."""
    from torch.distributed.tensor import DTensor

    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    local, agree = {}, True
    for n, p in model.named_parameters():
        shard = p.to_local()
        copy = local[n] = shard.clone()
        printed = f"{shard.norm():.6f} {shard.sum():.6f}"
        agree &= printed == f"{copy.norm():.6f} {copy.sum():.6f}" and torch.equal(shard.cpu(), copy)
        agree &= bool((shard == copy).all())
        if shard.dtype != torch.bfloat16:  # which NumPy lacks
            agree &= bool((shard.detach().cpu().numpy() == copy.detach().numpy()).all())
    state = model.state_dict()
    state_full = {k: v.full_tensor() for k, v in state.items() if isinstance(v, DTensor)}
    saved = io.BytesIO()
    torch.save({"state": state, "full": state_full}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    return dict(full=full, local=local, agree=agree, state_keys=sorted(state_full), state_full=state_full,
                loaded_full=loaded["full"], loaded=loaded["state"],
                loaded_state_full={k: v.full_tensor() for k, v in loaded["state"].items() if isinstance(v, DTensor)})


def _writes(model, p, loaded) -> dict:
    """Writes outside gathered(), each refused: to the local shard, through a view of it, through .data, into
    it as out=, on the DTensor, and a load_state_dict of other values."""
    x = p.to_local().clone()
    writes = {
        "add_": lambda: p.to_local().add_(1),
        "copy_": lambda: p.to_local().copy_(torch.ones_like(x)),
        "data_zero_": lambda: p.data.zero_(),
        "row_zero_": lambda: p.to_local()[0].zero_(),
        "t_mul_": lambda: p.to_local().t().mul_(2),
        "out": lambda: torch.add(x, x, out=p.to_local()),
        "dtensor_add_": lambda: p.add_(1),
        "load_state_dict": lambda: model.load_state_dict({k: v + 1 for k, v in loaded.items()}),
    }
    with torch.no_grad():
        errors = {k: _error(f) for k, f in writes.items()}
    errors["numpy"] = _error(lambda: p.to_local().detach().numpy().__setitem__(0, 1))
    return errors


def _reads(rank, out, tmp):
    """Reads before the first forward (whose order the tier records) and between the steps, then compared with
    materialize()'s values; then writes, refused."""
    from torch.distributed.tensor import DTensor

    from zoe.torch import OffloadOptimizer, offload_parameters

    for name in READ_CONFIGS:
        home, kw = CONFIGS[name]
        model = _llama(**kw)
        off = offload_parameters(model, home, prefetch=PREFETCH,
                                 nvme_path=os.path.join(tmp, f"reads_{name}") if home == "nvme" else None)
        moved = []  # whether a read changed the tier's fetches, hits or pool peak

        def between():
            before = _tier_counters(off)
            got = _read_all(model)
            moved.append(_tier_counters(off) != before)
            return got

        between()
        out[f"reads_{name}_counters"] = _train(model, OffloadOptimizer(model.parameters(), **HYPER), rank, off,
                                               between=between)
        out[f"reads_{name}_final"] = _shards(model, off)
        got = between()
        out[f"reads_{name}_moved"] = any(moved)
        with off.materialize():
            inside = {n: p.full_tensor() for n, p in model.named_parameters()}
            inside_state = {k: v.full_tensor() for k, v in model.state_dict().items() if isinstance(v, DTensor)}
        weights = {n: off.weights(p) for n, p in model.named_parameters()}
        out[f"reads_{name}_full"] = all(torch.equal(got["full"][n], inside[n]) for n in inside)
        out[f"reads_{name}_local"] = got["agree"] and all(torch.equal(got["local"][n], weights[n]) for n in weights)
        out[f"reads_{name}_state"] = (got["state_keys"] == sorted(inside_state) and
                                      all(torch.equal(got[k][n], inside_state[n]) for n in inside_state
                                          for k in ("state_full", "loaded_full", "loaded_state_full")))
        out[f"reads_{name}_loaded_types"] = sorted({(type(v).__name__, type(v._local_tensor).__name__)
                                                    for v in got["loaded"].values()})
        p = model.get_parameter(WRITTEN)
        before, full_before = off.weights(p), p.full_tensor()
        out[f"reads_{name}_writes"] = _writes(model, p, got["loaded"])
        out[f"reads_{name}_kept"] = torch.equal(before, off.weights(p)) and torch.equal(full_before, p.full_tensor())


def _dcp(rank, out, tmp):
    """torch.distributed.checkpoint at step 5 inside materialize(), resumed inside gathered() into a model whose
    weights differ (the load must bring them): steps 6-10 equal the uninterrupted run bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zoe.torch import OffloadOptimizer, offload_parameters

    path = os.path.join(tmp, "dcp")
    straight = _llama()
    straight_off = offload_parameters(straight)
    _train(straight, OffloadOptimizer(straight.parameters(), **HYPER), rank, straight_off)
    first = _llama()
    off = offload_parameters(first)
    opt = OffloadOptimizer(first.parameters(), **HYPER)
    _train(first, opt, rank, off, steps=5)
    with off.materialize():
        model_sd, optim_sd = get_state_dict(first, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        out["dcp_full"] = {n: p.full_tensor() for n, p in first.named_parameters()}
    resumed = _llama()
    with torch.no_grad():
        for p in resumed.parameters():
            p.to_local().add_(1.0)
    resumed_off = offload_parameters(resumed)
    opt = OffloadOptimizer(resumed.parameters(), **HYPER)
    with resumed_off.gathered():
        model_sd, optim_sd = get_state_dict(resumed, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(resumed, opt, rank, resumed_off, steps=5, first=5)
    out["dcp_resumed"] = _diff(_shards(straight, straight_off), _shards(resumed, resumed_off))
    out["dcp_folder"] = path


def _rank_main(rank, init_file, out_dir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    try:
        _parity(rank, out, out_dir)
        _dcp(rank, out, out_dir)
        _reads(rank, out, out_dir)
        _bad_input(rank, out, out_dir)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, tmp_path_factory.mktemp("fsdp_offload"), WORLD)


# ---- the tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", list(CONFIGS))
def test_offloaded_shards_equal_resident_shards_bitwise(ranks, config):
    diff = worst(ranks, f"{config}_vs_resident")
    print(f"{config}: {STEPS} steps of {MICRO} micro-batches with clipping, offloaded against resident shards: "
          f"max difference {diff}")
    assert diff == 0.0


def test_state_on_nvme_reads_fsdp2_gradients_in_place(ranks):
    """The CPU as the device, weights and state on NVMe: the streamed step reads FSDP2's gradients where they
    are; nothing the size of the gradients is copied (issue 51)."""
    assert [r["nvme_state_on_nvme_d2h_bytes"] for r in ranks] == [0] * WORLD


def test_offloaded_shards_follow_torch_adamw_on_plain_fsdp2(ranks):
    diff = worst(ranks, "ram_reshard_vs_torch")
    print(f"zoe + offloaded FSDP2 against torch AdamW + plain FSDP2: max difference {diff:.2e}")
    assert diff <= TORCH_TOL


@pytest.mark.parametrize("config,per_group", [("ram_reshard", 2), ("nvme_keep", 1)])
def test_fetches_per_step(ranks, config, per_group):
    """One fetch per FSDP all-gather of a group (the root's too, given reshard_after_forward like the others):
    forward and backward with reshard_after_forward, forward only without; each micro-batch fetches again, as
    FSDP2 reshards after each backward."""
    for r in ranks:
        groups = r[f"{config}_groups"]
        fetches = [c[0] for c in r[f"{config}_counters"]]
        per_step = [b - a for a, b in zip(fetches, fetches[1:])]
        expected = MICRO * groups * per_group
        print(f"{config}: {groups} groups, fetches per step {per_step} (expected {expected})")
        assert per_step == [expected] * (STEPS - 1)


def test_prefetch_hits_from_the_second_step_on(ranks):
    for r in ranks:
        counters = r["ram_reshard_counters"]
        (f1, h1), (fn, hn) = counters[0][:2], counters[-1][:2]
        print(f"fetches {fn - f1} and hits {hn - h1} over steps 2..{STEPS}")
        assert fn - f1 > 0 and hn - h1 == fn - f1


@pytest.mark.parametrize("config", list(CONFIGS))
def test_pool_stays_within_its_bound(ranks, config):
    """The tier's pool, the device memory the fetched shards take (pinned bounce on a GPU), holds at most
    (prefetch + 2) x the largest group's shard: the group FSDP is copying, the one before it, and `prefetch`
    ahead."""
    for r in ranks:
        peak, budget = r[f"{config}_counters"][-1][2:]
        bound = (PREFETCH + 2) * r[f"{config}_largest_block"]
        print(f"{config}: pool peak {peak} bytes, budget {budget}, bound {bound}")
        assert 0 < peak <= budget <= bound


def test_nvme_files_per_rank(ranks):
    for rank, r in enumerate(ranks):
        assert r["nvme_keep_files"] and all(f.startswith(os.path.join("nvme_keep", f"rank{rank}")) for f in
                                            r["nvme_keep_files"])


@pytest.mark.parametrize("config", READ_CONFIGS)
def test_reads_outside_materialize_give_the_tiers_values(ranks, config):
    """p.full_tensor(), the local shard's reads and model.state_dict()'s values (and torch.save of them, loaded
    back) outside materialize() equal materialize()'s full tensors and offload.weights(p) bitwise, after
    STEPS steps with those reads between them."""
    for r in ranks:
        print(f"{config}: full tensors {r[f'reads_{config}_full']}, local shards {r[f'reads_{config}_local']}, "
              f"state dict {r[f'reads_{config}_state']}, loaded as {r[f'reads_{config}_loaded_types']}")
        assert r[f"reads_{config}_full"] and r[f"reads_{config}_local"] and r[f"reads_{config}_state"]
        # torch.save pickles each DTensor's local shard as the tensor of its values: a plain DTensor state dict.
        assert r[f"reads_{config}_loaded_types"] == [("DTensor", "Tensor")]


@pytest.mark.parametrize("config", READ_CONFIGS)
def test_reads_between_steps_leave_the_tier_and_the_training_alone(ranks, config):
    """The reads fetch nothing into the pool (the fetches, hits and pool peak are unchanged across each of them,
    the one before the first forward included), so each step's fetches are those of the run without reads, from
    the second step on every fetch finds its group loaded, and the weights are that run's bitwise."""
    for r in ranks:
        fetches = [c[0] for c in r[f"reads_{config}_counters"]]
        (f1, h1), (fn, hn) = r[f"reads_{config}_counters"][0][:2], r[f"reads_{config}_counters"][-1][:2]
        diff = _diff(r[f"{config}_final"], r[f"reads_{config}_final"])
        print(f"{config}: fetches after each step {fetches}, hits {hn - h1} of {fn - f1} over steps 2..{STEPS}, "
              f"counters moved by a read: {r[f'reads_{config}_moved']}, weights against the run without reads {diff}")
        assert not r[f"reads_{config}_moved"]
        assert fetches == [c[0] for c in r[f"{config}_counters"]]
        assert fn - f1 > 0 and hn - h1 == fn - f1
        assert diff == 0.0


@pytest.mark.parametrize("config", READ_CONFIGS)
def test_writes_outside_gathered_are_refused_naming_the_parameter(ranks, config):
    for r in ranks:
        for case, message in r[f"reads_{config}_writes"].items():
            print(f"{config} {case}: {message[:300]}")
            if case == "numpy":  # a read-only array of the values
                assert "read-only" in message
            else:
                assert f"'{WRITTEN}'" in message and "parameter tier" in message and "gathered()" in message
        assert r[f"reads_{config}_kept"]


def test_dcp_checkpoint_resumes_bitwise(ranks):
    diff = worst(ranks, "dcp_resumed")
    print(f"saved at step 5, resumed, steps 6-{STEPS}: max difference from the uninterrupted run {diff}")
    assert diff == 0.0


def _plain_load_main(rank, world, init_file, folder, out_dir):
    """Plain FSDP2, no zoe, on another number of ranks: loads the offloaded run's model checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _llama()
        sd = get_model_state_dict(model)
        dcp.load({"model": sd}, checkpoint_id=folder)
        set_model_state_dict(model, sd)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 3])
def test_the_checkpoint_loads_into_plain_fsdp2_on_another_world_size(ranks, world, tmp_path):
    mp.spawn(_plain_load_main, args=(world, str(tmp_path / "init"), ranks[0]["dcp_folder"], str(tmp_path)),
             nprocs=world, join=True)
    loaded = torch.load(tmp_path / "full.pt")
    saved = ranks[0]["dcp_full"]
    assert loaded.keys() == saved.keys()
    diff = max((loaded[n] - saved[n]).abs().max().item() for n in saved)
    print(f"plain FSDP2 on {world} ranks: {len(saved)} parameters loaded, max difference {diff}")
    assert diff == 0.0


# The meta-device model: WIDE x WIDE fp32 layers, one fully_shard group each; each rank's shard is LAYERS
# groups of WIDE * WIDE / 2 elements, 16x the tier pool's default budget ((prefetch + 2) x the largest group).
WIDE, LAYERS = 1024, 64


def _peak_growth(fn) -> int:
    """Bytes the process's peak resident set grew over its resident set before ``fn`` (Linux: clear_refs 5
    resets the peak)."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def _meta_main(rank, init_file, out_dir):
    """A model created on the meta device, initialised into the NVMe tier group by group; then a forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zoe.torch import OffloadOptimizer, offload_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDE, WIDE) for _ in range(LAYERS)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out["err_meta_without_init"] = _error(lambda: offload_parameters(model, "nvme", nvme_path=out_dir))

        def init(m):
            if isinstance(m, torch.nn.Linear):
                m.reset_parameters()

        made = {}
        out["init_growth"] = _peak_growth(lambda: made.setdefault(
            "off", offload_parameters(model, "nvme", nvme_path=out_dir, init=init)))
        off = made["off"]
        out["shard_bytes"] = sum(off._block_bytes)
        out["budget"] = off.stats()["budget_bytes"]
        weights = torch.cat([off.weights(layer.weight).reshape(-1) for layer in model])
        out["weight_abs_max"], out["weight_std"] = weights.abs().max().item(), weights.std().item()
        x = torch.randn(4, WIDE, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            # The first forward makes the tier's pool and I/O buffers and FSDP's, which stay.
            out["first_forward_growth"] = _peak_growth(lambda: model(x))
            out["forward_growth"] = _peak_growth(lambda: model(x))
        opt = OffloadOptimizer(model.parameters(), lr=1e-3)
        before = off.weights(model[0].weight)
        model(x).square().mean().backward()
        opt.step()
        out["stepped"] = not torch.equal(before, off.weights(model[0].weight))
    finally:
        torch.save(out, os.path.join(out_dir, f"meta{rank}.pt"))
        dist.destroy_process_group()


def test_a_meta_model_is_initialised_group_by_group_into_the_tier(tmp_path, monkeypatch):
    # glibc raises its mmap threshold as large blocks are freed, and then keeps freed memory resident: a fixed
    # threshold makes the resident set follow what is allocated.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    mp.spawn(_meta_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    bound = 1 / WIDE ** 0.5  # nn.Linear.reset_parameters: uniform within +-1/sqrt(fan_in)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"meta{rank}.pt")
        mib = 2 ** 20
        print(f"rank {rank}: shard {r['shard_bytes'] / mib:.0f} MiB ({r['shard_bytes'] / r['budget']:.0f}x the "
              f"pool budget of {r['budget'] / mib:.0f} MiB); peak RSS growth: initialising "
              f"{r['init_growth'] / mib:.1f} MiB, the first forward {r['first_forward_growth'] / mib:.1f} MiB, "
              f"the next {r['forward_growth'] / mib:.1f} MiB; weights |max| "
              f"{r['weight_abs_max']:.4f} (bound {bound:.4f}), std {r['weight_std']:.4f}")
        assert "meta device: pass init" in r["err_meta_without_init"]
        assert r["shard_bytes"] >= 16 * r["budget"]
        # Never a whole rank's shard in memory: a quarter of it leaves room for the pool and a group or two, half
        # of it also for the buffers the first forward makes.
        assert r["init_growth"] < r["shard_bytes"] / 4 and r["forward_growth"] < r["shard_bytes"] / 4
        assert r["first_forward_growth"] < r["shard_bytes"] / 2
        assert r["weight_abs_max"] <= bound
        assert abs(r["weight_std"] - bound / 3 ** 0.5) < 0.05 * bound / 3 ** 0.5  # uniform's std, 5%
        assert r["stepped"]


def test_remove_gives_the_shards_back(ranks):
    assert all(r["removed_equal"] and r["removed_trains"] for r in ranks)


@pytest.mark.parametrize("case,message", [
    ("err_root_not_wrapped", "not wrapped with fully_shard"),
    ("err_torch_range", "outside the range"),
    ("err_in_place", "parameter tier"),
    ("err_twice", "all-gather extension already"),
    ("err_write_dtensor", "no memory of its own"),
    ("err_adam_dtensor", "no memory of its own"),
    ("err_engine_dtensor", "parameter 0 'norm' weights: the tensor has no memory of its own"),
    ("err_grad_source_dtensor", "set_grad_sources: parameter 0 gradient: the tensor has no memory of its own"),
    ("err_read_strided", "TypeError"),
    ("err_write_long", "bytes"),
    ("err_read_long", "bytes"),
])
def test_bad_input_is_refused(ranks, case, message):
    for r in ranks:
        print(f"{case}: {r[case]}")
        assert message in r[case]


def test_a_deepspeed_stage_3_offload_param_section_configures_it(ranks):
    for r in ranks:
        assert r["ds_config"] == ("ShardOffload", 3, 1)  # prefetch = buffer_count - 2; one file per rank


def test_bad_writes_keep_the_entry(ranks):
    assert all(r["kept_after_bad_writes"] and r["strided_write_by_value"] for r in ranks)


def _int_reshard_main(rank, init_file, out_dir):
    """An integer reshard_after_forward needs a mesh it divides into smaller ones: 4 ranks resharding to 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zoe.torch import offload_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        mesh = init_device_mesh("cpu", (4,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=2)
        fully_shard(model, mesh=mesh, reshard_after_forward=2)
        torch.save(_error(lambda: offload_parameters(model)), os.path.join(out_dir, f"int{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_an_integer_reshard_after_forward_is_refused(tmp_path):
    mp.spawn(_int_reshard_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        message = torch.load(tmp_path / f"int{rank}.pt")
        print(f"rank {rank}: {message}")
        assert "integer reshard_after_forward" in message


def test_the_benchmark_runs_every_contender(tmp_path):
    """python -m zoe.bench_fsdp, tiny: every contender reports, the tier's fetch counters add up (its figures
    are measured, not asserted: docs/performance.md)."""
    import subprocess

    run = subprocess.run([sys.executable, "-m", "zoe.bench_fsdp", "--layers", "2", "--hidden", "64", "--steps", "2",
                          "--warmup", "1", "--path", str(tmp_path), "--json"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    print("\n".join(run.stdout.splitlines()))
    assert [r["contender"] for r in rows] == ["resident", "cpu_offload_policy", "tier_cpu", "tier_cpu", "tier_nvme",
                                              "tier_nvme"]
    for r in rows[2:]:
        assert r["fetches_per_step"] == 2 * 2  # two groups (the root holds none), forward and backward
        assert 0 <= r["fetch_wait_fraction"] < 1 and r["pool_peak_bytes"] <= r["budget_bytes"]
    assert all(r["hit_fraction"] == 1.0 for r in rows[2:] if r["prefetch"] == 2)
    bad = subprocess.run([sys.executable, "-m", "zoe.bench_fsdp", "--warmup", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--warmup 0" in bad.stderr
