"""zoe under torch's own data parallelism on two gloo processes: FSDP2 (``fully_shard``; DTensor parameters,
each rank's shards stepped in place, with and without CPUOffloadPolicy) and DistributedDataParallel, each
against the same wrapper with torch.optim.AdamW.

Spawning is most of the cost, so one spawn runs every case on both ranks (``_rank_main``) and the tests below
read what each rank recorded."""
import math
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batches, make_mlp, spawn_ranks, worst  # noqa: E402

WORLD = 2
STEPS = 10
# AdamW's default weight_decay (torch's and zoe's), given explicitly.
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
MAX_NORM = 0.05  # below the MLP's gradient norms (~0.3): clipping acts at every step
# fp32 against torch.optim.AdamW: only the order of float operations in each element's update differs
# (~1e-7 measured); the bound.
TORCH_TOL = 1e-5
# zoe's global norm (a double sum of each rank's shards) against FSDP2's clip_grad_norm_ (fp32 on DTensors).
NORM_REL_TOL = 1e-5
# A clipped run must differ from an unclipped one by far more than TORCH_TOL, or clipping was not tested.
CLIP_EFFECT = 1e-3


# ---- what each rank runs ------------------------------------------------------------------------------

def _cpu_mesh():
    # fully_shard's default mesh is on the GPU where there is one; gloo and these tests are the CPU's.
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _fsdp_mlp(offload: bool, mesh=None, dtype=torch.float32, seed=0):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = {"mesh": mesh if mesh is not None else _cpu_mesh()}
    if offload:
        # Pinned memory needs CUDA; on a CPU-only machine the shards are in ordinary host memory.
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    model = make_mlp(seed=seed, dtype=dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _train(model, opt, rank, clip=None, steps=STEPS, first=0):
    """Each rank its half of every batch. clip: None, "torch" (FSDP2's / torch's clip_grad_norm_ on the
    model) or "zoe" (opt.clip_grad_norm_). Returns the norms the clipping reported."""
    norms = []
    for x, y in batches(first + steps, batch=16)[first:]:
        half = slice(rank * 8, (rank + 1) * 8)
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        if clip == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        elif clip == "zoe":
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms


def _local(model):
    return [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
            for p in model.parameters()]


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _fsdp_parity(rank, out):
    from zoe.torch import OffloadOptimizer

    for offload in (False, True):
        plain = None
        for clip in (None, "torch", "zoe", "max_grad_norm"):
            ref = _fsdp_mlp(offload)
            ref_norms = _train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), rank, "torch" if clip else None)
            mine = _fsdp_mlp(offload)
            max_grad_norm = MAX_NORM if clip == "max_grad_norm" else None
            opt = OffloadOptimizer(mine.parameters(), **HYPER, max_grad_norm=max_grad_norm)
            norms = _train(mine, opt, rank, clip if clip in ("torch", "zoe") else None)
            key = f"fsdp2{'_offload' if offload else ''}_{clip or 'noclip'}"
            out[key] = _diff(_local(ref), _local(mine))
            if clip == "zoe":
                out[key + "_norm_rel"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
            if clip is None:
                plain = _local(mine)
            else:
                out[key + "_clip_effect"] = _diff(plain, _local(mine))
        # With zero_grad(set_to_none=False) (p.grad: zoe's zeroed buffers once a step has taken the first
        # gradients; torch leaves a None gradient None), FSDP2 adds its reduce-scattered gradients into zoe's
        # p.grad (no copy at step) and all-gathers the weights from the shards zoe writes: on the CPU with
        # CPUOffloadPolicy.
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        grads = [p.grad for p in mine.parameters()]
        torch.nn.functional.mse_loss(mine(x), y).backward()
        out[f"fsdp2{'_offload' if offload else ''}_in_place"] = (
            all(p.grad is g for p, g in zip(mine.parameters(), grads))
            and all(p.to_local().device.type == "cpu" for p in mine.parameters()))


def _fsdp_none_grads(rank, out):
    """torch's rule on sharded parameters: a layer whose gradient is None on every rank (as a trainer leaves a
    layer it froze, or one no rank used) is not stepped — weight decay and momentum leave it alone — in zoe as
    in torch.optim.AdamW, and each parameter keeps its own step count."""
    from zoe.torch import OffloadOptimizer

    finals, held = [], []
    for make in (lambda ps: torch.optim.AdamW(ps, **HYPER), lambda ps: OffloadOptimizer(ps, **HYPER)):
        model = _fsdp_mlp(False)
        opt = make(model.parameters())
        first = model[0].weight
        for t, (x, y) in enumerate(batches(6, batch=16)):
            half = slice(rank * 8, (rank + 1) * 8)
            torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
            if 2 <= t < 5:
                first.grad = None
            before = first.to_local().detach().clone()
            opt.step()
            opt.zero_grad()
            if 2 <= t < 5:
                held.append(torch.equal(before, first.to_local()))
        finals.append(_local(model))
    out["fsdp2_none_grads"] = _diff(*finals)
    out["fsdp2_none_grads_held"] = all(held)


def _fsdp_edits(rank, out):
    """The model's weights are the truth between steps: an edit of the sharded weights after the optimizer
    exists (model.load_state_dict of DTensors, nn.init, copy_ under no_grad) is taken into zoe's master, not
    reverted by the next step. bf16 shards: zoe's fp32 master is apart from them."""
    from zoe.torch import OffloadOptimizer

    for offload in (False, True):
        for edit in ("load_state_dict", "init", "copy_"):
            model, other = _fsdp_mlp(offload, dtype=torch.bfloat16), _fsdp_mlp(offload, dtype=torch.bfloat16, seed=5)
            opt = OffloadOptimizer(model.parameters(), lr=1e-6, weight_decay=0.0)
            data = batches(3, batch=16)

            def train(x, y):
                half = slice(rank * 8, (rank + 1) * 8)
                torch.nn.functional.mse_loss(model(x[half].bfloat16()).float(), y[half]).backward()
                opt.step()
                opt.zero_grad()

            for x, y in data[:2]:
                train(x, y)
            p = model[2].weight
            if edit == "load_state_dict":
                model.load_state_dict(other.state_dict())
            elif edit == "init":
                torch.nn.init.constant_(p, 0.5)
            else:
                with torch.no_grad():
                    p.copy_(other[2].weight)
            want = _local(model)
            train(*data[2])
            # One step at lr 1e-6: within a bf16 ulp of what was set; reverted, ~0.1 off.
            out[f"fsdp2{'_offload' if offload else ''}_edit_{edit}"] = _diff(want, _local(model))


def _fsdp_llama(rank, out):
    """A tiny Llama (local config, no download), one fully_shard per decoder layer; its vocabulary of 67
    rows shards unevenly (34 + 33)."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoe.torch import OffloadOptimizer

    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(rank))
    models = []
    for make in (lambda ps: torch.optim.AdamW(ps, **HYPER), lambda ps: OffloadOptimizer(ps, **HYPER)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mesh=_cpu_mesh())
        fully_shard(model, mesh=_cpu_mesh())
        opt = make(model.parameters())
        for _ in range(5):
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        models.append(_local(model))
    out["llama"] = _diff(*models)


def _fsdp_hsdp(rank, out):
    """2-D meshes (HSDP): the norm sums over the shard dimension only — over the replicas it would be
    sqrt(2) too large on the (2, 1) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from zoe.torch import OffloadOptimizer

    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        ref = _fsdp_mlp(False, mesh)
        ref_norms = _train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), rank, "torch")
        mine = _fsdp_mlp(False, mesh)
        norms = _train(mine, OffloadOptimizer(mine.parameters(), **HYPER), rank, "zoe")
        out[f"hsdp{shape}"] = _diff(_local(ref), _local(mine))
        out[f"hsdp{shape}_norm_rel"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))


