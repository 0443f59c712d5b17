"""Parameter offload for FSDP2 models (``fully_shard``): each rank's local shards live in its own parameter tier
(pinned RAM, or NVMe files under ``nvme_path/rank<r>``), one tier block per FSDP parameter group, and reach
the device only while FSDP all-gathers them.

How. FSDP2 asks a sharded parameter's local tensor for its all-gather input through the tensor-subclass
extension ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, every time it all-gathers: forward, backward,
prefetch, explicit ``unshard()``, activation-checkpoint recompute. Here the local tensor is a ``TierShard``, a
tensor with metadata and no bytes; its pre-all-gather fetches the group's block from the tier (the tier reads
ahead along the recorded order, reversed in backward) and hands FSDP a view of the block, which FSDP copies
into its all-gather buffer — the view's storage holds the fetch (``_Lease``), so the block is released as
soon as FSDP has copied it. FSDP's all-gather output is the unsharded parameter, as without the extension.

The optimizer. zoe's OffloadOptimizer steps the DTensor parameters as local shards (_dtensor.py); a shard in
a tier is stepped as an offloaded parameter is: the engine reads its gradient from the flat buffer FSDP
reduce-scatters into and writes the updated 16-bit shard into its tier entry. Sync schedule only, as for every
DTensor model.

What torch does not promise. The extension is public, but making the local tensor one is not: this assigns
the DTensor's ``_local_tensor`` and ``FSDPParam._sharded_param_data`` (FSDP pads uneven shards through
``new_zeros``/``narrow``/``copy_`` on the latter, which ``TierShard`` answers without bytes) and calls
``FSDPParam._init_extensions``. So the torch versions are pinned (``TESTED_TORCH``) and
tests/python/test_fsdp_offload.py is the conformance test.

Reading outside training. Logging, evaluation and state_dict code read parameters between steps:
``p.full_tensor()``, ``p.to_local()`` and its reads (``clone``, ``sum``, ``norm``, comparisons, ``numpy``),
``model.state_dict()``'s values, ``torch.save`` of them. A view of a TierShard (``detach``, ``view``, indexing,
``t()``...) is a TierShard over the same entry, its geometry worked out on a meta tensor. An op that only reads
TierShards (no argument its schema marks written) runs on their values, read from the tier's home into tensors
of their own (``ShardOffload.values``, as ``weights(p)`` reads): never fetched into the pool, so a read, in or
outside forward and backward, takes no room there, counts no fetch or hit and is no part of the recorded order.
What it returns is plain and aliases no tier memory (``full_tensor()``'s all-gather runs on the values); it is a
snapshot, which later steps do not change. Pickling a TierShard pickles its values, so ``torch.save(
model.state_dict())`` saves DTensors with plain local tensors. An op that would write a TierShard (in place,
``out=``, through a view, ``p.data``, ``load_state_dict``) is refused, naming the parameter: outside
``gathered()`` the change would be lost.

Checkpoints. Inside ``gathered()`` (or the read-only ``materialize()``) the shards are FSDP's plain tensors
again, so torch.distributed.checkpoint saves and loads them as it does any FSDP2 model's: the checkpoint is a
plain FSDP2 one, loadable on another world size and without zoe.

With FSDP2's ``CPUOffloadPolicy`` the reduce-scattered gradients go to the host as each group's backward
ends (their way off the GPU); the shards' "CPU offload" is the tier's.

Not yet: an integer ``reshard_after_forward`` (FSDP2 has no
extension path for it), and checkpoints streamed group by group (``gathered()`` holds the rank's whole
shard). A model created on the meta device is initialised group by group (``init``), never whole."""
from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from . import _zoe
from ._offload_blocks import DTYPES, contiguous_strides, storage_view
from ._tier_blocks import TierBlocks, in_backward

__all__ = ["ShardOffload", "TierShard", "TESTED_TORCH"]

