"""zoe's optimizer state in torch.optim's format, the interchange between zoe and torch and between zoe runs
of different data-parallel sizes.

A torch-format state_dict is ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``
with full-size tensors per parameter (``torch.optim.AdamW`` loads it). zoe adds ``"zoe_masters"``: ``{i: fp32
master weights}``, which torch ignores and zoe loads (without them the masters are the model's weights, as
for a run that comes from torch). W ranks' zoe state_dicts are joined into one with ``consolidate``; any
number of ranks then load it, each taking its own partition. The fp32 loss scale of fp16 runs is not
carried: it starts again from ``initial_scale``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from . import _zoe

STATE_FORMAT = "zoe.torch.OffloadOptimizer/1"


def rank_file(folder: str, rank: int, world: int) -> str:
    """Where ``OffloadOptimizer.save_to(folder)`` puts a rank's state."""
    return os.path.join(folder, "zoe", f"rank{rank}-of-{world}.zoe")


def _callers(depth: int = 10) -> list[tuple[str, str]]:
    """(module, function) of the frames above the caller, nearest first."""
    out, frame = [], sys._getframe(1)
    while frame is not None and len(out) < depth:
        out.append((frame.f_globals.get("__name__", ""), frame.f_code.co_name))
        frame = frame.f_back
    return out


def called_by_accelerate_prepare() -> bool:
    """state_dict() called by Accelerate's AcceleratedOptimizer (prepare()), which moves it to the device and
    loads it straight back: a round trip that needs no copy of the state (and must not put it on a GPU)."""
    return any(module == "accelerate.optimizer" and name == "__init__" for module, name in _callers())


def refuse_distributed_checkpoint() -> None:
    """torch.distributed.checkpoint's get/set_optimizer_state_dict keep only torch's per-parameter "state"
    and "param_groups" of an optimizer's state_dict: zoe's state would be dropped on save and, on load, zero
    moments taken for a fresh start. Refused, both ways, rather than losing the state silently."""
    if any(module.startswith("torch.distributed.checkpoint") for module, _ in _callers(16)):
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: torch.distributed.checkpoint (get_/set_optimizer_state_dict) cannot carry "
            "zoe's optimizer state yet — it keeps only torch's per-parameter state. Save and load each rank's "
            "opt.state_dict() with torch.save / torch.load (or opt.save_to(folder) on every rank) beside the DCP "
            "checkpoint of the model.")


# The trainers' save paths that call state_dict() on rank 0 only (transformers' Trainer; Accelerate's
# save_state, which writes the main process's state_dict).
_RANK0_SAVERS = {("transformers.trainer", "_save_optimizer_and_scheduler"),
                 ("accelerate.checkpointing", "save_accelerator_state")}


def refuse_rank0_only_save(world: int) -> None:
    """A partitioned optimizer's state_dict() holds one rank's partition: saved from rank 0 alone, the others'
    would be lost. Refused at save time, naming the fix."""
    if world > 1 and any(caller in _RANK0_SAVERS for caller in _callers()):
        raise RuntimeError(
            f"zoe.torch.OffloadOptimizer: the trainer saves state_dict() from rank 0 only, but each of the {world} "
            "ranks holds its own partition of the optimizer state, so the checkpoint would lack the others'. With "
            "transformers' Trainer add the callback: Trainer(..., callbacks=[zoe.hf.ZoeCheckpointCallback(opt)]); "
            "with Accelerate: zoe.hf.register_accelerator_hooks(accelerator, opt). Each rank then saves its own "
            "file beside the checkpoint.")


