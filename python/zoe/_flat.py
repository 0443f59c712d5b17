"""The optimizer's state and flat buffers, behind one object (``FlatState``): the engine, where each
parameter's gradient lives in its dtype's flat buffer and where its weights are (``Slot``, ``Bucket``), and
how the state is partitioned — zoe's own data-parallel mode (_data_parallel.py) or FSDP2's shards
(_dtensor.py). The optimizer builds it; its
checkpoints (_state_dict.py), the interchange with torch's format (_interop.py) and ``opt.state``
(_state_view.py) read and write the state through it alone."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _dtensor, _param_offload, _rules

ZOE_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class Slot:
    """Where one parameter zoe holds state for lives in its dtype's flat buffers."""

    __slots__ = ("param", "index", "group", "offset", "numel", "shape", "tier", "windowed", "bucket", "grad_view",
                 "grad_ptr", "grads_at", "own_grad", "own_version", "weight_view", "engine_ids", "accumulated",
                 "taken", "flat_weights", "spilled")

    def __init__(self, param, index, group, offset):
        self.param = param
        self.index = index  # position in param-group order, as state_dict numbers parameters
        self.group = group
        self.offset = offset
        # An offloaded parameter's weights live in its parameter tier (zoe.torch.offload_parameters): p.data
        # is a placeholder between uses, and the engine writes the updated weights into the tier.
        self.tier = getattr(param, "_zoe_param_offload", None)  # (ParamOffload, block, entry)
        self.shape = _param_offload.full_shape(param)
        # (An FSDP2 shard in a tier is its local shard's size, as any DTensor's.)
        self.numel = (_dtensor.local_numel(param) if self.tier is None or _dtensor.is_dtensor(param)
                      else math.prod(self.shape))
        # Its gradient leaves the device as its backward ends, and its place in the bucket is a window that
        # every such parameter of the dtype uses in turn (OffloadOptimizer._build).
        self.windowed = False
        self.spilled = False  # spill_grads: this iteration's gradient went to the spill file (_dtensor.py)
        self.bucket = None  # its dtype's Bucket
        self.grad_view = None
        self.grad_ptr = 0  # grad_view's address: a p.grad.data = ... keeps the tensor and changes it
        # A gradient tensor of the trainer's (autograd's) in p.grad, taken at this version: read by the engine
        # where it is (grads_at, the address the engine reads this slot's gradient from) or copied.
        self.grads_at = 0
        self.own_grad = None
        self.own_version = 0
        self.weight_view = None  # p.data as the optimizer laid it: the parameter's own storage, contiguous
        # Under zoe's own partition (world > 1): its place in the bucket's flat weights, which the engine
        # all-gathers into and which are then copied into weight_view (FlatState.weights_to_params).
        self.flat_weights = None
        self.engine_ids: list[int] = []
        self.accumulated = 0  # backward passes that accumulated into this gradient since the last step
        self.taken = False  # the engine has read this iteration's gradient (reported, or for a norm)


def wants_state(p: torch.Tensor) -> bool:
    """Whether zoe makes state for a parameter it does not hold yet: it requires a gradient, or has one."""
    return p.requires_grad or p.grad is not None


class Lazy:
    """A parameter of the param groups that zoe holds nothing for yet (no state, no place in the flat
    gradient buffers): frozen when the engine was made. ``index``/``group`` as a Slot's; ``tier``: its
    parameter tier, if it is offloaded (whose prefetch and edit checks still follow the steps)."""

    __slots__ = ("param", "index", "group", "tier")

    def __init__(self, param, index, group):
        self.param = param
        self.index = index
        self.group = group
        self.tier = getattr(param, "_zoe_param_offload", None)