def _fsdp_state_dict(rank, out):
    import io

    from zoe.torch import OffloadOptimizer

    for offload in (False, True):
        straight = _fsdp_mlp(offload)
        _train(straight, OffloadOptimizer(straight.parameters(), **HYPER, max_grad_norm=MAX_NORM), rank)
        first = _fsdp_mlp(offload)
        opt = OffloadOptimizer(first.parameters(), **HYPER, max_grad_norm=MAX_NORM)
        _train(first, opt, rank, steps=5)
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)  # each rank its own
        saved.seek(0)
        resumed = _fsdp_mlp(offload)  # the initial weights: load_state_dict sets them from the masters
        opt = OffloadOptimizer(resumed.parameters(), **HYPER, max_grad_norm=MAX_NORM)
        state = torch.load(saved, weights_only=False)
        opt.load_state_dict(state)
        _train(resumed, opt, rank, steps=5, first=5)
        key = f"state_dict{'_offload' if offload else ''}"
        out[key] = _diff(_local(straight), _local(resumed))
        out[key + "_steps"] = opt.step_count
        # The other rank's state on this rank: refused by rank, not loaded.
        others = [None] * WORLD
        dist.all_gather_object(others, state)
        try:
            opt.load_state_dict(others[1 - rank])
            out[key + "_other_rank"] = "loaded"
        except ValueError as e:
            out[key + "_other_rank"] = str(e)


