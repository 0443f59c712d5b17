"""OffloadOptimizer's keyword options: their checks, and the engine's options (``_zoe.EngineOptions``) made
from them. The keywords reach the engine only through here."""
from __future__ import annotations

import math
import os

import torch

from . import _checks, _host_memory, _zoe

# OffloadOptimizer's integer keywords that reach the engine's options, with the ranges the DeepSpeed config
# reader allows for the same settings (docs/config.md).
_INT_KEYWORDS = {
    "growth_interval": (1, _checks.INT_MAX), "hysteresis": (1, _checks.INT_MAX),
    "delayed_warmup_steps": (0, _checks.INT_MAX), "threads": (0, 1 << 16), "tile": (1, 1 << 40),
    "buffer_count": (1, 1024), "block_size": (4096, 1 << 30), "queue_depth": (1, 4096),
}


def check_keywords(o: dict, gradient_accumulation_steps, reduce_grads) -> None:
    """The keywords of OffloadOptimizer that are not torch's AdamW's (``o``: the options the optimizer keeps,
    as ``OffloadOptimizer._options``); a bad one raises before anything is made."""
    tier, schedule, max_grad_norm = o["tier"], o["schedule"], o["max_grad_norm"]
    if tier not in ("ram", "nvme"):
        raise ValueError(f"tier = {tier!r} is unknown: use 'ram' or 'nvme'")
    if tier == "nvme" and not o["nvme_path"]:
        raise ValueError("tier='nvme' needs nvme_path: a folder (or a list of folders) for the swap files")
    if o["durability"] not in ("step", "checkpoint"):
        raise ValueError(f"durability = {o['durability']!r} is unknown: use 'step' (each step durable in the "
                         "background) or 'checkpoint' (durable at save only)")
    if not isinstance(o["keep_resident"], bool):
        raise ValueError(f"keep_resident = {o['keep_resident']!r} is invalid: True or False")
    if schedule not in ("sync", "overlap", "delayed"):
        raise ValueError(f"schedule = {schedule!r} is unknown: use 'sync', 'overlap' or 'delayed'")
    if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1):
        raise ValueError(f"gradient_accumulation_steps = {gradient_accumulation_steps!r} is invalid: an int >= 1, "
                         "or None to count the backward passes before each step")
    if o["state_dtype"] not in ("fp32", "bf16", "int8"):
        raise ValueError(f"state_dtype = {o['state_dtype']!r} is unknown: use 'fp32', 'bf16' or 'int8'")
    if not isinstance(reduce_grads, bool):
        raise ValueError(f"reduce_grads = {reduce_grads!r} is invalid: True (zoe averages the gradients across "
                         "ranks) or False (they are averaged already, e.g. by DistributedDataParallel)")
    if not isinstance(o["spill_grads"], bool):
        raise ValueError(f"spill_grads = {o['spill_grads']!r} is invalid: True or False")
    if o["spill_grads"] and (tier != "nvme" or schedule != "sync" or (gradient_accumulation_steps or 1) > 1):
        raise ValueError("spill_grads=True needs tier='nvme', schedule='sync' and no declared micro-batches "
                         f"(here: tier {tier!r}, schedule {schedule!r}, gradient_accumulation_steps "
                         f"{gradient_accumulation_steps!r}): the gradients are read back by tier nvme's streamed step")
    if max_grad_norm is not None and not (max_grad_norm >= 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm = {max_grad_norm} is invalid: need >= 0 (or None: no clipping)")
    _check_engine_keywords(o)


def _check_engine_keywords(kw: dict) -> None:
    """The keywords checked here rather than by nanobind, whose TypeError would name neither (_checks)."""
    where = "zoe.torch.OffloadOptimizer"
    for name, (lo, hi) in _INT_KEYWORDS.items():
        if name == "tile" and kw[name] is None:
            continue  # the device's default (engine_options)
        _checks.integer(where, name, kw[name], lo, hi)
    _checks.positive_finite(where, "initial_scale", kw["initial_scale"])
    _checks.positive_finite(where, "min_loss_scale", kw["min_loss_scale"])
    ls = kw["loss_scale"]
    # None, False, 0 and "dynamic" choose the mode; any other number is a fixed scale.
    if not (ls is None or isinstance(ls, (bool, str)) or ls == 0):
        _checks.positive_finite(where, "loss_scale", ls)
    _checks.text(where, "isa", kw["isa"])
    if kw["nvme_path"] is not None:
        _checks.paths(where, "nvme_path", kw["nvme_path"])


def _swap_folder(path: str) -> None:
    """An nvme_path folder, made where it is missing; anything in the way gets zoe's error naming it."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise _zoe.InvalidArgumentError(f"nvme_path {path!r} is not a folder (a file is there): nvme_path names "
                                        "folders, in which zoe keeps its swap files")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise _zoe.ZoeError(f"cannot create the swap folder {path!r} (nvme_path): {e.strerror}") from e


def _loss_scale_options(o: dict, dtypes) -> dict:
    ls = o["loss_scale"]
    if ls is None:
        ls = "dynamic" if any(dt == torch.float16 for dt in dtypes) else False
    if ls is False or ls == 0 and not isinstance(ls, str):
        return dict(loss_scale=False)
    if ls == "dynamic":
        return dict(loss_scale=True, dynamic_loss_scale=True, initial_scale=float(o["initial_scale"]))
    if isinstance(ls, (int, float)) and ls > 0:
        return dict(loss_scale=True, dynamic_loss_scale=False, static_loss_scale=float(ls))
    raise ValueError(f"loss_scale = {ls!r} is invalid: None, False, 'dynamic' or a positive number")


# OffloadOptimizer's keywords that are engine options under another name (torch's or DeepSpeed's), and the
# engine options whose value engine_options() derives from the keywords rather than copies.
_RENAMED = {"durability": "nvme_durability", "keep_resident": "nvme_keep_resident", "min_loss_scale": "min_scale"}
_COMPUTED = {"max_grad_norm", "refuse_non_finite", "loss_scale", "initial_scale", "gradient_accumulation_steps",
             "tile"}


# tile=None: pieces of 4M elements on a CUDA device with tier ram, where each piece is a copy and its
# gradient statistics on the copy stream (an H100: gradients down at 0.67 of plain copies' speed in 1M pieces,
# 0.87 in 4M, 0.94 in 16M, with the state's step no slower; docs/performance.md); elsewhere the engine's 1M.
CUDA_TILE = 1 << 22


def engine_options(o: dict, *, partition: tuple[int, int], accumulation_steps: int, reduce: bool,
                   sharded: bool, dtypes, cuda: bool = False) -> tuple[_zoe.EngineOptions, float, bool]:
    """The engine's options from the optimizer's (``o``), and what the optimizer keeps of them: its
    max_grad_norm (0: none) and whether the engine scales the loss. ``partition``: (world, rank) of the state
    this rank holds; ``accumulation_steps``: micro-batches the engine sums (1: none); ``reduce``: the engine
    averages the gradients across ranks; ``sharded``: FSDP2's DTensor parameters; ``dtypes``: the buckets';
    ``cuda``: the parameters are on a CUDA device."""
    opts = _zoe.EngineOptions()
    # The keywords named as the engine's options are (zoe.EngineOptions.names(), one table in C++) pass as they
    # are; the others are renamed, or computed below.
    for name in _zoe.EngineOptions.names():
        if name in o and name not in _COMPUTED:
            setattr(opts, name, o[name])
    for keyword, name in _RENAMED.items():
        setattr(opts, name, o[keyword])
    if o["tile"] is not None:
        opts.tile = o["tile"]
    elif cuda and o["tier"] == "ram":
        opts.tile = CUDA_TILE
    if o["tier"] == "nvme":
        _host_memory.map_large_allocations()  # a model larger than memory: what is freed goes back
    paths = o["nvme_path"]
    if paths is not None:
        paths = _checks.paths("zoe.torch.OffloadOptimizer", "nvme_path", paths)
        # One swap folder per rank: ranks on one machine must not share files.
        world, rank = partition
        opts.nvme_paths = [os.path.join(os.fspath(pp), f"rank{rank}") if world > 1 else os.fspath(pp)
                           for pp in paths]
        for pp in opts.nvme_paths:
            _swap_folder(pp)
    opts.gradient_accumulation_steps = accumulation_steps
    # Across ranks the engine partitions the buckets in place (they are flat and padded) and reduces the
    # gradients unless DistributedDataParallel averaged them.
    opts.partition_flat_buffers = True
    opts.partition_grads_averaged = not reduce
    # FSDP2's global norm spans the mesh: _dtensor clips, and the engine sees the clipped shards.
    max_norm = float(o["max_grad_norm"] or 0.0)
    opts.max_grad_norm = max_norm if not sharded else 0.0
    # FSDP2 keeps each shard's gradient until step(), offloaded shard or not: the engine streams it from there.
    opts.grads_stay_on_device = sharded
    opts.refuse_non_finite = bool(o["refuse_non_finite"])
    ls = _loss_scale_options(o, dtypes)
    for k, v in ls.items():
        setattr(opts, k, v)
    return opts, max_norm, ls["loss_scale"]
