"""zoe.torch — ``OffloadOptimizer``, a ``torch.optim.Optimizer`` whose fp32 master weights and Adam moments
live in zoe (pinned RAM, or NVMe) while the model keeps its own weights, in their own dtype, on its device.

How it meets torch:

* At construction the trainable parameters of each dtype are packed into one flat buffer on their device
  (``p.data`` and ``p.grad`` become views of it), so the engine reads every gradient and writes every weight
  with one address per parameter that never changes, and ``zero_grad`` is one fill. Move the model to its
  device *before* creating the optimizer.
* ``step()`` hands the hyper-parameters of each param group (an LR scheduler's ``group['lr']`` included) to
  the engine, then runs the engine's step with the GIL released; the updated weights are back in ``p.data``
  when it returns (one step later for ``schedule="delayed"``).
* Clipping: ``torch.nn.utils.clip_grad_norm_`` over all of an optimizer's parameters (``model.parameters()``,
  as Hugging Face's Trainer and Accelerate pass them) is answered by the optimizer's ``clip_grad_norm_``:
  zoe's norm, the clip fused into the step, ``p.grad`` left as it is (_route_clipping says why). Over part of
  them, it is torch's, and the edit is seen at ``step()`` as any other.
* ``schedule="overlap"`` reports each parameter to the engine from a post-accumulate-grad hook during
  backward, so its transfer and CPU Adam overlap the rest of backward. With gradient accumulation only the
  last micro-batch's backward reports (the k-th time a parameter's gradient is accumulated since the last
  step; k is ``gradient_accumulation_steps``, or the count seen before the previous step). Gradients a
  trainer changes after backward (its own ``clip_grad_norm_``, ``GradScaler.unscale_``, any in-place edit)
  are seen by torch's version counters at ``step()``, and the engine then takes them again, undoing what it
  stepped speculatively: the step is exactly ``sync``'s.
* With ``torch.distributed`` initialised, each rank owns 1/W of every flat buffer: gradients are averaged
  (reduce-scatter, or all-reduce where the backend lacks it, as gloo does), the rank steps its shard, and
  the weights are all-gathered.
* Parameters offloaded with ``offload_parameters`` live in their parameter tier; the step writes their new
  weights there. On a GPU their gradients leave the device as each one's backward ends (into zoe's fp32
  sum on the host, with declared micro-batches): all of them take turns in one window on the device, as
  large as the largest, and ``p.grad`` holds zeros after backward. Clipping therefore goes through zoe:
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` — what Hugging Face's Trainer and Accelerate
  call — is answered by the optimizer's ``clip_grad_norm_`` while such an optimizer exists; an edit of
  ``p.grad`` zoe cannot apply (GradScaler's unscaling, a copy of torch's clipping) makes ``step()`` raise,
  stepping nothing.
* DTensor parameters (torch FSDP2, ``fully_shard``) are partitioned already: each rank's engine steps its
  local shards in place, and only the gradient norm and skip decisions are agreed across the mesh
  (``_dtensor.py``).
"""
from __future__ import annotations

import collections.abc
import contextlib
import math
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _checks, _data_parallel, _dtensor, _interop, _param_offload, _scratch, _serial, _state_dict, _stream, _torch_flags, _zoe
from ._param_offload import full_shape, offload_parameters

__all__ = ["OffloadOptimizer", "offload_parameters", "full_shape"]

_ZOE_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# OffloadOptimizer's integer keywords that reach the engine's options, with the ranges the DeepSpeed config
# reader allows for the same settings (docs/config.md).
_INT_KEYWORDS = {
    "growth_interval": (1, _checks.INT_MAX), "hysteresis": (1, _checks.INT_MAX),
    "delayed_warmup_steps": (0, _checks.INT_MAX), "threads": (0, 1 << 16), "tile": (1, 1 << 40),
    "buffer_count": (1, 1024), "block_size": (4096, 1 << 30), "queue_depth": (1, 4096),
}


def _check_engine_keywords(kw: dict) -> None:
    """The keywords checked here rather than by nanobind, whose TypeError would name neither (_checks)."""
    where = "zoe.torch.OffloadOptimizer"
    for name, (lo, hi) in _INT_KEYWORDS.items():
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