def _dcp_state(opt) -> dict:
    """The optimizer's state in torch's format as whole tensors: a DTensor's are gathered (collective)."""
    sd = opt.torch_state_dict()
    whole = {}
    for i, st in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            whole[f"{i}.{k}"] = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
    for i, t in sd["zoe_masters"].items():
        whole[f"{i}.master"] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return whole


def _fsdp_dcp(rank, out, folder):
    """torch.distributed.checkpoint's get_state_dict / dcp.save, then set_state_dict into a new model and
    optimizer: the resumed run equals the uninterrupted one. With zoe's state saved as DTensors, the
    checkpoint also loads on another mesh (test_dcp_checkpoint_of_2_ranks_loads_on_1)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zoe.torch import OffloadOptimizer

    for offload in (False, True):
        key = f"dcp{'_offload' if offload else ''}"
        path = os.path.join(folder, key)
        straight = _fsdp_mlp(offload)
        _train(straight, OffloadOptimizer(straight.parameters(), **HYPER, max_grad_norm=MAX_NORM), rank)
        first = _fsdp_mlp(offload)
        opt = OffloadOptimizer(first.parameters(), **HYPER, max_grad_norm=MAX_NORM)
        _train(first, opt, rank, steps=5)
        model_sd, optim_sd = get_state_dict(first, opt)
        out[key + "_state_bytes"] = sum(
            t.to_local().numel() * t.to_local().element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
            for st in optim_sd["state"].values() for t in st.values())
        out[key + "_local_numel"] = sum(p.to_local().numel() for p in first.parameters())
        out[key + "_state_devices"] = sorted({(t.to_local() if hasattr(t, "to_local") else t).device.type
                                              for st in optim_sd["state"].values() for t in st.values()})
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        out[key + "_saved_state"] = _dcp_state(opt)
        out[key + "_saved_at"] = opt.step_count

        resumed = _fsdp_mlp(offload)
        with torch.no_grad():  # weights unlike the saved ones: set_state_dict must bring them
            for p in resumed.parameters():
                p.to_local().add_(1.0)
        opt = OffloadOptimizer(resumed.parameters(), **HYPER, max_grad_norm=MAX_NORM)
        model_sd, optim_sd = get_state_dict(resumed, opt)
        out[key + "_fresh_steps"] = opt.step_count  # get_state_dict did not step the new optimizer
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        out[key + "_loaded_equal"] = all(torch.equal(a, b) for a, b in zip(
            _dcp_state(opt).values(), out[key + "_saved_state"].values()))
        _train(resumed, opt, rank, steps=5, first=5)
        out[key] = _diff(_local(straight), _local(resumed))
        out[key + "_steps"] = opt.step_count
    out["dcp_folder"] = folder


def _dcp_one_rank_main(rank, init_file, folder, out_file):
    """One process, a one-rank mesh: loads the 2-rank FSDP2 run's DCP checkpoint (its shards joined)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from zoe.torch import OffloadOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    out = {}
    try:
        model = _fsdp_mlp(False, mesh=init_device_mesh("cpu", (1,)))
        opt = OffloadOptimizer(model.parameters(), **HYPER, max_grad_norm=MAX_NORM)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        out["state"] = _dcp_state(opt)
        out["steps"] = opt.step_count
        _train(model, opt, 0, steps=2, first=5)  # and it trains on
        out["steps_after"] = opt.step_count
    finally:
        torch.save(out, out_file)
        dist.destroy_process_group()