def refuse_trainer_without_callback(opt) -> None:
    """On every rank at the first step of a partitioned optimizer under transformers' Trainer that will save
    checkpoints: without zoe.hf.ZoeCheckpointCallback only rank 0's partition would be saved. Refused here,
    where every rank can stop together, rather than at the first save, where rank 0 alone would."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "transformers.trainer" and frame.f_code.co_name == "_inner_training_loop":
            break
        frame = frame.f_back
    if frame is None:
        return
    trainer = frame.f_locals.get("self")
    strategy = str(getattr(getattr(trainer, "args", None), "save_strategy", "no"))
    if strategy.lower().endswith("no"):
        return
    from .hf import ZoeCheckpointCallback

    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    if any(isinstance(c, ZoeCheckpointCallback) and c.optimizer is opt for c in callbacks):
        return
    raise RuntimeError(
        f"zoe.torch.OffloadOptimizer: transformers' Trainer saves the optimizer's state_dict() from rank 0 only, "
        f"but each of the {opt._world} ranks holds its own partition of the optimizer state, so its checkpoints "
        "would lack the others'. Add the callback: Trainer(..., callbacks=[zoe.hf.ZoeCheckpointCallback(opt)]); "
        "each rank then saves its own file beside the checkpoint.")


def pieces(opt) -> list[tuple]:
    """The engine's parameters in its order (OffloadOptimizer._make_engine's): (slot, first element within the
    parameter, elements) of each slot's part of this rank's shard of its bucket."""
    out = []
    for b in opt._buckets:
        lo, hi = opt._rank * b.shard_numel, (opt._rank + 1) * b.shard_numel
        for s in b.slots:
            a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < z:
                out.append((s, a - s.offset, z - a))
    return out


def read_torch_state(opt, sd: dict):
    """A torch-format state checked against the optimizer's parameters and brought to full fp32 tensors per
    parameter: ({index: (master, exp_avg, exp_avg_sq)}, step). Nothing changes here; a bad state raises."""
    if opt._dtensor is not None:
        raise ValueError("zoe.torch.OffloadOptimizer: a torch-format state_dict cannot be loaded into DTensor (FSDP2) "
                         "parameters yet; load each rank's own zoe state_dict")
    state = sd.get("state", {})
    masters = sd.get("zoe_masters", {})
    steps = set()
    full = {}
    for s in opt._slots:
        st = state.get(s.index, state.get(str(s.index)))
        shape = tuple(s.shape)
        if st is None:
            m = v = torch.zeros(s.numel, dtype=torch.float32)
        else:
            if "max_exp_avg_sq" in st:
                raise ValueError(f"parameter {s.index}: this state_dict comes from amsgrad=True, which zoe does not run")
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key not in st:
                    raise ValueError(f"parameter {s.index}: its state has no '{key}' (an Adam/AdamW state_dict has "
                                     "step, exp_avg and exp_avg_sq)")
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[key].shape) != shape:
                    raise ValueError(f"parameter {s.index}: {key} has shape {tuple(st[key].shape)}, the parameter "
                                     f"{shape}: this state_dict is for a different model")
            m = st["exp_avg"].detach().to("cpu", torch.float32).reshape(-1)
            v = st["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(-1)
            steps.add(int(float(st["step"])))
        master = masters.get(s.index, masters.get(str(s.index)))
        if master is None:
            master = s.param.detach()
        elif tuple(master.shape) != shape:
            raise ValueError(f"parameter {s.index}: its master has shape {tuple(master.shape)}, the parameter {shape}")
        full[s.index] = (master.to("cpu", torch.float32).reshape(-1), m, v)
    if len(steps) > 1:
        raise ValueError(f"the parameters were stepped different numbers of times ({sorted(steps)}); zoe keeps one "
                         "step count for all")
    for i, (master, _, v) in full.items():
        if not bool(torch.isfinite(master).all()) or not bool((v >= 0).all()):
            raise ValueError(f"parameter {i}: its master weights are not finite or its exp_avg_sq has negative values")
    return full, (steps.pop() if steps else 0)


def write_torch_state(opt, full: dict, step: int) -> None:
    """The state read_torch_state made, into this rank's pieces; the weights then agree on every rank."""
    for s, begin, n in pieces(opt):
        master, m, v = (t[begin:begin + n].contiguous() for t in full[s.index])
        opt._engine.write_state(s.engine_ids[0], master, m, v)
    opt._engine.set_step_count(step)
    if opt._world > 1:
        _gather_weights(opt)


def _gather_weights(opt) -> None:
    """Every rank's shard of the weights into every rank's buckets (write_state set this rank's only)."""
    comm = opt._dp.collectives
    for b in opt._buckets:
        shard = b.weights[opt._rank * b.shard_numel:(opt._rank + 1) * b.shard_numel].clone()
        if comm._gloo:
            dist.all_gather(list(b.weights.chunk(opt._world)), shard, group=comm.group)
        else:
            dist.all_gather_into_tensor(b.weights, shard, group=comm.group)