# (major, minor) of the torch releases whose FSDP2 internals this module was tested against, lowest and highest.
TESTED_TORCH = ((2, 11), (2, 15))

_aten = torch.ops.aten


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


class _Holds:
    """What the bytes under a TierShard are, shared by the TierShards that view one another: the tier entry's
    (``entry``), or the zeros of the tensor FSDP pads a shard in until it copies the shard into it."""

    __slots__ = ("entry",)

    def __init__(self, entry: bool):
        self.entry = entry


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype


def _end_bytes(t: torch.Tensor) -> int:
    """Bytes from the start of the tensor's storage to the end of its last element."""
    if not t.numel():
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _written(func, args, kwargs) -> "TierShard | None":
    """A TierShard that the op would write (an argument its schema marks mutable: in place, ``out=``)."""
    schema = func._schema
    if not schema.is_mutable:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for leaf in tree_leaves(value):
                if isinstance(leaf, TierShard):
                    return leaf
    return None


class TierShard(torch.Tensor):
    """A local shard whose bytes are in a parameter tier: shape, dtype, device and its place in the entry
    (strides, offset), no storage. FSDP2 fetches it through ``fsdp_pre_all_gather``. Other ops (see the module
    docstring): a view of it is a TierShard over the same entry; an op that only reads it runs on its values
    read from the tier; an op that would write it is refused, naming the parameter."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results stay plain tensors

    @staticmethod
    def __new__(cls, home: "ShardOffload", block: int, entry: int, size, dtype, device, stride=None, offset=0,
                holds: _Holds | None = None):
        size = torch.Size(size)
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride or contiguous_strides(size),
                                                storage_offset=offset, dtype=dtype, device=device,
                                                requires_grad=False)
        t._home, t._block, t._entry = home, block, entry
        t._holds = holds if holds is not None else _Holds(True)
        return t

    def _like(self, like: torch.Tensor, device=None, holds: _Holds | None = None) -> "TierShard":
        """A TierShard over the same entry with ``like``'s geometry (a meta tensor's)."""
        return TierShard(self._home, self._block, self._entry, like.shape, like.dtype, device or self.device,
                         like.stride(), like.storage_offset(), holds or self._holds)

    def _meta(self) -> torch.Tensor:
        """A meta tensor of this one's geometry, on a storage as long as the entry (or as this one reaches)."""
        nbytes = max(self._home.entry_bytes(self), _end_bytes(self))
        storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        return torch.empty(0, dtype=self.dtype, device="meta").set_(storage, self.storage_offset(), self.shape,
                                                                    self.stride())

    def _pads(self, size, kwargs) -> bool:
        """``new_zeros(size, **kwargs)`` is FSDP's padding of this shard: the whole entry, longer along dim 0."""
        return (self._home.whole(self) and len(size) == self.dim() and size[0] >= self.shape[0]
                and tuple(size[1:]) == self.shape[1:] and kwargs.get("dtype") in (None, self.dtype)
                and kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory")
                and self._home.is_home_device(kwargs.get("device") or self.device))

    def __repr__(self) -> str:
        return f"TierShard(block={self._block}, entry={self._entry}, size={tuple(self.shape)}, dtype={self.dtype})"

    # Outside torch's dispatch: reads give the values, a NumPy array read-only (torch's shares the memory).
    def __reduce_ex__(self, protocol):
        # torch.save of model.state_dict() pickles each DTensor with its local tensor: the shard's values.
        return self._home.values(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        copy = memo[id(self)] = self._home.values(self).requires_grad_(self.requires_grad)
        return copy

    def tolist(self):
        return self._home.values(self).tolist()

    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        if self.device.type != "cpu" and not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        array = self._home.values(self).cpu().numpy()
        array.flags.writeable = False
        return array

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._home.all_gather_input(self, mp_policy.param_dtype),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:
            return None  # FSDP gathered into the same output tensors again, which `out` already views
        return (data if data.dtype == param_dtype else data.to(param_dtype)), ()

    def _fsdp_op(self, func, args, kwargs):
        """FSDP's own ops on a shard that are not reads, answered without bytes; NotImplemented for others."""
        if func in (_aten.detach.default, _aten.alias.default):
            return TierShard(self._home, self._block, self._entry, self.shape, self.dtype, self.device,
                             self.stride(), self.storage_offset(), self._holds)
        if func is _aten._to_copy.default and set(kwargs) <= {"device", "non_blocking"} and \
                self._home.is_home_device(kwargs.get("device", self.device)):
            # CPUOffloadPolicy moves the shard to the device before asking for its all-gather input: the fetch
            # puts it there.
            return self._like(self, device=self._home._device)
        if func is _aten.is_pinned.default:
            return True  # FSDP's pin_memory: the tier's home and pool are pinned where pinning exists
        if func is _aten.new_zeros.default and self._pads(args[1], kwargs):
            # FSDP pads an uneven shard to the padded size: zeros, until it copies the shard into them.
            return self._like(torch.empty(args[1], dtype=self.dtype, device="meta"), holds=_Holds(False))
        if func is _aten.copy_.default and isinstance(args[1], TierShard) and args[1]._holds.entry and \
                (args[1]._home, args[1]._block, args[1]._entry) == (self._home, self._block, self._entry) and \
                _geometry(args[1]) == _geometry(self):
            self._holds.entry = True  # the padding's copy of the shard into its own place
            return self
        return NotImplemented

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], TierShard) else None
        if me is not None:
            done = me._fsdp_op(func, args, kwargs)
            if done is not NotImplemented:
                return done
        written = _written(func, args, kwargs)
        if written is not None:
            raise RuntimeError(
                f"zoe parameter offload: {func} would write to the local shard of "
                f"'{written._home.param_name(written)}', whose bytes are in zoe's parameter tier (offload_parameters "
                "on an FSDP2 model): the change would be lost. Change it inside `with offload.gathered():` (written "
                "back on exit), update it through zoe's OffloadOptimizer, or offload.remove() first")
        if me is not None and (func is _aten._unsafe_view.default or
                               any(r.alias_info is not None for r in func._schema.returns)):
            # A view stays a TierShard over the entry (a write through it is refused too): its geometry is the
            # op's on a meta tensor.
            out = func(*tree_map_only(TierShard, TierShard._meta, args),
                       **tree_map_only(TierShard, TierShard._meta, kwargs))
            return tree_map_only(torch.Tensor, me._like, out)
        # A read: the op runs on the shards' values, copies of the tier's bytes, so nothing it returns aliases the
        # tier's memory.
        return func(*tree_map_only(TierShard, lambda t: t._home.values(t), args),
                    **tree_map_only(TierShard, lambda t: t._home.values(t), kwargs))