def _fsdp_schedules(rank, out):
    from zoe.torch import OffloadOptimizer

    runs = {}
    for schedule in ("sync", "overlap", "delayed"):
        model = _fsdp_mlp(False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt = OffloadOptimizer(model.parameters(), **HYPER, schedule=schedule)
        _train(model, opt, rank, clip="torch")
        runs[schedule] = _local(model)
        out[f"schedule_{schedule}_warnings"] = [str(w.message) for w in seen]
    out["overlap_vs_sync"] = _diff(runs["sync"], runs["overlap"])
    out["delayed_vs_sync"] = _diff(runs["sync"], runs["delayed"])


def _error(fn) -> str:
    """What fn raised, as the tests match it."""
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 — the message is what the tests check
        return f"{type(e).__name__}: {e}"


def _fsdp_errors(rank, out):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from zoe import InvalidArgumentError
    from zoe.torch import OffloadOptimizer

    model = _fsdp_mlp(False)
    out["err_mixed_plain"] = _error(lambda: OffloadOptimizer(
        list(model.parameters()) + [torch.nn.Parameter(torch.zeros(3))], **HYPER))
    out["err_process_group"] = _error(lambda: OffloadOptimizer(
        model.parameters(), **HYPER, process_group=dist.group.WORLD))
    # The same ranks in another order: another mesh, another group.
    reversed_mesh = DeviceMesh("cpu", torch.tensor([1, 0]))
    other = _fsdp_mlp(False, reversed_mesh)
    out["err_two_meshes"] = _error(lambda: OffloadOptimizer(
        list(model.parameters()) + list(other.parameters()), **HYPER))
    mesh = init_device_mesh("cpu", (WORLD,))
    w = torch.randn(4, 4)
    sharded = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
    out["err_mixed_placements"] = _error(lambda: OffloadOptimizer([sharded, replicated], **HYPER))
    partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
    out["err_partial"] = _error(lambda: OffloadOptimizer([partial], **HYPER))

    # A gradient replaced by a plain tensor.
    model = _fsdp_mlp(False)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    p0 = next(model.parameters())

    def plain_grad():
        p0.grad = None
        p0.grad = torch.zeros(p0.shape)  # a plain tensor: autograd checks shapes only
        opt.step()
    out["err_plain_grad"] = _error(plain_grad)

    # The model's shards replaced after construction: a conversion re-allocates them.
    model = _fsdp_mlp(False)
    opt = OffloadOptimizer(model.parameters(), **HYPER)

    def moved():
        model.double().float()
        _train(model, opt, rank, steps=1)
    out["err_storage_replaced"] = _error(moved)

    # NaN on one rank only: both refuse, and nothing changes on either.
    model = _fsdp_mlp(False)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    before = _local(model)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    if rank == 0:
        with torch.no_grad():
            next(model.parameters()).grad.to_local()[0, 0] = math.nan
    try:
        opt.step()
        out["nan_refused"] = "stepped"
    except InvalidArgumentError as e:
        out["nan_refused"] = str(e)
    out["nan_unchanged"] = _diff(before, _local(model)) == 0.0 and opt.step_count == 0
    opt.zero_grad()
    _train(model, opt, rank, steps=1)  # and the next step goes on
    out["nan_then_steps"] = opt.step_count


def _fsdp_fp16_overflow(rank, out):
    """An fp16 overflow on rank 0 only: both skip, and their loss scalers stay equal."""
    from zoe.torch import OffloadOptimizer

    model = _fsdp_mlp(False, dtype=torch.float16)
    opt = OffloadOptimizer(model.parameters(), **HYPER, hysteresis=1)
    out["fp16"] = []
    for i, (x, y) in enumerate(batches(3)):
        opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        if i == 1 and rank == 0:
            with torch.no_grad():
                next(model.parameters()).grad.to_local()[0, 0] = math.inf
        first = opt._buckets[0].grads[0].item()
        opt.step()
        out["fp16"].append((opt.last_step_skipped, opt.loss_scale, opt.step_count,
                            opt._buckets[0].grads[0].item() == first or math.isinf(first)))
        opt.zero_grad(set_to_none=False)  # FSDP2 accumulates into zoe's buffers, read above


def _ddp(rank, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zoe.torch import OffloadOptimizer

    ref = DDP(make_mlp(seed=rank))  # DDP starts every rank from rank 0's weights
    _train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), rank, "torch")
    all_reduce = dist.all_reduce
    for reduce_grads in (False, True):
        # What zoe all-reduces (DDP's own reduction is in C++, not seen here): statistics, or gradients too.
        sizes = []

        def counted(t, *args, **kwargs):
            sizes.append(t.numel())
            return all_reduce(t, *args, **kwargs)
        mine = DDP(make_mlp(seed=rank))
        dist.all_reduce = counted
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                opt = OffloadOptimizer(mine.parameters(), **HYPER, reduce_grads=reduce_grads)
                _train(mine, opt, rank, "torch")
        finally:
            dist.all_reduce = all_reduce
        out[f"ddp_reduce_grads_{reduce_grads}"] = _diff(_local(ref), _local(mine))
        out[f"ddp_reduce_grads_{reduce_grads}_warnings"] = [str(w.message) for w in seen]
        out[f"ddp_reduce_grads_{reduce_grads}_largest_all_reduce"] = max(sizes)
    # reduce_grads=False promises averaged gradients; without DDP they are not.
    model = make_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER, reduce_grads=False)
    out["err_not_averaged"] = _error(lambda: _train(model, opt, rank, steps=1))