class Bucket:
    """The flat gradients of every trainable parameter of one dtype (and, under zoe's own partition, the flat
    weights it all-gathers into), and this rank's shard.

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
        # Padded to W x shard_numel elements: the engine reduces and gathers in these buffers. The weights are
        # flat only where zoe's own partition all-gathers them (world > 1); on one rank every parameter keeps
        # a storage of its own (docs/architecture.md, "The Python package": why).
        self.weights = torch.zeros(padded, dtype=dtype, device=device) if world > 1 else None
        self.grads = torch.zeros(padded, dtype=dtype, device=device)
        window = max((s.numel for s in slots if s.windowed), default=0)
        self.window = torch.zeros(window, dtype=dtype, device=device) if window else None

    def grad_buffer(self, s: Slot) -> torch.Tensor:
        return self.window if s.windowed else self.grads


class FlatState:
    """The engine and the flat buffers it reads gradients from, of one optimizer.

    ``engine``: the ``_zoe.Engine`` (None until the optimizer made it). ``slots``: every parameter held, in
    param-group order (``lazy``: the others, frozen since the engine was made, with no state yet);
    ``buckets``: one per dtype. ``world``/``rank``: zoe's own partition (1/0 without one; FSDP2's shards are
    a world of one to the engine, ``dtensor`` says where they lie). ``dp``: zoe's own
    data-parallel mode (``_data_parallel.DataParallel``), ``dtensor``: FSDP2's (``_dtensor.ShardedParams``),
    at most one of them. ``loss_scaling``: the engine scales an fp16 loss. ``hyper_sent``: the
    hyper-parameters the engine holds for each param group (None: unknown, sent again at the next step).
    ``rule``: the update rule the engine runs (_rules.py), whose state arrays ``states`` names."""

    def __init__(self):
        self.engine = None
        self.rule: _rules.TorchRule = _rules.ADAM
        self.slots: list[Slot] = []
        self.buckets: list = []
        self.dtensor: _dtensor.ShardedParams | None = None
        self.group = None  # zoe's partition's torch.distributed group
        self.world, self.rank = 1, 0
        self.dp = None
        self.loss_scaling = False
        self.hyper_sent: list[tuple | None] = []
        # The parameters zoe holds nothing for yet (Lazy), and which ones a rebuild holds (their ids; None: at
        # construction, those that want state).
        self.lazy: list[Lazy] = []
        self.hold: set[int] | None = None

    @property
    def spills(self) -> bool:
        """spill_grads: this iteration's gradients are in the engine's spill file, not in p.grad."""
        return self.dtensor is not None and self.dtensor.spills

    @property
    def whole(self) -> bool:
        """This rank's engine holds every parameter whole: one rank, no FSDP2 shards."""
        return self.world == 1 and self.dtensor is None

    def partition(self) -> tuple[int, int]:
        """(world size, rank) of the state this rank holds: zoe's partition, or FSDP2's shards."""
        return self.dtensor.ranks() if self.dtensor is not None else (self.world, self.rank)

    def collect_slots(self, param_groups) -> dict:
        """A slot for every parameter zoe holds, into ``slots``, and the others into ``lazy``; returns the
        slots by dtype."""
        slots_by_dtype: dict[torch.dtype, list[Slot]] = {}
        index = 0
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.is_sparse or p.layout != torch.strided:
                    raise ValueError(f"parameter {index} (shape {tuple(p.shape)}) is sparse: zoe steps dense tensors")
                # A frozen parameter (requires_grad=False, no gradient) gets no state and no gradient buffer
                # until it is unfrozen, as torch's optimizers make state at a parameter's first step: LoRA's
                # base would otherwise cost 12 bytes per element for nothing (_lazy.py makes it later).
                if not (wants_state(p) if self.hold is None else id(p) in self.hold):
                    self.lazy.append(Lazy(p, index, gi))
                elif p.dtype in ZOE_DTYPES:
                    bucket = slots_by_dtype.setdefault(p.dtype, [])
                    slot = Slot(p, index, gi, sum(s.numel for s in bucket))
                    bucket.append(slot)
                    self.slots.append(slot)
                elif p.requires_grad:
                    raise TypeError(f"parameter {index} (shape {tuple(p.shape)}) is {p.dtype}; zoe handles "
                                    "float32, float16 and bfloat16")
                index += 1
        return slots_by_dtype

    def slot_of(self, param) -> Slot | None:
        return next((s for s in self.slots if s.param is param), None)

    def layout(self, param_groups) -> list:
        """What a state_dict records of each parameter: its full shape, dtype and requires_grad (and, for FSDP2,
        this rank's shard)."""
        extra = self.dtensor.describe if self.dtensor is not None else lambda p: []
        return [[list(_param_offload.full_shape(p)), str(p.dtype), bool(p.requires_grad)] + extra(p)
                for g in param_groups for p in g["params"]]

    def hyper_unknown(self, groups: int) -> None:
        """After a load: the param groups are the loaded ones, sent to the engine at the next step."""
        self.hyper_sent = [None] * groups

    def pieces(self) -> list[tuple]:
        """The engine's parameters in its order (engine_specs'): (slot, first element within the parameter,
        elements) of each slot's part of this rank's shard of its bucket."""
        out = []
        for b in self.buckets:
            lo, hi = self.rank * b.shard_numel, (self.rank + 1) * b.shard_numel
            for s in b.slots:
                if s.numel == 0:
                    continue  # not in the engine (engine_specs)
                if s.windowed:  # not partitioned (one rank), and not in the flat buffers
                    out.append((s, 0, s.numel))
                    continue
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    out.append((s, a - s.offset, z - a))
        return out

    def engine_specs(self, param_groups) -> tuple[list, list]:
        """The engine's parameters (specs) and those whose weights are in a parameter tier (tiered), as
        ``_zoe.Engine`` takes them; numbers each slot's pieces (``engine_ids``) in the engine's order."""
        specs, tiered = [], []
        # Recorded in zoe's checkpoints for zoe export: the names of an optimizer built from named_parameters().
        names = {}
        index = 0
        for g in param_groups:
            for k, _ in enumerate(g["params"]):
                if "param_names" in g:
                    names[index] = g["param_names"][k]
                index += 1
        pieces = 0  # the engine's parameters, which read_state() names: this rank's pieces of the slots
        for b in self.buckets:
            lo, hi = self.rank * b.shard_numel, (self.rank + 1) * b.shard_numel
            for s in b.slots:
                if s.numel == 0:
                    continue  # nothing to step, and nothing of it in the engine (torch keeps empty moments)
                shape = list(s.param._local_tensor.shape if self.dtensor is not None else s.shape)
                if s.tier is not None:
                    offload, block, entry = s.tier
                    tiered.append((len(specs), offload.tier, block, entry))
                    weights = None
                elif self.dtensor is not None:  # A DTensor's shard is FSDP2's own storage, stepped in place.
                    weights = self.dtensor.local_weights(s)
                else:
                    weights = s.flat_weights if s.flat_weights is not None else s.weight_view.reshape(-1)
                buffer = b.grad_buffer(s)  # None: spilled gradients, given with their reports
                grads = None if buffer is None else buffer[s.offset:s.offset + s.numel]
                specs.append((s.numel, ZOE_DTYPES[b.dtype], weights, grads, s.group, names.get(s.index, ""), shape))
                if s.windowed or max(lo, s.offset) < min(hi, s.offset + s.numel):
                    s.engine_ids.append(pieces)
                    pieces += 1
        return specs, tiered

    @property
    def states(self) -> tuple[str, ...]:
        """The state arrays beside the master, by torch's keys in the engine's order (Adam: exp_avg, exp_avg_sq)."""
        return self.rule.states

    def read_arrays(self, i: int, arrays: list) -> None:
        """Engine parameter ``i``'s master and state arrays into ``arrays`` (fp32, one per ``"master", *states``);
        the engine's read_state takes None for the arrays a rule does not have."""
        self.engine.read_state(i, *arrays, *[None] * (3 - len(arrays)))

    def write_arrays(self, i: int, arrays) -> None:
        """``read_arrays``' counterpart: engine parameter ``i``'s master and state arrays replaced."""
        self.engine.write_state(i, *arrays, *[None] * (3 - len(arrays)))

    def read_state(self, s: Slot) -> dict[str, torch.Tensor]:
        """The fp32 master weights and the rule's state arrays of a slot's pieces on this rank, flat (the
        engine's work in flight waited for)."""
        self.engine.wait()
        parts = {k: [] for k in ("master", *self.states)}
        for i in s.engine_ids:
            n = self.engine.state_sizes[i]
            bufs = [torch.empty(n, dtype=torch.float32) for _ in parts]
            self.read_arrays(i, bufs)
            for k, t in zip(parts, bufs):
                parts[k].append(t)
        return {k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}

    @torch.no_grad()
    def fill_buckets(self) -> None:
        """The parameters' gradients into the flat buffers (``p.grad`` a view of them where it is set), each
        parameter's weights kept in a contiguous storage of its own (and, under zoe's partition, copied into
        the flat weights it all-gathers into)."""
        for b in self.buckets:
            for s in b.slots:
                if s.tier is None:
                    # The parameter's own storage, which the engine writes in place: safetensors, Accelerate
                    # and torch.save see the model's tensors as the model made them (tied ones stay one).
                    if not s.param.data.is_contiguous():
                        s.param.data = s.param.data.contiguous()
                    s.weight_view = s.param.data
                    if b.weights is not None:  # zoe's own partition gathers into its flat weights
                        s.flat_weights = b.weights[s.offset:s.offset + s.numel]
                        s.flat_weights.copy_(s.weight_view.reshape(-1))
                s.grad_view = b.grad_buffer(s)[s.offset:s.offset + s.numel].view(s.shape)
                s.grad_ptr = s.grads_at = s.grad_view.data_ptr()
                # A gradient there already is taken in; a None stays None (not stepped, as with torch).
                if s.param.grad is not None:
                    s.grad_view.copy_(s.param.grad)
                if s.param.grad is not None or s.windowed:
                    _param_offload.set_grad(s.param, s.grad_view)
            if self.world > 1:
                # Every rank starts from rank 0's weights, as DistributedDataParallel does.
                dist.broadcast(b.weights, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.weights_to_params()

    def gather_weights(self) -> None:
        """Every rank's shard of the weights into every rank's buckets (a write of the state set this rank's
        only)."""
        for b in self.buckets:
            shard = b.weights[self.rank * b.shard_numel:(self.rank + 1) * b.shard_numel].clone()
            self.dp.collectives.gather_tensor(b.weights, shard)
        self.weights_to_params()

    def weights_to_params(self) -> None:
        """Under zoe's own partition: the flat weights the engine all-gathered into, copied into the
        parameters' own storages, one batched copy per dtype. Written through ``p.data``'s alias, so torch's
        version counter of ``p`` (which tells a trainer's edit, _weight_edits.py) does not move."""
        for b in self.buckets:
            if b.weights is None:
                continue
            slots = [s for s in b.slots if s.flat_weights is not None]
            if slots:
                torch._foreach_copy_([s.weight_view.view(-1) for s in slots], [s.flat_weights for s in slots])