def _groups(model: nn.Module) -> tuple[list[tuple[str, object]], dict[int, str]]:
    """(module name, FSDPParamGroup) of every fully_shard module of the model with parameters, in module order;
    and each FSDPParam's parameter name by id (FSDP sets its own only at its lazy initialisation)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise _zoe.UnsupportedError(
            "offload_parameters: the model's parameters are DTensors but the model itself is not wrapped with "
            "fully_shard; zoe offloads FSDP2 shards per FSDP parameter group: apply fully_shard to the blocks and "
            "then to the root module. Nothing was changed.")
    groups = []
    owned = set()
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append((name or "<root>", group))
                owned.update(id(fp.sharded_param) for fp in group.fsdp_params)
    stray = [n for n, p in model.named_parameters() if id(p) not in owned]
    if stray:
        raise _zoe.UnsupportedError(
            f"offload_parameters: parameter {stray[0]!r} ({len(stray) - 1} more) is not managed by fully_shard "
            "(a tensor-parallel or hand-made DTensor): zoe offloads FSDP2's shards only. Nothing was changed.")
    by_param = {id(p): n for n, p in model.named_parameters()}
    names = {id(fp): by_param.get(id(fp.sharded_param), "?") for _, g in groups for fp in g.fsdp_params}
    return groups, names


def _check(groups, names: dict[int, str]) -> None:
    lo, hi = TESTED_TORCH
    if not lo <= _torch_version() <= hi:
        raise _zoe.UnsupportedError(
            f"offload_parameters: torch {torch.__version__} is outside the range zoe's FSDP2 parameter offload was "
            f"tested with ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}); it relies on FSDP2 internals that change between "
            "releases. Use a tested torch. Nothing was changed.")
    for name, group in groups:
        for fp in group.fsdp_params:
            what = None
            if fp.post_forward_mesh_info not in (None, fp.mesh_info):
                what = ("reshards to a smaller mesh after forward (an integer reshard_after_forward), which FSDP2 "
                        "does not do for shards fetched through its all-gather extension — pass True or False")
            elif hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                what = "has an all-gather extension already (offloaded, or another subclass such as float8)"
            if what:
                raise _zoe.UnsupportedError(
                    f"offload_parameters: parameter {names[id(fp)]!r} of fully_shard module '{name}' {what}. "
                    "Nothing was changed.")


class ShardOffload(TierBlocks):
    """Each rank's FSDP2 local shards in its parameter tier (see the module docstring). ``blocks``:
    ``[(module name, [FSDPParam])]`` by block; each offloaded DTensor parameter carries ``p._zoe_param_offload =
    (self, block, entry)``. A shard with no element on this rank stays FSDP's."""

    def __init__(self, model: nn.Module, home: str, nvme_paths: list[str], prefetch: int, budget_bytes: int,
                 tier_factory=None, init: Callable[[nn.Module], None] | None = None, keep_files: bool = False):
        groups, self._fqn = _groups(model)
        _check(groups, self._fqn)
        self.blocks = []
        modules = []  # each block's modules, for init
        for name, group in groups:
            entries = [fp for fp in group.fsdp_params
                       if fp._sharded_local_tensor.numel() and fp._sharded_local_tensor.dtype in DTYPES]
            if entries:
                self.blocks.append((name, entries))
                modules.append(group.modules)
        if not self.blocks:
            raise ValueError("offload_parameters: this rank holds no float16/bfloat16/float32 shard element")
        on_meta = any(fp._sharded_local_tensor.is_meta for _, fps in self.blocks for fp in fps)
        if on_meta != (init is not None):
            raise ValueError("offload_parameters: " + (
                "the model's shards are on the meta device: pass init, a function that initialises one module's "
                "own parameters and buffers (e.g. lambda m: m.reset_parameters() if hasattr(m, "
                "'reset_parameters') else None, or a Hugging Face model's _init_weights)" if on_meta else
                "init is for models created on the meta device, whose shards it initialises group by group"))
        device = self.blocks[0][1][0].device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        rank = dist.get_rank()
        paths = [os.path.join(p, f"rank{rank}") for p in nvme_paths]
        made = [p for p in paths if not os.path.isdir(p)]  # removed with the files (empty), or on a refusal
        for p in paths:
            os.makedirs(p, exist_ok=True)
        entry_bytes = [[fp._sharded_local_tensor.numel() * fp._sharded_local_tensor.element_size() for fp in fps]
                       for _, fps in self.blocks]
        self._entry_bytes = entry_bytes
        try:
            self._make_tier(device, entry_bytes, [n for n, _ in self.blocks], home, paths, budget_bytes, prefetch,
                            tier_factory, keep_files, made)
        except BaseException:
            for p in reversed(made):
                try:
                    os.rmdir(p)
                except OSError:
                    pass
            raise
        self._offsets = [[int(self.tier.entry_offset(b, e)) for e in range(len(fps))]
                         for b, (_, fps) in enumerate(self.blocks)]
        self._shapes = {}
        self._gathering: dict[int, list] = {}  # block -> [its fetched storage, entries not yet handed to FSDP]
        self._order: list[int] | None = []  # blocks in the first forward's order, until handed to the tier
        self._plain = False  # inside gathered(): the shards are plain tensors of FSDP's
        self._copy_streams: dict[int, object] = {}  # block -> the CUDA stream its last fetch was copied on
        self._take_shards(modules, init)
        self._model = model
        self._handle = model.register_forward_hook(self._end_of_forward, always_call=True)

    def _take_shards(self, modules: list, init: Callable[[nn.Module], None] | None) -> None:
        """Writes the shards into the tier group by group and gives FSDP TierShards in their place. With
        ``init`` (shards on the meta device) each group's shards are made, initialised and written in turn: a
        rank's whole shard is never in memory. Undone if any group fails: FSDP keeps the shards it had."""
        taken = {}
        try:
            for b, (_, fps) in enumerate(self.blocks):
                for fp in fps:
                    taken[fp] = (fp.sharded_param, fp._sharded_local_tensor)
                if init is not None:
                    self._initialise(fps, modules[b], init)
                for e, fp in enumerate(fps):
                    local = fp._sharded_local_tensor
                    self.tier.write(b, e, local.detach().to("cpu").contiguous())
                    self._install(fp, TierShard(self, b, e, local.shape, local.dtype, self._device))
        except BaseException:
            for fp, (param, local) in taken.items():
                if fp.sharded_param is not param:  # made from the meta device
                    fp._setattr_on_modules(param)
                    fp.sharded_param = param
                self._install(fp, local)
            raise
        for b, (_, fps) in enumerate(self.blocks):
            for e, fp in enumerate(fps):
                fp.sharded_param._zoe_param_offload = (self._mark, b, e)
                self._shapes[fp.sharded_param] = fp.sharded_param.shape

    def _initialise(self, fps: list, modules, init: Callable[[nn.Module], None]) -> None:
        """One group's shards made on its device and ``init`` run on its modules (down to the next fully_shard
        module), with their meta buffers made too."""
        from torch.distributed.fsdp import FSDPModule

        for fp in fps:
            # A new parameter, as FSDP makes one when a meta model is moved (to_empty): the DTensor's own
            # device is meta too.
            meta = fp._sharded_local_tensor
            local = torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
            fp._setattr_on_modules(nn.Parameter(fp.to_sharded_dtensor(local),
                                                requires_grad=fp.sharded_param.requires_grad))
            fp.reset_sharded_param()
        stack = list(modules)
        with torch.no_grad():
            while stack:
                m = stack.pop()
                for name, buf in m.named_buffers(recurse=False):
                    if buf is not None and buf.is_meta:
                        m._buffers[name] = torch.empty_like(buf, device=self._device)
                init(m)
                stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))

    def _where_fsdp_keeps(self, fp, shard: torch.Tensor) -> torch.Tensor:
        """A shard read from the tier (a CPU tensor) where FSDP keeps its shards: on the device, or with
        CPUOffloadPolicy on the CPU, pinned if its pin_memory says so."""
        if not fp.offload_to_cpu:
            return shard.to(self._device)
        return shard.pin_memory() if fp.pin_memory else shard

    @staticmethod
    def _install(fp, local: torch.Tensor) -> None:
        """Makes ``local`` (unpadded) the FSDPParam's shard, padded as FSDP keeps it (pinned if it is)."""
        padded = local.new_zeros(fp.padded_sharded_param_size)
        if not isinstance(local, TierShard) and local.is_pinned():
            padded = padded.pin_memory()
        if local.numel():
            padded.narrow(0, 0, local.shape[0]).copy_(local)
        fp._sharded_param_data = padded.view(-1)
        fp.sharded_param._local_tensor = padded.narrow(0, 0, local.shape[0])
        fp._init_extensions()

    # -- FSDP's all-gather -------------------------------------------------------------------------------

    def _fetch(self, block: int, backward: bool) -> torch.UntypedStorage:
        storage = super()._fetch(block, backward)
        if self._device.type == "cuda":
            # FSDP copies the view into its all-gather buffer on the stream current now (its copy-in stream;
            # with one rank, the current one); the release (when the view dies, perhaps with another stream
            # current) is ordered after that copy.
            self._copy_streams[block] = torch.cuda.current_stream(self._device)
        return storage

    def _release(self, block: int, address: int) -> None:
        stream = self._copy_streams.get(block)
        if stream is None:
            super()._release(block, address)
            return
        with torch.cuda.stream(stream):
            super()._release(block, address)

    def all_gather_input(self, shard: TierShard, param_dtype) -> torch.Tensor:
        """The shard's bytes for FSDP's all-gather, padded to FSDP's padded size and cast to its param_dtype.
        The group's block is fetched once per all-gather: its first shard fetches, the others share it."""
        b, e = shard._block, shard._entry
        gathering = self._gathering.get(b)
        if gathering is None or e not in gathering[1]:
            gathering = self._gathering[b] = [self._fetch(b, in_backward()), set(range(len(self.blocks[b][1])))]
            if self._order is not None and b not in self._order and not in_backward():
                self._order.append(b)
        storage, left = gathering
        left.discard(e)
        if not left:
            del self._gathering[b]  # FSDP holds the views until its copy into the all-gather buffer
        fp = self.blocks[b][1][e]
        view = storage_view(storage, self._offsets[b][e], shard.dtype, shard.shape, contiguous_strides(shard.shape))
        dtype = param_dtype or shard.dtype
        if view.shape == fp.padded_sharded_param_size and dtype == shard.dtype:
            return view
        out = torch.zeros(fp.padded_sharded_param_size, dtype=dtype, device=view.device)
        out.narrow(0, 0, view.shape[0]).copy_(view)
        return out

    def _end_of_forward(self, module, args, output) -> None:
        if self._order is None or in_backward() or self.tier is None:
            return
        if output is None:  # the forward raised (always_call): record the order next time
            self._order = []
        elif self._order:
            self._set_order(self._order)
            self._order = None

    # -- reading and removing ----------------------------------------------------------------------------

    def param_name(self, shard: TierShard) -> str:
        return self._fqn[id(self.blocks[shard._block][1][shard._entry])]

    def check_edits(self) -> None:
        """Nothing to refuse here: a write to a shard in the tier fails at the op (TierShard)."""

    def weights(self, p: torch.Tensor) -> torch.Tensor:
        """An offloaded parameter's local shard as the tier holds it, in a CPU tensor."""
        b, e = self.param_location(p)
        local = p._local_tensor
        out = torch.empty(local.shape, dtype=local.dtype)
        self._live_tier().read(b, e, out)
        return out

    # -- a shard read outside FSDP's all-gather (TierShard's reads) ------------------------------------------

    def entry_bytes(self, shard: TierShard) -> int:
        return self._entry_bytes[shard._block][shard._entry]

    def whole(self, shard: TierShard) -> bool:
        """The shard is its whole entry, as FSDP keeps it (not a view of part of it, nor FSDP's padding)."""
        return (shard._holds.entry and shard.storage_offset() == 0 and shard.is_contiguous()
                and shard.numel() * shard.element_size() == self.entry_bytes(shard))

    def is_home_device(self, device) -> bool:
        """``device`` is the one FSDP computes on, where the tier fetches to (an index left out: the current)."""
        device = torch.device(device)
        return device.type == self._device.type and device.index in (None, self._device.index)

    def values(self, shard: TierShard) -> torch.Tensor:
        """The shard's values on its device: the entry read from the tier's home into a tensor of its own (not
        fetched into the pool: a read outside training changes neither the recorded order nor the pool's
        use, and counts no fetch), viewed as the shard views the entry; zeros where FSDP's padding is."""
        if self.tier is None:
            raise RuntimeError(self._gone() + (": the shard has no bytes" if self._closed else
                               ": a shard taken from the model before remove() has no bytes; read the parameter "
                               "again"))
        entry = self.entry_bytes(shard)
        room = torch.empty(max(entry, _end_bytes(shard)), dtype=torch.uint8)
        if shard._holds.entry:
            self.tier.read(shard._block, shard._entry, room[:entry])
            room[entry:].zero_()
        else:
            room.zero_()
        out = storage_view(room.untyped_storage(), shard.storage_offset() * shard.element_size(), shard.dtype,
                           shard.shape, shard.stride())
        return out if shard.device.type == "cpu" else out.to(shard.device)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = True):
        """Gives every offloaded shard back to FSDP as a plain tensor on its device, read from the tier, for the
        block's duration: what reads or writes the model's weights — ``get_state_dict`` and ``dcp.save``,
        ``dcp.load`` and ``set_state_dict``, ``model.load_state_dict``, ``nn.init`` — runs inside it. On exit
        (unless ``write_back`` is False, or the block raised) each shard is written back to the tier, and the
        tier takes the shards again. The whole rank's shard is in memory meanwhile. zoe's optimizer takes what
        the block changed into its master weights at its next step, element by element: loading its own
        checkpoint inside or after the block keeps the loaded masters."""
        if self.tier is None:
            raise RuntimeError(self._gone())
        if self._live or self._gathering or self._plain:
            raise RuntimeError("zoe parameter offload: gathered() during an all-gather, or inside gathered()")
        shards = {}
        for b, (_, fps) in enumerate(self.blocks):
            for e, fp in enumerate(fps):
                shards[fp] = fp._sharded_local_tensor
                self._install(fp, self._where_fsdp_keeps(fp, self.weights(fp.sharded_param)))
        self._plain = True
        done = False
        try:
            yield self
            done = True
        finally:
            if done and write_back:
                self._write_backs += 1  # first: a write that fails part-way has still changed some shards
            try:
                for b, (_, fps) in enumerate(self.blocks):
                    for e, fp in enumerate(fps):
                        if done and write_back:
                            self.tier.write(b, e, fp._sharded_local_tensor.detach().to("cpu").contiguous())
            finally:
                for fp, shard in shards.items():
                    self._install(fp, shard)
                self._plain = False

    def materialize(self):
        """``gathered(write_back=False)``: the shards as FSDP's plain tensors, to read (``get_state_dict`` and
        ``dcp.save``). Reads outside it work too, each reading the shards it needs from the tier (TierShard)."""
        return self.gathered(write_back=False)

    def remove(self) -> None:
        """Gives every shard back to FSDP as a tensor on its device (read from the tier) and frees the tier (its
        files with it, unless keep_files). A second call does nothing."""
        if self.tier is None and not self._closed:
            return
        self._live_tier()
        self._refuse_while_written()
        if self._live or self._gathering or self._plain:
            raise RuntimeError("zoe parameter offload: remove() during an all-gather, or inside gathered()")
        for _, fps in self.blocks:
            for fp in fps:
                p = fp.sharded_param
                self._install(fp, self._where_fsdp_keeps(fp, self.weights(p)))
                del p._zoe_param_offload
        self._handle.remove()
        self._close_tier()

    def close(self) -> None:
        if self.tier is not None and (self._gathering or self._plain):
            raise RuntimeError("zoe parameter offload: close() during an all-gather, or inside gathered()")
        super().close()

    close.__doc__ = TierBlocks.close.__doc__

    def __repr__(self) -> str:
        return f"ShardOffload({len(self.blocks)} blocks, {sum(self._block_bytes)} bytes on rank {dist.get_rank()})"