def _rank_main(rank, init_file, out_dir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    try:
        for case in (_fsdp_parity, _fsdp_none_grads, _fsdp_edits, _fsdp_llama, _fsdp_hsdp, _fsdp_state_dict, _fsdp_schedules, _fsdp_errors,
                     _fsdp_fp16_overflow, _ddp):
            case(rank, out)
        _fsdp_dcp(rank, out, out_dir)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, tmp_path_factory.mktemp("fsdp2"), WORLD)


# ---- FSDP2 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("offload", [False, True], ids=["shards_on_device", "cpu_offload_policy"])
@pytest.mark.parametrize("clip", ["noclip", "torch", "zoe", "max_grad_norm"])
def test_fsdp2_equals_fsdp2_with_torch_adamw(ranks, offload, clip):
    key = f"fsdp2{'_offload' if offload else ''}_{clip}"
    diff = worst(ranks, key)
    print(f"{key}: max weight difference against FSDP2 + torch.optim.AdamW after {STEPS} steps {diff:.2e}")
    assert diff <= TORCH_TOL
    if clip != "noclip":
        # The clipped runs must have clipped: far from the unclipped one.
        assert worst(ranks, key + "_clip_effect") > CLIP_EFFECT
    if clip == "zoe":
        rel = worst(ranks, key + "_norm_rel")
        print(f"{key}: opt.clip_grad_norm_ against FSDP2's clip_grad_norm_, worst relative difference {rel:.2e}")
        assert rel <= NORM_REL_TOL
    assert all(r[f"fsdp2{'_offload' if offload else ''}_in_place"] for r in ranks)


def test_fsdp2_a_gradient_none_on_every_rank_leaves_its_shards_as_torch_does(ranks):
    diff = worst(ranks, "fsdp2_none_grads")
    print(f"fsdp2, layer 0's gradient None for 3 of 6 steps: max weight difference against torch.optim.AdamW {diff:.2e}")
    assert diff <= TORCH_TOL
    assert all(r["fsdp2_none_grads_held"] for r in ranks)