# torch's own, kept before zoe routes it to its optimizers (_route_clipping).
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_optimizers_answering: "weakref.WeakSet[OffloadOptimizer]" = weakref.WeakSet()


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` while an OffloadOptimizer exists: over exactly one optimizer's
    parameters — what trainers pass, ``model.parameters()`` — it is that optimizer's ``clip_grad_norm_``,
    which computes the norm of the gradients zoe takes and clips inside the step, leaving ``p.grad`` as it
    is. Any other call is torch's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for opt in list(_optimizers_answering):
        if opt._answers_clipping(params):
            return opt.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
    return _torch_clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                  foreach=foreach)


def _route_clipping(opt) -> None:
    """Trainers clip through ``torch.nn.utils.clip_grad_norm_``, looked up at each call; Hugging Face's Trainer
    also computes the norm with it to log it, even with max_grad_norm=0. Done by torch, that is a write to
    every p.grad (a multiplication, by 1 when nothing is clipped) after backward, which costs the overlap and
    delayed schedules their overlap and, with declared micro-batches, replaces zoe's fp32 sum by p.grad's
    rounding of it; and offloaded parameters' gradients are no longer in p.grad on a GPU. So zoe answers it
    for its optimizers (one rank, not FSDP2). A trainer that bound torch's function earlier still works as
    before: zoe sees the edit at step() (or refuses it, for gradients that left the device)."""
    _optimizers_answering.add(opt)
    if torch.nn.utils.clip_grad_norm_ is _torch_clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_


def _swap_folder(path: str) -> None:
    """An nvme_path folder, made where it is missing; anything in the way gets zoe's error naming it."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise _zoe.InvalidArgumentError(f"nvme_path {path!r} is not a folder (a file is there): nvme_path names "
                                        "folders, in which zoe keeps its swap files")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise _zoe.ZoeError(f"cannot create the swap folder {path!r} (nvme_path): {e.strerror}") from e


def _cpu_device():
    """The engine's device for a model on the CPU: the CPU itself, stepped in place. Tests put the host
    stand-in (``zoe.host_device``: memory of its own and copy streams, as a GPU has) in its place to run the
    paths of a device with its own memory without one."""
    return _zoe.cpu_device()


class _Slot:
    """Where one parameter (trainable now or later) lives in its dtype's flat buffers."""

    __slots__ = ("param", "index", "group", "offset", "numel", "shape", "tier", "windowed", "bucket", "grad_view",
                 "grad_ptr", "grads_at", "own_grad", "own_version", "weight_view", "engine_ids", "accumulated",
                 "taken")

    def __init__(self, param, index, group, offset):
        self.param = param
        self.index = index  # position in param-group order, as state_dict numbers parameters
        self.group = group
        self.offset = offset
        # An offloaded parameter's weights live in its parameter tier (zoe.torch.offload_parameters): p.data
        # is a placeholder between uses, and the engine writes the updated weights into the tier.
        self.tier = getattr(param, "_zoe_param_offload", None)  # (ParamOffload, block, entry)
        self.shape = _param_offload.full_shape(param)
        self.numel = _dtensor.local_numel(param) if self.tier is None else math.prod(self.shape)
        # Its gradient leaves the device as its backward ends, and its place in the bucket is a window that
        # every such parameter of the dtype uses in turn (OffloadOptimizer._build).
        self.windowed = False
        self.bucket = None  # its dtype's _Bucket
        self.grad_view = None
        self.grad_ptr = 0  # grad_view's address: a p.grad.data = ... keeps the tensor and changes it
        # A gradient tensor of the trainer's (autograd's) in p.grad, taken at this version: read by the engine
        # where it is (grads_at, the address the engine reads this slot's gradient from) or copied.
        self.grads_at = 0
        self.own_grad = None
        self.own_version = 0
        self.weight_view = None  # p.data as the optimizer laid it (a view of its bucket)
        self.engine_ids: list[int] = []
        self.accumulated = 0  # backward passes that accumulated into this gradient since the last step
        self.taken = False  # the engine has read this iteration's gradient (reported, or for a norm)


class _StateView(collections.abc.MutableMapping):
    """``opt.state`` as torch's optimizers have it: ``state[p]`` is ``{"step", "exp_avg", "exp_avg_sq"}`` for each
    parameter stepped at least once (``{}`` for the others, as torch's defaultdict gives). The moments are
    views of zoe's own memory where it keeps them as fp32 in RAM (tier ram, ``state_dtype="fp32"``, one rank):
    reading and writing them reads and writes the optimizer's state. Elsewhere (bf16 or int8 moments, tier
    nvme, a partitioned optimizer: this rank's piece, flat; FSDP2: the local shard) they are fp32 copies
    decoded when asked for —
    writing them changes nothing. Built on access; the engine's work in flight is waited for first. Keys that
    are not parameters (a hook's own entries) are kept here and travel in ``state_dict()["state"]``, as with
    torch; a parameter's entry cannot be replaced (``load_state_dict`` takes a state into the engine)."""

    def __init__(self, opt: "OffloadOptimizer"):
        self._opt = weakref.ref(opt)
        self._hidden = False
        self.extras: dict = {}

    def _slot(self, key):
        opt = self._opt()
        if opt is None or not isinstance(key, torch.Tensor):
            return None
        return next((s for s in opt._slots if s.param is key), None)

    def _stepped(self, s) -> int:
        return self._opt()._engine.param_step_count(s.engine_ids[0]) if s.engine_ids else 0

    def __getitem__(self, key):
        s = self._slot(key)
        if s is None:
            if isinstance(key, torch.Tensor):
                return {}
            return self.extras.setdefault(key, {})  # a defaultdict(dict), as torch's
        if self._hidden or self._stepped(s) == 0:
            return {}
        opt = self._opt()
        opt._engine.wait()
        views = [opt._engine.moments_view(s.engine_ids[0], which) for which in (1, 2)]
        whole = len(s.engine_ids) == 1 and opt._world == 1 and opt._dtensor is None  # not a piece, not a shard
        if whole and all(v is not None for v in views):
            m, v = (torch.from_numpy(x).view(s.shape) for x in views)
        else:
            st = opt.read_state(key)
            m, v = st["exp_avg"], st["exp_avg_sq"]
        return {"step": torch.tensor(float(self._stepped(s))), "exp_avg": m, "exp_avg_sq": v}

    def __setitem__(self, key, value) -> None:
        if self._slot(key) is not None:
            raise TypeError("zoe.torch.OffloadOptimizer: a parameter's state lives in zoe's engine and cannot be "
                            "replaced entry by entry: load a state_dict (load_state_dict), or write into the "
                            "tensors of opt.state[p] where they are views (fp32 moments in RAM)")
        self.extras[key] = value

    def __delitem__(self, key) -> None:
        if self._slot(key) is not None:
            raise TypeError("zoe.torch.OffloadOptimizer: a parameter's state lives in zoe's engine; it cannot be "
                            "deleted")
        del self.extras[key]

    def __contains__(self, key) -> bool:
        s = self._slot(key)
        if s is None:
            return key in self.extras
        return not self._hidden and self._stepped(s) > 0

    def __iter__(self):
        opt = self._opt()
        params = [] if opt is None or self._hidden else [s.param for s in opt._slots if self._stepped(s) > 0]
        return iter(params + list(self.extras))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @contextlib.contextmanager
    def hidden(self):
        """Without the parameters' entries for a while: torch's state_dict() packing, which zoe fills from its
        checkpoint instead (the extras are packed as torch packs them)."""
        self._hidden = True
        try:
            yield
        finally:
            self._hidden = False


class _Bucket:
    """The flat weights and gradients of every trainable parameter of one dtype, and this rank's shard.

    Windowed slots (offloaded parameters, whose gradients leave the device when reported; one rank only)
    are not in the flat buffers: their weights are in the parameter tier, and their gradients take turns in
    one ``window`` as large as the largest of them — each is there only from its accumulation to its report,
    which follow each other on autograd's thread. A tensor of its own, so that its version counter tells
    a trainer's edit of those gradients from edits of the others."""

    def __init__(self, dtype, device, slots, world):
        self.dtype = dtype
        self.slots = slots
        total = 0
        for s in slots:
            s.bucket = self
            s.offset = 0 if s.windowed else total
            total += 0 if s.windowed else s.numel
        self.shard_numel = -(-total // world) if total else 0
        padded = self.shard_numel * world
        # Padded to W x shard_numel elements: the engine reduces and gathers in these buffers.
        self.weights = torch.zeros(padded, dtype=dtype, device=device)
        self.grads = torch.zeros(padded, dtype=dtype, device=device)
        window = max((s.numel for s in slots if s.windowed), default=0)
        self.window = torch.zeros(window, dtype=dtype, device=device) if window else None

    def grad_buffer(self, s: _Slot) -> torch.Tensor:
        return self.window if s.windowed else self.grads


class OffloadOptimizer(_state_dict.StateDictMethods, torch.optim.Optimizer):
    """Adam/AdamW with its state offloaded to zoe. A drop-in for ``torch.optim.AdamW`` (``adamw=True``, the
    default) or ``torch.optim.Adam`` with L2 decay (``adamw=False``).

    Args beyond AdamW's:
        tier: ``"ram"`` (pinned host memory) or ``"nvme"`` (swap files under ``nvme_path``).
        nvme_path: a folder, or a list of folders on several drives, for the NVMe tier.
        durability: tier nvme — ``"step"`` (default): each step's writes are made durable (fdatasync and
            tile table) in the background, beside the next forward/backward; after a crash the swap files
            hold the last step or the one before, whole. ``"checkpoint"``: no fdatasync per step, the swap
            files are made durable at ``state_dict()``/save only; after a crash they may be refused (never
            used wrong) — resume from the last checkpoint, as a new optimizer does anyway.
        keep_resident: tier nvme — when the whole state fits in ``buffer_count`` tiles, keep it in those
            buffers between steps (True, the default): a step reads nothing from the swap files and its writes
            finish during the next forward/backward (a write that fails is made again from RAM by the next
            step, or that step fails, changing nothing). False: every step streams its tiles from the files.
        schedule: ``"sync"``, ``"overlap"`` (transfers and CPU Adam during backward) or ``"delayed"``
            (the CPU step runs beside the next forward/backward, one step stale, after
            ``delayed_warmup_steps`` sync steps).
        max_grad_norm: clip the global gradient norm (``torch.nn.utils.clip_grad_norm_`` semantics).
        refuse_non_finite: a NaN/Inf gradient without fp16 loss scaling makes ``step()`` raise
            ``zoe.InvalidArgumentError`` naming the parameters, and nothing changes; ``False`` lets it
            propagate into the weights, as ``torch.optim.AdamW`` does.
        loss_scale: ``None`` — dynamic fp16 loss scaling when any parameter is fp16, none otherwise;
            ``"dynamic"``; a number — a static scale; ``False`` — none. Multiply the loss by
            ``opt.loss_scale`` (or call ``opt.backward(loss)``); an overflow skips the step, as GradScaler does.
        gradient_accumulation_steps: backward passes (micro-batches) per ``step()``. Declared (> 1), each
            micro-batch's gradient is added into an fp32 sum on the host as backward produces it, ``p.grad``
            is zeroed for the next one, and after the last ``p.grad`` holds the sum rounded to its dtype
            (what a trainer that clips or logs it sees) while the step uses the fp32 sum — unless the
            trainer changes ``p.grad``, whose edited values are then stepped. ``None``: gradients accumulate
            in ``p.grad`` in its dtype, as with torch, and the count seen before the previous step tells
            the overlap and delayed schedules which backward pass is the last (the first step runs as sync).
        process_group: the data-parallel group (default: the world, when torch.distributed is initialised).
            Each rank owns 1/W of the optimizer state: it steps that part and the weights are all-gathered
            (the engine's partitioned step, over torch.distributed; schedule ``sync``).
        reduce_grads: ``True``: zoe averages the gradients over ``process_group`` before stepping (each rank
            ran backward on its own batch, with no wrapper). ``False``: they are averaged already — pass it
            with ``DistributedDataParallel``, whose backward averages them; zoe then only partitions the
            state (as ``ZeroRedundancyOptimizer`` does beside DDP). The first step checks the choice: unequal
            gradients across ranks with ``False`` are an error, equal ones with ``True`` a warning (averaging
            them again is right but costs an all-reduce per step).
        isa, threads, tile: the CPU kernel's instruction set, worker threads, elements per unit of work.
        state_dtype: how the Adam moments are kept: ``"fp32"``; ``"bf16"`` (8 bytes less per parameter in
            RAM, or 4 bytes less of NVMe traffic each way on tier nvme; each moment rounded to nearest even
            after its fp32 update); or ``"int8"`` (2 bytes per parameter and an fp32 scale per 2048
            elements, in RAM or in the swap files: m linear in its block's largest, v an 8-bit float
            relative to its block's largest). The master weights stay fp32, and
            ``read_state``/``state_dict`` give fp32 values.

    With torch FSDP2 (``fully_shard``; the parameters are DTensors): pass ``model.parameters()`` after
    ``fully_shard``, on every rank. zoe steps each rank's local shards in place (with ``CPUOffloadPolicy``
    they are host memory already) and does not partition again; ``max_grad_norm``, ``clip_grad_norm_`` and
    the NaN/Inf refusal act on the global norm over the mesh, as FSDP2's ``clip_grad_norm_`` does, which a
    trainer may call instead. ``state_dict()`` holds this rank's shards: each rank saves and loads its own
    with ``torch.save``; or ``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` save
    and load it with the model, resharded to another mesh if need be. The schedules run as
    ``sync`` (a warning says so): torch's foreach ops on DTensor gradients do not bump version counters, so
    a trainer's edit after backward could not be seen. Every parameter must be a DTensor on one mesh,
    sharded or replicated alike; anything else is refused at construction.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, adamw: bool = True, tier: str = "ram", nvme_path=None,
                 schedule: str = "sync", max_grad_norm: float | None = None, *, loss_scale=None,
                 initial_scale: float = 2.0 ** 16, growth_interval: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, delayed_warmup_steps: int = 10, process_group=None,
                 isa: str = "auto", threads: int = 0, tile: int = 1 << 20, buffer_count: int = 4,
                 block_size: int = 1 << 20, queue_depth: int = 8, refuse_non_finite: bool = True,
                 durability: str = "step", keep_resident: bool = True,
                 gradient_accumulation_steps: int | None = None,
                 reduce_grads: bool = True, state_dtype: str = "fp32",
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None):
        _torch_flags.check_hyper(lr, betas, eps, weight_decay)
        if decoupled_weight_decay is not None:
            if not adamw and decoupled_weight_decay:
                raise ValueError("adamw=False and decoupled_weight_decay=True contradict each other: pass one of them")
            adamw = bool(decoupled_weight_decay)
        if tier not in ("ram", "nvme"):
            raise ValueError(f"tier = {tier!r} is unknown: use 'ram' or 'nvme'")
        if tier == "nvme" and not nvme_path:
            raise ValueError("tier='nvme' needs nvme_path: a folder (or a list of folders) for the swap files")
        if durability not in ("step", "checkpoint"):
            raise ValueError(f"durability = {durability!r} is unknown: use 'step' (each step durable in the "
                             "background) or 'checkpoint' (durable at save only)")
        if not isinstance(keep_resident, bool):
            raise ValueError(f"keep_resident = {keep_resident!r} is invalid: True or False")
        if schedule not in ("sync", "overlap", "delayed"):
            raise ValueError(f"schedule = {schedule!r} is unknown: use 'sync', 'overlap' or 'delayed'")
        if gradient_accumulation_steps is not None and (
                isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int)
                or gradient_accumulation_steps < 1):
            raise ValueError(f"gradient_accumulation_steps = {gradient_accumulation_steps!r} is invalid: an int >= 1, "
                             "or None to count the backward passes before each step")
        if state_dtype not in ("fp32", "bf16", "int8"):
            raise ValueError(f"state_dtype = {state_dtype!r} is unknown: use 'fp32', 'bf16' or 'int8'")
        if not isinstance(reduce_grads, bool):
            raise ValueError(f"reduce_grads = {reduce_grads!r} is invalid: True (zoe averages the gradients across "
                             "ranks) or False (they are averaged already, e.g. by DistributedDataParallel)")
        if max_grad_norm is not None and not (max_grad_norm >= 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm = {max_grad_norm} is invalid: need >= 0 (or None: no clipping)")
        _check_engine_keywords(dict(
            growth_interval=growth_interval, hysteresis=hysteresis, delayed_warmup_steps=delayed_warmup_steps,
            threads=threads, tile=tile, buffer_count=buffer_count, block_size=block_size, queue_depth=queue_depth,
            initial_scale=initial_scale, min_loss_scale=min_loss_scale, loss_scale=loss_scale, isa=isa,
            nvme_path=nvme_path))
        # torch.optim.AdamW's keys, so that torch reads these groups as its own (state_dict, schedulers).
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw,
                        decoupled_weight_decay=adamw, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        fused=fused, capturable=capturable, differentiable=differentiable)
        _torch_flags.check_group(defaults, "OffloadOptimizer")
        self._built = False
        self._calls = threading.RLock()  # _serial.serialised: one public call at a time
        super().__init__(params, defaults)
        self._options = dict(tier=tier, nvme_path=nvme_path, schedule=schedule, max_grad_norm=max_grad_norm,
                             loss_scale=loss_scale, initial_scale=initial_scale, growth_interval=growth_interval,
                             hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                             delayed_warmup_steps=delayed_warmup_steps, isa=isa, threads=threads, tile=tile,
                             buffer_count=buffer_count, block_size=block_size, queue_depth=queue_depth,
                             refuse_non_finite=refuse_non_finite, durability=durability, keep_resident=keep_resident,
                             state_dtype=state_dtype)
        # DTensor parameters (FSDP2) are partitioned already: the engine steps this rank's shards, world 1.
        self._dtensor = _dtensor.ShardedParams.detect(self.param_groups, process_group)
        if self._dtensor is not None:
            self._options["schedule"] = self._dtensor.schedule(schedule)
        self._group = process_group
        self._world, self._rank = 1, 0
        if self._dtensor is None and dist.is_available() and dist.is_initialized():
            self._group = process_group if process_group is not None else dist.group.WORLD
            self._world = dist.get_world_size(self._group)
            self._rank = dist.get_rank(self._group)
        if self._world > 1 and schedule != "sync":
            warnings.warn(
                f"zoe.torch.OffloadOptimizer: schedule='{schedule}' runs as 'sync' across {self._world} ranks — "
                "zoe's partitioned step reduces the gradients once backward has ended, and overlapping it with "
                "backward is not supported yet. The steps are exact, not overlapped.", stacklevel=2)
            self._options["schedule"] = "sync"
        self._accumulating = False
        # Micro-batches: the backward pass whose gradients the overlap/delayed engine is told of (None: not
        # known yet), whether it has been told this iteration, and the version of each bucket's gradients
        # when the engine last took them — a later version means the trainer changed them.
        self._accumulation_steps = gradient_accumulation_steps
        self._reporting_pass = gradient_accumulation_steps
        # Declared accumulation on one rank: the engine sums the micro-batches in fp32 on the host. Across
        # ranks (zoe's own data-parallel mode) the gradients accumulate in p.grad, as with torch.
        self._engine_accumulates = bool(gradient_accumulation_steps and gradient_accumulation_steps > 1
                                        and not (dist.is_available() and dist.is_initialized()
                                                 and dist.get_world_size(process_group) > 1))
        self._reported = False
        self._taken_versions: list[int] | None = None
        self._window_versions: list[int] = []  # of the windows' gradients when zoe last wrote them (_Bucket)
        self._windowed_slots: list[_Slot] = []
        self._hyper_pushed = False  # this iteration's hyper-parameters went to the engine at a report
        self._clip_once: float | None = None  # clip_grad_norm_'s max_norm for the coming step
        self._warned_changed = False
        self._reduce = reduce_grads
        self._dp: _data_parallel.DataParallel | None = None  # zoe's own data-parallel mode (_build)
        self._check_changes = True  # tests turn the detection off to show that it matters
        self._saved_to: str | None = None  # save_to(): the next state_dict() refers to each rank's file there
        self._load_folder: str | None = None  # load_from(): where the next load_state_dict() finds them
        self._hooks = []
        self._hyper_sent: list[tuple | None] = []
        self._timing = {"engine_s": 0.0, "adapter_s": 0.0, "comm_s": 0.0, "steps": 0}
        self._weight_marks: list[tuple] = []
        self._offloads: list = []  # the parameter offloads (offload_parameters) of the slots
        self._edits: dict = {}  # id(slot) -> (slot, its weights as the trainer set them), taken at step()
        self._absent_sent = False  # the engine holds a non-empty list of parameters without a gradient
        # The engine may read a gradient where autograd put it (set_grad_sources) instead of a copy in the
        # flat buffer: one rank, zoe's own buffers (not FSDP2's), no micro-batches summed by the engine.
        self._grad_sources = False
        self._retired_grads: list = []  # gradient tensors the engine read this iteration, replaced since
        self._scaled = False  # this iteration's loss was scaled by zoe's loss scale (fp16)
        self._build()
        self._built = True

    @property
    def state(self) -> _StateView:
        """torch's per-parameter state, read from zoe (``_StateView``)."""
        view = self.__dict__.get("_zoe_state")
        if view is None:
            view = self.__dict__["_zoe_state"] = _StateView(self)
        return view

    @state.setter
    def state(self, value) -> None:
        """torch.optim.Optimizer sets its own dict at construction; zoe's state lives in its engine."""

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict ends here: the parameters' state went to the engine; entries of other keys
        # (a hook's) are kept, as torch keeps them.
        state = dict(state)
        loaded = state.pop("state", None)
        super().__setstate__(state)
        if loaded is not None and "_zoe_state" in self.__dict__:
            self.state.extras = {k: v for k, v in loaded.items() if not isinstance(k, torch.Tensor)}

    # ---- construction ---------------------------------------------------------------------------------

    @_serial.serialised
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(
                "zoe.torch.OffloadOptimizer: parameters cannot be added after construction — the engine has "
                "already laid out the optimizer state. Create the optimizer with every param group "
                "(e.g. unfreeze layers by setting their lr to 0 in a group of their own).")
        if isinstance(param_group, dict):
            _torch_flags.normalise_group(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _torch_flags.decoupled(group)
        _torch_flags.check_group(group, f"param group {len(self.param_groups) - 1}")
        _torch_flags.check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _build(self) -> None:
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(
                "zoe.torch.OffloadOptimizer: parameters are on several devices "
                f"({', '.join(sorted(str(d) for d in devices))}); one optimizer serves one device — "
                "move the model to one device first, or create one optimizer per device")
        self._device = devices.pop() if devices else torch.device("cpu")
        if self._device.type == "cuda":
            self._zoe_device = _zoe.cuda_device(self._device.index or 0)
        elif self._device.type == "cpu":
            self._zoe_device = _cpu_device()
        else:
            raise ValueError(f"zoe.torch.OffloadOptimizer: device {self._device} is not supported (cpu or cuda)")
        self._stream = _stream.TorchStream(self._zoe_device, self._device)

        slots_by_dtype: dict[torch.dtype, list[_Slot]] = {}
        self._slots: list[_Slot] = []
        index = 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.is_sparse or p.layout != torch.strided:
                    raise ValueError(f"parameter {index} (shape {tuple(p.shape)}) is sparse: zoe steps dense tensors")
                # Frozen parameters (requires_grad=False) are held too, as torch's optimizers hold them: they are
                # stepped once they are unfrozen and have a gradient (a None gradient is never stepped).
                if p.dtype in _ZOE_DTYPES:
                    bucket = slots_by_dtype.setdefault(p.dtype, [])
                    offset = sum(s.numel for s in bucket)
                    slot = _Slot(p, index, gi, offset)
                    bucket.append(slot)
                    self._slots.append(slot)
                elif p.requires_grad:
                    raise TypeError(f"parameter {index} (shape {tuple(p.shape)}) is {p.dtype}; zoe handles "
                                    "float32, float16 and bfloat16")
                index += 1
        self._param_count = index
        if any(s.tier is not None for s in self._slots):
            if self._dtensor is not None or self._world > 1:
                raise _zoe.UnsupportedError(
                    "zoe.torch.OffloadOptimizer: offloaded parameters (offload_parameters) with several ranks or "
                    "FSDP2 are not supported yet: the engine cannot gather weights into a parameter tier")
        if self._dtensor is not None:
            self._buckets = self._dtensor.make_buckets(slots_by_dtype, self._device)
            self._make_engine()
            self._note_weights()
            return
        # On a device with memory of its own, offloaded parameters' gradients leave it as each one's backward
        # ends (docs/architecture.md, "Parameters off the device"): on CUDA they take one window's memory,
        # not theirs.
        for s in self._slots:
            s.windowed = s.tier is not None and not self._zoe_device.host_memory
        self._windowed_slots = [s for s in self._slots if s.windowed]
        if self._world == 1:
            _route_clipping(self)
        self._buckets = [_Bucket(dt, self._device, slots, self._world) for dt, slots in slots_by_dtype.items()]
        if self._world > 1:
            self._dp = _data_parallel.DataParallel(self._group, self._device, self._reduce)
        with torch.no_grad():
            for b in self._buckets:
                for s in b.slots:
                    if s.tier is None:
                        b.weights[s.offset:s.offset + s.numel].copy_(s.param.data.reshape(-1))
                        s.weight_view = b.weights[s.offset:s.offset + s.numel].view_as(s.param)
                        s.param.data = s.weight_view
                    s.grad_view = b.grad_buffer(s)[s.offset:s.offset + s.numel].view(s.shape)
                    s.grad_ptr = s.grads_at = s.grad_view.data_ptr()
                    # A gradient there already is taken in; a None stays None (not stepped, as with torch).
                    if s.param.grad is not None:
                        s.grad_view.copy_(s.param.grad)
                    if s.param.grad is not None or s.windowed:
                        _param_offload.set_grad(s.param, s.grad_view)
                if self._world > 1:
                    # Every rank starts from rank 0's weights, as DistributedDataParallel does.
                    dist.broadcast(b.weights, src=dist.get_global_rank(self._group, 0), group=self._group)
        self._make_engine()
        self._grad_sources = self._world == 1 and not self._engine_accumulates
        hook_all = self._options["schedule"] in ("overlap", "delayed") or self._engine_accumulates
        if self._world == 1:
            for s in self._slots:
                # A frozen parameter has no hook (torch refuses one); unfrozen later, it is taken at step().
                if (hook_all or s.windowed) and s.param.requires_grad:
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_hook(s)))
        self._window_versions = self._versions_of_windows()
        self._note_weights()

    def _loss_scale_options(self):
        ls = self._options["loss_scale"]
        if ls is None:
            ls = "dynamic" if any(b.dtype == torch.float16 for b in self._buckets) else False
        if ls is False or ls == 0 and not isinstance(ls, str):
            return dict(loss_scale=False)
        if ls == "dynamic":
            return dict(loss_scale=True, dynamic_loss_scale=True, initial_scale=float(self._options["initial_scale"]))
        if isinstance(ls, (int, float)) and ls > 0:
            return dict(loss_scale=True, dynamic_loss_scale=False, static_loss_scale=float(ls))
        raise ValueError(f"loss_scale = {ls!r} is invalid: None, False, 'dynamic' or a positive number")

    def _make_engine(self) -> None:
        _scratch.remove_abandoned()  # what killed saves of earlier runs left
        o = self._options
        opts = _zoe.EngineOptions()
        opts.tier = o["tier"]
        paths = o["nvme_path"]
        if paths is not None:
            paths = _checks.paths("zoe.torch.OffloadOptimizer", "nvme_path", paths)
            # One swap folder per rank: ranks on one machine must not share files.
            world, rank = self._partition()
            opts.nvme_paths = [os.path.join(os.fspath(pp), f"rank{rank}") if world > 1 else os.fspath(pp)
                               for pp in paths]
            for pp in opts.nvme_paths:
                _swap_folder(pp)
        opts.buffer_count = o["buffer_count"]
        opts.block_size = o["block_size"]
        opts.queue_depth = o["queue_depth"]
        opts.nvme_durability = o["durability"]
        opts.nvme_keep_resident = o["keep_resident"]
        opts.state_dtype = o["state_dtype"]
        opts.schedule = o["schedule"]
        opts.delayed_warmup_steps = o["delayed_warmup_steps"]
        opts.gradient_accumulation_steps = self._accumulation_steps if self._engine_accumulates else 1
        # Across ranks the engine partitions the buckets in place (they are flat and padded) and reduces the
        # gradients unless DistributedDataParallel averaged them.
        opts.partition_flat_buffers = True
        opts.partition_grads_averaged = not self._reduce
        # FSDP2's global norm spans the mesh: _dtensor clips, and the engine sees the clipped shards.
        max_norm = float(o["max_grad_norm"] or 0.0)
        opts.max_grad_norm = max_norm if self._dtensor is None else 0.0
        self._max_grad_norm = max_norm
        opts.refuse_non_finite = bool(o["refuse_non_finite"])
        ls = self._loss_scale_options()
        for k, v in ls.items():
            setattr(opts, k, v)
        opts.growth_interval = o["growth_interval"]
        opts.hysteresis = o["hysteresis"]
        opts.min_scale = o["min_loss_scale"]
        self._loss_scaling = ls["loss_scale"]
        opts.tile = o["tile"]
        opts.isa = o["isa"]
        opts.threads = o["threads"]

        groups = [self._group_hyper(g) for g in self.param_groups]
        specs, tiered = [], []
        # Recorded in zoe's checkpoints for zoe export: the names of an optimizer built from named_parameters().
        names = {}
        index = 0
        for g in self.param_groups:
            for k, _ in enumerate(g["params"]):
                if "param_names" in g:
                    names[index] = g["param_names"][k]
                index += 1
        pieces = 0  # the engine's parameters, which read_state() names: this rank's pieces of the slots
        for b in self._buckets:
            lo, hi = self._rank * b.shard_numel, (self._rank + 1) * b.shard_numel
            esize = b.grads.element_size()
            for s in b.slots:
                # A DTensor's shard is FSDP2's own storage, stepped in place.
                weights_ptr = (self._dtensor.weights_ptr(s) if self._dtensor is not None
                               else b.weights.data_ptr() + s.offset * esize)
                shape = list(s.param._local_tensor.shape if self._dtensor is not None else s.shape)
                if s.tier is not None:
                    offload, block, entry = s.tier
                    tiered.append((len(specs), offload.tier, block, entry))
                    weights_ptr = 0
                grads_ptr = b.grad_buffer(s).data_ptr() + s.offset * esize
                specs.append((s.numel, _ZOE_DTYPES[b.dtype], weights_ptr, grads_ptr, s.group, names.get(s.index, ""),
                              shape))
                if s.windowed or max(lo, s.offset) < min(hi, s.offset + s.numel):
                    s.engine_ids.append(pieces)
                    pieces += 1
        collectives = self._dp.collectives if self._dp is not None else None
        self._engine = _zoe.Engine(self._zoe_device, [dict(h) for h in groups], specs, opts, collectives, tiered)
        self._hyper_sent = [self._hyper_key(h) for h in groups]

    @staticmethod
    def _group_hyper(group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw=_torch_flags.decoupled(group))

    @staticmethod
    def _hyper_key(h: dict) -> tuple:
        return (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["adamw"])

    def _make_hook(self, slot: _Slot) -> Callable:
        # A weak reference: the parameter holds the hook, and must not keep the optimizer (and its engine's
        # memory) alive after the trainer drops it.
        ref = weakref.ref(self)

        def hook(param):
            opt = ref()
            if opt is None:
                return
            if slot.windowed:
                opt._on_windowed_grad(slot)  # it cannot wait on the device, inside accumulating() too
            elif not opt._accumulating:
                opt._on_grad_accumulated(slot)
        return hook

    def _on_grad_accumulated(self, slot: _Slot) -> None:
        """After autograd accumulated this backward's gradient into ``slot``. With accumulation declared, every
        micro-batch's gradient goes to the engine (added in fp32 on the host, the buffer zeroed); otherwise
        the engine is told on the reporting micro-batch (overlap: it copies and steps it during the rest of
        backward)."""
        self._adopt_grad(slot)
        slot.accumulated += 1
        passes = self._reporting_pass
        if self._engine_accumulates and slot.accumulated > passes:
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step, but "
                f"gradient_accumulation_steps = {passes}: call step() after every {passes} backward passes, or "
                "create the optimizer with the number you use")
        if self._reported:
            if slot.accumulated > passes:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step, but the "
                    f"{self._options['schedule']} schedule had started this step after backward pass {passes} — "
                    "its forward ran with weights that step already changed. Pass gradient_accumulation_steps="
                    "<micro-batches per step> to OffloadOptimizer, or call step() after the same number of "
                    "backward passes each time")
            # Every accumulation is followed by its hook: the last version seen here is the end of backward's.
            self._taken_versions = self._grad_versions()
        if self._engine_accumulates or slot.accumulated == passes:
            self._report(slot, last=slot.accumulated == passes)

    def _on_windowed_grad(self, slot: _Slot) -> None:
        """After autograd accumulated the gradient of an offloaded parameter into its window: it goes down
        now (with micro-batches declared, added into zoe's fp32 sum on the host), and the window is zeroed for
        the next parameter. p.grad holds zeros from then on."""
        self._adopt_grad(slot)
        slot.accumulated += 1
        passes = self._accumulation_steps if self._engine_accumulates else 1
        if slot.accumulated > passes:
            slot.grad_view.zero_()
            self._window_versions = self._versions_of_windows()
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: backward pass {slot.accumulated} since the last step reached offloaded "
                f"parameter {slot.index} (shape {tuple(slot.shape)}), whose gradient left the device after pass "
                f"{passes}: gradients of offloaded parameters cannot accumulate in p.grad. Pass "
                "gradient_accumulation_steps=<micro-batches per step> to OffloadOptimizer (zoe then sums them in "
                "fp32 on the host), or call step() after every backward pass")
        self._push_hyper_once()
        self._stream.follow()
        for i in slot.engine_ids:
            self._engine.grad_ready(i)
        if not self._stream.ordered:
            # The copy down must have read the window before the next parameter's gradient is accumulated
            # there. On CUDA the engine made torch's stream wait for it (grad_left_device), so the zeroing
            # below is ordered after it with no host wait.
            self._zoe_device.synchronize()
        slot.grad_view.zero_()
        self._window_versions = self._versions_of_windows()
        slot.taken = slot.accumulated == passes

    def _answers_clipping(self, params: list) -> bool:
        """Whether torch's clip_grad_norm_ over ``params`` is this optimizer's (_clip_grad_norm_): they are its
        parameters, all of them, and no other with a gradient (frozen ones may be among them). Over part of
        them, torch clips p.grad in place and step() takes the edit — impossible for gradients that left the
        device, which is an error."""
        mine = {id(s.param) for s in self._slots}
        given = {id(p) for p in params}
        if not mine & given:
            return False
        foreign = {id(p) for p in params if p.grad is not None} - mine
        missing = mine - given
        if not (foreign or missing):
            return True
        if any(id(s.param) in given for s in self._windowed_slots):
            raise RuntimeError(
                "zoe.torch.OffloadOptimizer: torch.nn.utils.clip_grad_norm_ over parameters that include offloaded "
                "ones (offload_parameters) must be given this optimizer's parameters (e.g. model.parameters()): "
                f"{len(foreign)} given with gradients are not the optimizer's, {len(missing)} of the optimizer's "
                "are not given. Their gradients left the device, and zoe computes the norm over all of the "
                "optimizer's")
        return False

    def _push_hyper_once(self) -> None:
        """At the iteration's first report, before the engine steps or writes anything of it: a learning-rate
        scheduler stepped after the last step() reaches the overlap schedule's speculative steps, which use
        the values of the first report (the engine redoes them if step() brings others), and the trainer's
        edits of the weights are read before zoe's writes could cover them."""
        if not self._hyper_pushed:
            self._refuse_unscaled_fp16()
            self._capture_edits()
            self._sync_hyper()
            self._hyper_pushed = True

    def _versions_of_windows(self) -> list[int]:
        return [b.window._version for b in self._buckets if b.window is not None]

    def _check_windows(self) -> None:
        """Gradients that left the device cannot be changed: a trainer that clips, unscales or edits p.grad
        after backward (it finds zeros in the windows) gets an error, not a step that ignores its edit."""
        if self._versions_of_windows() == self._window_versions:
            return
        self._window_versions = self._versions_of_windows()
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: p.grad of an offloaded parameter (offload_parameters) was changed after "
            "backward, but its gradient had left the device as its backward ended (p.grad holds zeros since), "
            "so the change cannot be applied. Nothing was stepped. Let zoe clip: OffloadOptimizer("
            "max_grad_norm=...), opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm) called through torch.nn.utils (zoe answers it; a copy of torch's function bound before the "
            "optimizer existed is not); and zoe's loss scaling (loss_scale) in place of GradScaler.")

    def _report(self, slot: _Slot, last: bool) -> None:
        self._push_hyper_once()
        self._stream.follow()
        for i in slot.engine_ids:
            self._engine.grad_ready(i)
        if self._engine_accumulates and not self._stream.ordered:
            # Unless it works in place, the engine zeroes the buffer (or writes the sum back) on its own copy
            # stream — on the CPU too, with the delayed schedule — which torch's next backward or the
            # trainer's clipping does not wait for. On CUDA torch's stream waits for it on the device.
            self._zoe_device.synchronize()
        if last:
            self._reported = slot.taken = True
            self._taken_versions = self._grad_versions()

    def _adopt_grads(self) -> None:
        """Every gradient into the flat buffers before the engine reads them all; one the engine had read
        already that the trainer replaced by another tensor (``p.grad = ...``, or None) is a changed gradient.
        Parameters whose gradient is None are named to the engine, which leaves them as they are (torch's
        rule: not stepped, their moments and step count unchanged)."""
        absent = [s for s in self._slots if self._grad_absent(s)]
        if self._dp is not None:  # every rank, every step: a rank cannot tell whether another has a None
            absent = self._dp.absent_everywhere(self._slots, absent)
        absent_ids = {id(s) for s in absent}
        moves: list = []  # where the engine reads gradients from, told in one call
        replaced = [s for s in self._slots if id(s) in absent_ids or self._adopt_grad(s, moves)]
        self._read_grads_from(moves)
        self._window_versions = self._versions_of_windows()
        if self._check_changes and any(s.taken for s in replaced):
            self._take_again()
            self._warn_changed()
        if absent or self._absent_sent:
            self._engine.set_grads_absent([i for s in absent for i in s.engine_ids])
            self._absent_sent = bool(absent)

    def _grad_absent(self, s: _Slot) -> bool:
        """No gradient this iteration: p.grad is None (set so after backward too: the overlap schedule's
        speculative step of it is undone). Where the engine sums the micro-batches, or the gradient left the
        device (an offloaded parameter), one that was reported is present whatever p.grad says."""
        if s.windowed:
            return s.accumulated == 0
        if self._engine_accumulates and s.accumulated:
            return False
        return s.param.grad is None

    # ---- the model's weights are the truth between steps ----------------------------------------------

    def _weight_marks_now(self) -> list:
        """What says, for each slot, that the trainer changed its weights: torch's version counter, address and
        dtype of ``p`` (a DTensor's own counter, of its local shard's address), or for an offloaded parameter
        its tier's count of ``gathered()`` write-backs. zoe's own writes go through addresses and change none.
        Run twice an iteration, so kept to one tuple per tensor."""
        if self._dtensor is not None:
            return [(s.param._version, s.param._local_tensor.data_ptr(), s.param.dtype) for s in self._slots]
        return [(s.param._version, s.param.data_ptr(), s.param.dtype) if s.tier is None else s.tier[0].edits()
                for s in self._slots]

    def _note_weights(self) -> None:
        self._weight_marks = self._weight_marks_now()
        self._offloads = list({id(s.tier[0]): s.tier[0] for s in self._slots if s.tier is not None}.values())

    def _weights_loaded(self) -> None:
        """After load_state_dict: the master weights and the model's agree, and an edit read before the load
        is not applied after it."""
        self._edits.clear()
        self._note_weights()

    def _capture_edits(self) -> None:
        """Reads the weights the trainer changed since zoe last took them (``load_state_dict``, ``copy_`` under
        no_grad, ``nn.init``, an EMA swap, ``p.data = other``; an offloaded parameter's through
        ``offload.gathered()``; an FSDP2 shard's through the DTensor), to become the master weights at
        step(). Called at the iteration's first gradient report, before which zoe writes no weight (the
        overlap and delayed schedules write weights into the model during backward), and again at step()
        for an edit made after backward. A parameter moved to another dtype or device is refused, naming it."""
        marks = self._weight_marks_now()
        if marks == self._weight_marks:
            return
        changed = [s for s, now, then in zip(self._slots, marks, self._weight_marks) if now != then]
        if self._dtensor is not None:
            self._dtensor.check_storage()
        for s in changed:
            p = s.param
            if s.weight_view is not None and p.data_ptr() != s.weight_view.data_ptr():
                if p.dtype != s.weight_view.dtype or p.device != s.weight_view.device or p.shape != s.weight_view.shape:
                    raise RuntimeError(
                        f"zoe.torch.OffloadOptimizer: parameter {s.index} is now {p.dtype} {tuple(p.shape)} on {p.device}; "
                        f"the optimizer was built for {s.weight_view.dtype} {tuple(s.weight_view.shape)} on "
                        f"{s.weight_view.device} (model.to(...) or p.data = ... after creating it). Nothing was "
                        "stepped. Convert or move the model first, then create the optimizer")
                with torch.no_grad():
                    s.weight_view.copy_(p.detach())
                p.data = s.weight_view  # the new values, back in the buffer the engine writes
            self._edits[id(s)] = (s, self._current_weights(s).to("cpu", copy=True))
        self._note_weights()

    def _take_edited_weights(self) -> None:
        """Before a step: the weights the trainer changed (_capture_edits) become the master weights, never
        reverted to zoe's; what the overlap schedule stepped from the old ones during backward is undone
        first, and the step is then sync's from the new master."""
        for offload in self._offloads:
            offload.check_edits()  # an edit an offloaded parameter could not keep is refused
        self._capture_edits()
        if not self._edits:
            return
        pieces = {id(s): (begin, n) for s, begin, n in _interop.pieces(self)}
        self._engine.discard_speculative_steps()
        self._engine.wait()
        for s, now in self._edits.values():
            if id(s) not in pieces:
                continue  # partitioned: another rank holds this parameter's state
            begin, n = pieces[id(s)]
            now = now[begin:begin + n]
            master = torch.empty(n, dtype=torch.float32)
            self._engine.read_state(s.engine_ids[0], master, None, None)
            # Element by element: a weight that still is its master rounded keeps the master's extra bits
            # (a load of the same values, or of another part of the tensor); any other is the new truth.
            kept = master.to(now.dtype) == now
            if bool(kept.all()):
                continue
            self._engine.write_state(s.engine_ids[0], torch.where(kept, master, now.float()), None, None)
        self._edits.clear()

    def _current_weights(self, s: _Slot) -> torch.Tensor:
        """The weights the model holds for a slot now, flat."""
        if s.tier is not None:
            return s.tier[0].weights(s.param).reshape(-1)
        if self._dtensor is not None:
            return s.param._local_tensor.detach().reshape(-1)
        return s.weight_view.detach().reshape(-1)

    def _take_again(self) -> None:
        self._engine.grads_changed()
        self._taken_versions = self._grad_versions()

    def _grad_versions(self) -> list[int]:
        # A view shares its base's version counter: any in-place change of any p.grad bumps its bucket's.
        return [b.grads._version for b in self._buckets]

    def _note_changed_grads(self) -> None:
        """At step(): gradients the engine took (during backward, or for clip_grad_norm_) and the trainer
        changed since are taken again — the overlap schedule's speculative steps undone and redone."""
        if self._taken_versions is None or not self._check_changes:
            return
        if self._grad_versions() == self._taken_versions:
            return
        self._take_again()
        self._warn_changed()

    def _warn_changed(self) -> None:
        """Once: what a change of the gradients after zoe took them cost (the overlap, or the fp32 sum)."""
        overlapped = self._options["schedule"] in ("overlap", "delayed")
        if self._reported and (overlapped or self._engine_accumulates) and not self._warned_changed:
            self._warned_changed = True
            cost = []
            if overlapped:
                cost.append(f"the {self._options['schedule']} schedule took them again, so this step is exact but "
                            "not overlapped")
            if self._engine_accumulates:
                cost.append(f"the step uses p.grad as edited, in {self._buckets[0].dtype}, instead of zoe's fp32 "
                            "sum of the micro-batches")
            warnings.warn(
                "zoe.torch.OffloadOptimizer: the gradients changed after backward (the trainer clipped, unscaled, "
                f"edited or dropped them): {'; '.join(cost)}. To avoid this, let zoe clip: OffloadOptimizer("
                "max_grad_norm=...), opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_ called "
                "through torch.nn.utils over all of this optimizer's parameters, which zoe answers (Hugging Face's "
                "Trainer and Accelerate call it so; a copy of torch's function bound before the optimizer existed "
                "is torch's). This warning is shown once.", stacklevel=5)

    # ---- the step -------------------------------------------------------------------------------------

    def _adopt_grad(self, s: _Slot, moves: list | None = None) -> bool:
        """Makes sure the parameter's gradient is in its slot of the flat buffer (it is not when autograd
        allocated it — after ``zero_grad()``, whose default sets None — or a trainer assigned a tensor, or
        replaced its data). Returns whether it had to be brought there. As torch's optimizers, a step never
        replaces or writes ``p.grad``: a gradient of its own stays in ``p.grad`` and is copied (again once it
        changes). Only where zoe's design needs ``p.grad`` to be its buffer — micro-batches summed by the
        engine, offloaded parameters' windows, FSDP2 shards — does ``p.grad`` become the buffer's view.
        ``moves``: where to collect the engine's new gradient addresses (None: tell it now)."""
        told = moves is None
        moves = [] if told else moves
        replaced = self._take_grad(s, moves)
        if told:
            self._read_grads_from(moves)
        return replaced

    def _take_grad(self, s: _Slot, moves: list) -> bool:
        g = s.param.grad
        if g is s.grad_view and (self._dtensor is not None or g.data_ptr() == s.grad_ptr):
            return False
        if g is s.grad_view:  # p.grad.data = other: the same tensor, holding other memory now
            s.grad_view = s.bucket.grad_buffer(s)[s.offset:s.offset + s.numel].view(s.shape)
        if g is not None and g is s.own_grad and g._version == s.own_version:
            return False  # taken already, unchanged since
        if s.own_grad is not None and s.own_grad is not g:
            # The overlap schedule's worker may still read it until the step: let go of it after that.
            self._retired_grads.append(s.own_grad)
        s.own_grad = None
        if g is None:
            moves.append((s, s.grad_ptr))
            s.grad_view.zero_()  # present on another rank (zoe's partitioning): a zero here
            return True
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"parameter {s.index} (shape {tuple(s.param.shape)}) has a sparse gradient; "
                               "zoe steps dense gradients (use nn.Embedding(sparse=False))")
        own = not (s.windowed or self._engine_accumulates or self._dtensor is not None)
        if own and self._grad_sources and g.is_contiguous() and g.dtype == s.bucket.dtype and \
                g.device == self._device and g.numel() == s.numel:
            moves.append((s, g.data_ptr()))  # no copy: the engine reads it where autograd put it
        elif self._dtensor is not None:
            self._dtensor.copy_grad(s, g)  # a DTensor's data_ptr() is 0: its local tensor's tells
        else:
            moves.append((s, s.grad_ptr))
            if g.data_ptr() != s.grad_view.data_ptr():
                s.grad_view.copy_(g)
        if own:
            s.own_grad, s.own_version = g, g._version
        else:
            _param_offload.set_grad(s.param, s.grad_view)
        return True

    def _read_grads_from(self, moves: list) -> None:
        """Points the engine at where it reads each slot's gradient, (slot, address): a tensor of the
        trainer's (kept alive by ``own_grad`` until it is pointed elsewhere) or zoe's flat buffer (grad_ptr)."""
        moved = [(s, at) for s, at in moves if s.grads_at != at]
        if not moved:
            return
        self._engine.set_grad_sources([i for s, _ in moved for i in s.engine_ids],
                                      [at for s, at in moved for _ in s.engine_ids])
        for s, at in moved:
            s.grads_at = at

    def _sync_hyper(self) -> None:
        for gi, group in enumerate(self.param_groups):
            h = self._group_hyper(group)
            key = self._hyper_key(h)
            if key != self._hyper_sent[gi]:
                self._engine.set_hyper(gi, **h)
                self._hyper_sent[gi] = key

    @torch.no_grad()
    @_serial.serialised
    def step(self, closure: Callable[[], Any] | None = None):
        """Applies one Adam step to every parameter; returns the closure's loss when given one."""
        if _interop.called_to_initialise_state():
            return None  # zoe's state exists already; a step with zero gradients would decay the moments
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._dp is not None and self._timing["steps"] == 0:
            _interop.refuse_trainer_without_callback(self)
        t0 = time.perf_counter()
        comm = engine_s = 0.0
        try:
            self._refuse_unscaled_fp16()
            self._take_edited_weights()
            self._check_windows()
            self._note_changed_grads()
            self._adopt_grads()
            self._sync_hyper()
            if self._dp is not None:
                self._dp.check_reduction(self._buckets)
            if self._dtensor is not None:
                tc = time.perf_counter()
                self._dtensor.agree(self)
                comm += time.perf_counter() - tc
            self._stream.follow()
            te = time.perf_counter()
            self._engine.step()
            if not self._stream.ordered:
                # torch computes on the host at once: the device's copies (the weights up; with the delayed
                # schedule, the gradients down on a stand-in's own threads) must be done before the caller
                # reads the weights, zero_grad() or the next backward. On CUDA torch's stream waits instead.
                self._zoe_device.synchronize()
            engine_s = time.perf_counter() - te
        finally:
            self._end_iteration()  # a refused step ends the iteration too: the next one counts anew
        total = time.perf_counter() - t0
        tm = self._timing
        tm["engine_s"] += engine_s
        tm["comm_s"] += comm
        tm["adapter_s"] += total - engine_s - comm
        tm["steps"] += 1
        return loss

    def _refuse_unscaled_fp16(self) -> None:
        """fp16 loss scaling divides each gradient by the scale: a loss that was not multiplied by it (a plain
        ``loss.backward()``, or torch's GradScaler) would be stepped 65536 times too small, silently."""
        if not self._loss_scaling or self._scaled:
            return
        raise RuntimeError(
            "zoe.torch.OffloadOptimizer: this optimizer scales the fp16 loss (loss_scale="
            f"{self._options['loss_scale']!r}: {self._engine.loss_scale:g} now), but this iteration's loss was not scaled by "
            "it, and the step would divide the gradients by it. Nothing was stepped. Call opt.backward(loss) (or "
            "opt.scale_loss(loss).backward(), or multiply the loss by opt.loss_scale) — or, to use torch's GradScaler "
            "or no scaling, create the optimizer with loss_scale=False")

    def _end_iteration(self) -> None:
        self._scaled = False
        self._retired_grads.clear()
        passes = max((s.accumulated for s in self._slots), default=0)
        if self._accumulation_steps is None:
            self._reporting_pass = passes or None
        for s in self._slots:
            s.accumulated = 0
            s.taken = False
        self._reported = False
        self._taken_versions = None
        self._hyper_pushed = False
        if self._dtensor is not None:
            self._dtensor.end_iteration()
        if self._clip_once is not None:
            self._clip_once = None
            if self._dtensor is None:
                self._engine.set_max_grad_norm(self._max_grad_norm)

    @torch.no_grad()
    @_serial.serialised
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of this optimizer, for the coming step:
        returns the total norm of the (unscaled) gradients, computed by zoe, and clips the step by
        ``max_norm / (norm + 1e-6)`` when that is below 1. The coefficient is applied inside the step (fused
        into the kernel's gradient scale), so ``p.grad`` keeps its values and the overlap schedule keeps its
        overlap. ``max_norm=inf`` returns the norm and clips nothing; with the optimizer's own ``max_grad_norm``
        the tighter of the two applies. Other ``norm_type`` values clip ``p.grad`` in place with torch (exact,
        not overlapped; not with offloaded parameters on a GPU, whose gradients left the device)."""
        max_norm = float(max_norm)
        if not max_norm >= 0:
            raise ValueError(f"max_norm = {max_norm} is invalid: need >= 0 (inf: the norm, no clipping)")
        if float(norm_type) != 2.0:
            if self._windowed_slots:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: clip_grad_norm_ with norm_type={norm_type} over offloaded "
                    "parameters (offload_parameters) is not supported: their gradients left the device as their "
                    "backward ended, and zoe computes the 2-norm only")
            return _torch_clip_grad_norm_([s.param for s in self._slots], max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite)
        limit = min(max_norm, self._max_grad_norm) if self._max_grad_norm > 0 else max_norm
        self._check_windows()
        self._note_changed_grads()
        self._adopt_grads()
        for s in self._slots:
            s.taken = True
        if self._dtensor is not None:
            norm = self._dtensor.global_norm(self)
        else:
            if self._dp is not None:
                self._dp.check_reduction(self._buckets)
            self._engine.set_max_grad_norm(limit if math.isfinite(limit) else 0.0)
            self._stream.follow()
            norm = self._engine.grad_norm()
        self._clip_once = limit
        self._taken_versions = self._grad_versions()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({norm}), "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32, device=self._device)

    @_serial.serialised
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: ``set_to_none=True`` (the default) sets every ``p.grad`` to None, and a parameter whose
        gradient is still None at ``step()`` is not stepped. autograd then allocates each new gradient, which
        zoe copies into its flat buffer when it takes it. ``set_to_none=False`` zeroes the flat buffers in
        place (one fill per dtype; backward accumulates straight into them, no copy): every parameter then has
        a gradient, zero where backward gave none, and is stepped — as with torch. Offloaded parameters'
        gradients (``offload_parameters`` on a GPU) are zeroed either way: they leave the device as backward
        reports them, and one that was not reported is not stepped."""
        for b in self._buckets:
            if b.window is not None:
                b.window.zero_()
            if not set_to_none:
                b.grads.zero_()
        self._window_versions = self._versions_of_windows()
        # The engine reads zoe's buffers again before the trainer's gradient tensors are let go.
        self._read_grads_from([(s, s.grad_ptr) for s in self._slots if s.own_grad is not None])
        for s in self._slots:
            s.own_grad = None
            if set_to_none and not s.windowed:
                _param_offload.set_grad(s.param, None)
            elif s.param.grad is not s.grad_view and (s.param.grad is not None or s.windowed):
                # Zeroed where backward accumulates without a copy; torch leaves a None gradient None.
                _param_offload.set_grad(s.param, s.grad_view)

    # ---- loss scaling ---------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """What this iteration's loss must be multiplied by before backward (1.0 without loss scaling). Reading
        it counts as scaling this iteration's loss (step() refuses an fp16 loss that zoe's scale never reached)."""
        self._scaled = True
        return float(self._engine.loss_scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._scaled = True
        return loss * self.loss_scale if self._loss_scaling else loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the loss scale applied."""
        self.scale_loss(loss).backward(**kwargs)

    @property
    def last_step_skipped(self) -> bool:
        """True when the last step found an fp16 overflow and changed nothing (the scale was lowered)."""
        return bool(self._engine.last_step_skipped)

    @contextlib.contextmanager
    def accumulating(self):
        """Micro-batches inside this context only accumulate gradients: the overlap schedule reports them
        to the engine on the backward outside it, the last one before step()."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ---- inspection -----------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return int(self._engine.step_count)

    def stats(self) -> dict:
        """The engine's counters (steps, skipped, last_grad_norm, adam_s, step_call_s, d2h/h2d bytes) and the
        adapter's own time: ``engine_s`` inside the engine's step (zoe's own partitioning communicates there),
        ``comm_s`` in torch.distributed outside it (FSDP2's global norm), ``adapter_s`` the rest of step();
        ``device_grad_bytes``, the gradient buffers the adapter keeps on the model's device;
        ``host_waits_trainer``/``host_wait_trainer_s`` the times (and seconds) a trainer's thread waited for
        zoe's device since it was made, ``host_waits_worker``/``host_wait_worker_s`` zoe's own threads'."""
        s = dict(self._engine.stats())
        s.update(self._timing)
        s.update(_stream.host_wait_stats(self._zoe_device))
        s["device_grad_bytes"] = sum(
            (b.grads.numel() + (b.window.numel() if b.window is not None else 0)) * b.grads.element_size()
            for b in self._buckets)
        return s

    @_serial.serialised
    def read_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fp32 master weights and moments zoe holds for ``param`` (this rank's part of it: a flat tensor
        when the optimizer is partitioned, else shaped like ``param``)."""
        for s in self._slots:
            if s.param is param:
                break
        else:
            raise KeyError("this parameter is not stepped by this optimizer")
        self._engine.wait()
        parts = {k: [] for k in ("master", "exp_avg", "exp_avg_sq")}
        for i in s.engine_ids:
            n = self._engine.state_sizes[i]
            bufs = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
            self._engine.read_state(i, *bufs)
            for k, t in zip(parts, bufs):
                parts[k].append(t)
        out = {k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}
        if self._world == 1:
            shape = param._local_tensor.shape if self._dtensor is not None else _param_offload.full_shape(param)
            out = {k: v.view(shape) for k, v in out.items()}
        return out

    def __deepcopy__(self, memo):
        raise TypeError(
            "zoe.torch.OffloadOptimizer cannot be deep-copied: its state lives in zoe's engine (pinned memory or "
            "swap files) and the parameters it steps are views of its flat buffers, so a copy could not be "
            "independent. Create another OffloadOptimizer and load this one's state_dict() into it")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "zoe.torch.OffloadOptimizer cannot be pickled: its state lives in zoe's engine, not in the object. "
            "Save opt.state_dict() (torch.save) and load it into a new optimizer with load_state_dict()")

    def __del__(self):
        for h in getattr(self, "_hooks", []):
            h.remove()


# Checkpoints across runs of different sizes and out of zoe (_interop.py).
consolidate_state_dicts = _interop.consolidate
export_fp32 = _interop.export_fp32