def torch_state(opt) -> dict:
    """Full-size fp32 tensors per parameter: moments and step, and the masters as ``zoe_masters``."""
    if opt._dtensor is not None:
        raise ValueError("zoe.torch.OffloadOptimizer: a torch-format state_dict of DTensor (FSDP2) parameters is "
                         "not supported yet; save each rank's own zoe state_dict")
    opt._engine.wait()
    step = int(opt._engine.step_count)
    flat = {b.dtype: torch.zeros(3, b.shard_numel, dtype=torch.float32) for b in opt._buckets}
    owner = {id(s): b for b in opt._buckets for s in b.slots}
    for s, begin, n in pieces(opt):
        b = owner[id(s)]
        at = s.offset + begin - opt._rank * b.shard_numel
        bufs = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
        opt._engine.read_state(s.engine_ids[0], *bufs)
        for k in range(3):
            flat[b.dtype][k, at:at + n] = bufs[k]
    state, masters = {}, {}
    for b in opt._buckets:
        mine = flat[b.dtype]
        if opt._world > 1:
            everyone = [torch.empty_like(mine) for _ in range(opt._world)]
            dist.all_gather(everyone, mine, group=opt._dp.collectives.group)
            whole = torch.cat(everyone, dim=1)
        else:
            whole = mine
        for s in b.slots:
            p, m, v = (whole[k, s.offset:s.offset + s.numel].clone().view(s.shape) for k in range(3))
            state[s.index] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
            masters[s.index] = p
    return {"state": state, "param_groups": _param_groups(opt), "zoe_masters": masters}