@pytest.mark.parametrize("offload", [False, True], ids=["shards_on_device", "cpu_offload_policy"])
@pytest.mark.parametrize("edit", ["load_state_dict", "init", "copy_"])
def test_fsdp2_an_edit_of_the_sharded_weights_is_taken_not_reverted(ranks, offload, edit):
    diff = worst(ranks, f"fsdp2{'_offload' if offload else ''}_edit_{edit}")
    print(f"fsdp2 bf16, {edit} after 2 steps, one step at lr 1e-6: max distance from the edited weights {diff:.2e}")
    assert diff < 1e-2


def test_fsdp2_tiny_llama_uneven_shards(ranks):
    diff = worst(ranks, "llama")
    print(f"tiny Llama, FSDP2 per decoder layer, torch clipping: max weight difference {diff:.2e}")
    assert diff <= TORCH_TOL


@pytest.mark.parametrize("shape", ["(2, 1)", "(1, 2)"])
def test_hsdp_norm_sums_over_the_shard_dimension_only(ranks, shape):
    diff, rel = worst(ranks, f"hsdp{shape}"), worst(ranks, f"hsdp{shape}_norm_rel")
    print(f"HSDP mesh {shape}: max weight difference {diff:.2e}, norm relative difference {rel:.2e}")
    assert diff <= TORCH_TOL and rel <= NORM_REL_TOL


@pytest.mark.parametrize("offload", [False, True], ids=["shards_on_device", "cpu_offload_policy"])
def test_fsdp2_state_dict_per_rank_resumes_exactly(ranks, offload):
    key = f"state_dict{'_offload' if offload else ''}"
    diff = worst(ranks, key)
    print(f"{key}: 5 steps, save, load into a new model and optimizer, 5 steps against 10 steps: {diff:.2e}")
    assert diff == 0.0
    assert all(r[key + "_steps"] == STEPS for r in ranks)
    for r, rank in zip(ranks, range(WORLD)):
        assert f"partition of rank {1 - rank} of 2" in r[key + "_other_rank"]


@pytest.mark.parametrize("offload", [False, True], ids=["shards_on_device", "cpu_offload_policy"])
def test_fsdp2_torch_distributed_checkpoint_resumes_exactly(ranks, offload):
    key = f"dcp{'_offload' if offload else ''}"
    diff = worst(ranks, key)
    print(f"{key}: 5 steps, get_state_dict + dcp.save, dcp.load + set_state_dict into a new model and optimizer, "
          f"5 steps, against 10 steps: max weight difference {diff:.2e}")
    assert diff == 0.0
    model = make_mlp()
    numel, count = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    for r in ranks:
        assert r[key + "_fresh_steps"] == 0 and r[key + "_saved_at"] == 5 and r[key + "_steps"] == STEPS
        assert r[key + "_loaded_equal"], "the loaded state differs from the saved one"
        # Master, exp_avg, exp_avg_sq of this rank's shards only, fp32, in host memory, and a scalar fp32
        # step per parameter: no copy of the other rank's state, nothing on an accelerator.
        print(f"rank state_dict tensors: {r[key + '_state_bytes']} bytes, {r[key + '_local_numel']} of the "
              f"{numel} elements on this rank, devices {r[key + '_state_devices']}")
        assert r[key + "_local_numel"] < numel
        assert r[key + "_state_bytes"] == 12 * r[key + "_local_numel"] + 4 * count
        assert r[key + "_state_devices"] == ["cpu"]


def test_dcp_checkpoint_of_2_ranks_loads_on_1(ranks, tmp_path):
    """The 2-rank run's checkpoint (its state saved as DTensor shards) on a one-rank mesh: the whole state
    equals the 2-rank run's at the save, bitwise."""
    out_file = tmp_path / "one.pt"
    mp.spawn(_dcp_one_rank_main, args=(str(tmp_path / "init"), ranks[0]["dcp_folder"], str(out_file)), nprocs=1,
             join=True)
    one = torch.load(out_file, weights_only=False)
    saved = ranks[0]["dcp_saved_state"]
    assert one["steps"] == 5 and one["steps_after"] == 7
    assert saved.keys() == one["state"].keys()
    worst = max((saved[k] - one["state"][k]).abs().max().item() for k in saved)
    print(f"2 ranks -> 1 through torch.distributed.checkpoint: {len(saved)} state tensors, max difference {worst}")
    assert worst == 0.0


@pytest.mark.parametrize("schedule", ["overlap", "delayed"])
def test_fsdp2_schedules_run_as_sync_with_one_warning(ranks, schedule):
    for r in ranks:
        assert r[f"{schedule}_vs_sync"] == 0.0
        assert r["schedule_sync_warnings"] == []
        told = [w for w in r[f"schedule_{schedule}_warnings"] if "runs as 'sync'" in w]
        assert len(told) == 1 and "clip_grad_norm_" in told[0]


@pytest.mark.parametrize("case, message", [
    ("err_mixed_plain", "ValueError: .*DTensors .*plain tensors"),
    ("err_process_group", "ValueError: .*leave process_group=None"),
    ("err_two_meshes", "ValueError: .*one optimizer serves one mesh"),
    ("err_mixed_placements", "ValueError: .*placements"),
    ("err_partial", "ValueError: .*Partial"),
    ("err_plain_grad", "RuntimeError: .*plain Tensor"),
    ("err_storage_replaced", "RuntimeError: .*no longer the storage zoe was given"),
    ("err_not_averaged", "RuntimeError: .*reduce_grads=False.*differ across ranks"),
])
def test_errors(ranks, case, message):
    import re

    print(f"{case}: {ranks[0][case]}")
    for r in ranks:
        assert re.match(message, r[case], re.S), r[case]


def test_fsdp2_nan_on_one_rank_is_refused_by_both(ranks):
    print(f"rank 1 (finite shards): {ranks[1]['nan_refused']}")
    for r in ranks:
        assert "step refused" in r["nan_refused"] and "1 of the ranks" in r["nan_refused"], r["nan_refused"]
        assert r["nan_unchanged"]
        assert r["nan_then_steps"] == 1


def test_fsdp2_fp16_overflow_on_one_rank_is_skipped_by_both(ranks):
    print(f"(skipped, loss scale, steps, gradient as it was) per step, rank 1: {ranks[1]['fp16']}")
    assert ranks[0]["fp16"] == ranks[1]["fp16"]
    skipped, scales, steps, kept = zip(*ranks[1]["fp16"])
    assert skipped == (False, True, False) and steps == (1, 1, 2)
    assert scales[1] == scales[0] / 2  # hysteresis=1: the first overflow halves it
    assert all(kept)  # the element shown to rank 1's engine as an overflow is put back


# ---- DistributedDataParallel ----------------------------------------------------------------------------

@pytest.mark.parametrize("reduce_grads", [False, True])
def test_ddp_equals_ddp_with_torch_adamw(ranks, reduce_grads):
    diff = worst(ranks, f"ddp_reduce_grads_{reduce_grads}")
    print(f"DDP, reduce_grads={reduce_grads}, torch clipping: max weight difference against DDP + torch.optim.AdamW "
          f"{diff:.2e}")
    assert diff <= TORCH_TOL
    told = [w for r in ranks for w in r[f"ddp_reduce_grads_{reduce_grads}_warnings"] if "reduce_grads=False" in w]
    # With True, zoe would average DDP's averages again: right, but told once per rank how to skip it.
    assert len(told) == (WORLD if reduce_grads else 0)
    largest = worst(ranks, f"ddp_reduce_grads_{reduce_grads}_largest_all_reduce")
    numel = sum(p.numel() for p in make_mlp().parameters())
    # False: no gradient goes through zoe's all-reduce, only a few statistics.
    assert largest >= numel if reduce_grads else largest <= 4