def _param_groups(opt) -> list[dict]:
    """torch.optim.AdamW's param_groups: zoe's hyper-parameters, torch's flags at their defaults."""
    out, index = [], 0
    for g in opt.param_groups:
        d = {k: v for k, v in g.items() if k not in ("params", "adamw")}
        d.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=bool(g.get("adamw", True)))
        d["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        out.append(d)
    return out


def consolidate(state_dicts) -> dict:
    """W ranks' zoe state_dicts (each rank's ``opt.state_dict()``) joined into one torch-format state_dict
    with ``zoe_masters``, loadable on any number of ranks."""
    sds = list(state_dicts)
    if not sds:
        raise ValueError("consolidate: no state_dicts given")
    metas = []
    for k, sd in enumerate(sds):
        meta = sd.get("zoe") if isinstance(sd, dict) else None
        if meta is None or meta.get("format") != STATE_FORMAT:
            raise ValueError(f"state_dict {k} was not written by zoe.torch.OffloadOptimizer.state_dict()")
        if "pieces" not in meta:
            raise ValueError(f"state_dict {k} predates partition records (no 'pieces'); it loads only on the ranks "
                             "that wrote it")
        metas.append(meta)
    world = metas[0]["world_size"]
    if any(m["world_size"] != world for m in metas):
        raise ValueError(f"the state_dicts come from runs of different sizes: {sorted({m['world_size'] for m in metas})} ranks")
    ranks = [m["rank"] for m in metas]
    missing = sorted(set(range(world)) - set(ranks))
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    if missing or duplicated:
        raise ValueError(f"a run of {world} ranks needs each rank's state_dict once: "
                         + (f"missing rank(s) {missing}" if missing else "")
                         + ("; " if missing and duplicated else "")
                         + (f"rank(s) {duplicated} given twice" if duplicated else ""))
    layout = metas[0]["layout"]
    if any(m["layout"] != layout for m in metas):
        raise ValueError("the state_dicts are of different models (their parameter layouts differ)")
    full, filled, steps = {}, {}, set()
    for meta in metas:
        try:
            manifest, blobs = _read_blob(meta["checkpoint"])
        except _zoe.ZoeError as e:
            raise type(e)(f"rank {meta['rank']}'s state_dict: its zoe checkpoint is damaged: {e}") from e
        steps.add(manifest["step"])
        arrays = [blobs[name].view("<f4") for name in ("master", "exp_avg", "exp_avg_sq")]
        at = 0
        for index, begin, n in meta["pieces"]:
            numel = int(torch.Size(layout[index][0]).numel())
            if index not in full:
                full[index] = torch.zeros(3, numel, dtype=torch.float32)
                filled[index] = 0
            for k in range(3):
                full[index][k, begin:begin + n] = torch.from_numpy(arrays[k][at:at + n].copy())
            filled[index] += n
            at += n
        if at != arrays[0].size:
            raise ValueError(f"rank {meta['rank']}'s checkpoint holds {arrays[0].size} elements, its pieces {at}")
    for index, (shape, _, trainable, *rest) in enumerate(layout):
        if trainable and filled.get(index, 0) != int(torch.Size(shape).numel()):
            raise ValueError(f"parameter {index}: the ranks' partitions hold {filled.get(index, 0)} of its "
                             f"{int(torch.Size(shape).numel())} elements")
    if len(steps) != 1:
        raise ValueError(f"the ranks' states are at different steps: {sorted(steps)}")
    step = steps.pop()
    state = {i: {"step": torch.tensor(float(step)), "exp_avg": t[1].view(layout[i][0]),
                 "exp_avg_sq": t[2].view(layout[i][0])} for i, t in full.items()}
    masters = {i: t[0].view(layout[i][0]) for i, t in full.items()}
    return {"state": state, "param_groups": sds[0]["param_groups"], "zoe_masters": masters}


@contextlib.contextmanager
def blob_file(blob: torch.Tensor):
    """A state_dict's engine checkpoint (uint8 tensor) as a temporary file, for the engine's readers."""
    with tempfile.TemporaryDirectory(prefix="zoe-state-") as tmp:
        path = os.path.join(tmp, "optimizer.zoe")
        with open(path, "wb") as f:
            f.write(memoryview(blob.cpu().numpy()))  # no copy of the blob
        yield path


def _read_blob(blob: torch.Tensor):
    with blob_file(blob) as path:
        manifest, blobs = _zoe.read_checkpoint(path)
    return json.loads(manifest), blobs


def export_fp32(source, out_dir, names=None, moments: bool = False) -> list[str]:
    """Writes the fp32 master weights by parameter name as ``model.safetensors`` in ``out_dir`` (``moments``:
    ``exp_avg.safetensors`` and ``exp_avg_sq.safetensors`` too). ``source``: an OffloadOptimizer, the list of
    every rank's ``state_dict()``, or a torch-format state_dict with ``zoe_masters``. ``names``: the
    parameters' names in optimizer order (a list, or an ``nn.Module`` whose ``named_parameters()`` the
    optimizer was built from); by default the param groups' ``param_names`` (an optimizer built from
    ``model.named_parameters()``). Returns the files written."""
    from safetensors.torch import save_file

    from .torch import OffloadOptimizer

    if isinstance(source, OffloadOptimizer):
        sd = torch_state(source)
        groups = source.param_groups
    elif isinstance(source, (list, tuple)):
        sd = consolidate(source)
        groups = sd["param_groups"]
    else:
        sd = source
        groups = sd["param_groups"]
    if "zoe_masters" not in sd:
        raise ValueError("this state_dict has no zoe_masters: export reads the fp32 masters zoe keeps")
    if isinstance(names, torch.nn.Module):
        names = [n for n, _ in names.named_parameters()]
    if names is None:
        names = [n for g in groups for n in g.get("param_names", [])]
        if not names:
            raise ValueError("no parameter names: build the optimizer from model.named_parameters(), or pass names=")
    names = list(names)
    count = sum(len(g["params"]) for g in groups)
    if len(names) != count:
        raise ValueError(f"{len(names)} names for {count} parameters")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    kinds = [("model.safetensors", lambda i: sd["zoe_masters"].get(i))]
    if moments:
        kinds += [("exp_avg.safetensors", lambda i: sd["state"].get(i, {}).get("exp_avg")),
                  ("exp_avg_sq.safetensors", lambda i: sd["state"].get(i, {}).get("exp_avg_sq"))]
    for filename, get in kinds:
        tensors = {}
        for i, name in enumerate(names):
            t = get(i)
            if t is not None:
                tensors[name] = t.detach().to("cpu", torch.float32).contiguous()
        path = os.path.join(out_dir, filename)
        save_file(tensors, path, metadata={"format": "pt", "written_by": "zoe"})
        files.append(path)
    return files
