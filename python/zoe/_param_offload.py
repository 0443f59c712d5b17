"""Parameter offload (ZeRO-Infinity style): a model's weights live in a zoe parameter tier (pinned RAM or an
NVMe file) and occupy device memory only while a module uses them.

Blocks. The parameters are grouped into blocks, the unit the tier moves: by default one block per module,
holding the module's own parameters (``recurse=False``) in registration order; a parameter shared by several
modules (tied weights) belongs to the first. A module's forward fetches every block its own parameters are
in, so a module using a weight tied to another module's block fetches that block too. Models whose forward
reads a child's weights without calling the child (``zoe.demo``'s GPT reads ``self.qkv.weight``) name the
modules that group their subtree into one block with ``block_modules``.

Between uses ``p.data`` is an empty placeholder and the weights are in the tier. A forward pre-hook fetches
the module's blocks into the device pool and points each ``p.data`` at its slice of the block; the forward
post-hook puts the placeholders back.

Why saved-tensor hooks. Autograd keeps what backward needs (a linear layer's weight, ``tok.t()`` of a tied
head) as saved tensors. A saved parameter is the parameter object itself, whose ``.data`` is the placeholder
by the time backward runs, and a saved view holds pool memory that the tier may have given to another block.
So while the model's forward runs, a ``torch.autograd.graph.saved_tensors_hooks`` pair packs every saved
tensor that lies in a fetched block as a handle (block, byte offset, dtype, size, stride) and unpacks it in
backward by fetching the block again (its address may have changed) and rebuilding the view. Nothing saved
for backward holds pool memory, so the post-hook can give the block back at once, and backward fetches
blocks in the order the engine needs them.

When the tier gives memory back. Every ``tier.fetch`` is owned by the storage of the tensors built on its
address: the object through which torch reads that memory carries a lease, and the lease releases the
block when the storage dies. A block therefore stays in use exactly as long as some tensor can read it:
``p.data`` between the hooks, an unpacked saved tensor while its backward node runs, activations that
``torch.utils.checkpoint`` recomputes in backward and keeps until they are used, a view a forward returned.
That makes a fetch and its release pair up whatever path autograd takes (``torch.autograd.grad``,
reentrant and non-reentrant checkpointing, retained graphs), without tracking each module's backward.

Gradients. The autograd node that accumulates ``p.grad`` (AccumulateGrad) reads ``p``'s strides when it
creates ``p.grad``, so ``p.data`` must hold the full weights then: a pre-hook on that node fetches the block
and a post-hook puts the placeholder back. The node is held for the life of the offload, so the same node
(and its shape, recorded while the weights were full) serves every iteration. ``p.grad`` keeps its full
shape while ``p.data`` is a placeholder; torch does not compare them on ``.data`` assignment.

Checkpointing. ``torch.utils.checkpoint`` installs saved-tensor hooks of its own inside the region, which
take precedence; its recomputation in backward keeps detached aliases of the weights, whose leases hold
the blocks until checkpoint consumes them. The reentrant variant recomputes with no hooks installed, so a
module whose forward runs with no saved-tensor hooks in place installs this module's pair itself. Hooks a
trainer installs around the forward (``save_on_cpu``) take precedence likewise; what they keep of a block
keeps the block in use.

What the tier must guarantee: the address ``fetch`` returns holds the block for torch's work that follows
(on the host for a CPU model, on the current stream for CUDA), and ``release`` — called from whichever
thread frees the last tensor on the block, autograd's device thread included — lets the memory be reused
only after torch's work enqueued before it.

Optimizers. zoe's ``OffloadOptimizer`` steps the weights in the tier and, on a GPU, takes each gradient off
the device as soon as it is accumulated, so that gradients too take one window of device memory (torch.py). A torch optimizer needs full tensors:
``with offload.gathered(): opt.step()`` gives every parameter its full weights (fresh device tensors, not
the pool: all blocks at once need not fit in it) and writes them back to the tier when the block ends.

Not supported: moving or casting the model after offloading it (``model.to``), assigning ``p.grad`` (torch
compares its shape with the placeholder's), switching on ``requires_grad`` after offloading, double backward
(``create_graph=True``), forwards run concurrently from several threads, and reading a parameter outside the
forward of a module that fetches it (it is the empty placeholder there).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Callable, Sequence

import torch
from torch import nn

from . import _checks, _host_memory, _zoe
from ._tier_blocks import TierBlocks, in_backward
from ._dtensor import is_dtensor
from ._offload_blocks import Active, Frame, SavedView, block_selector, contiguous_strides, plan, storage_view

__all__ = ["ParamOffload", "offload_parameters", "full_shape", "set_grad"]


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's shape: an offloaded one's own, not its placeholder's."""
    off = getattr(p, "_zoe_param_offload", None)
    return off[0]._shapes[p] if off is not None else p.shape


def set_grad(p: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``p.grad = grad``, also for an offloaded parameter, whose placeholder torch would compare the gradient's
    shape with: the weights' place is taken by the gradient itself for the assignment (nothing is copied)."""
    if grad is None or getattr(p, "_zoe_param_offload", None) is None or p.data.shape == grad.shape:
        p.grad = grad
        return
    placeholder = p.data
    p.data = grad
    try:
        p.grad = grad
    finally:
        p.data = placeholder


# The saved-tensor hooks in force (None: none). Inside a checkpointed region they are checkpointing's, which
# this module must not displace.
_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def offload_parameters(model: nn.Module, device: str = "cpu", nvme_path: str | Sequence[str] | None = None,
                       prefetch: int = 2, budget_bytes: int | None = None, tier_factory: Callable | None = None,
                       block_modules: tuple[type, ...] | Callable[[str, nn.Module], bool] | None = None,
                       init: Callable[[nn.Module], None] | None = None,
                       keep_files: bool = False) -> "ParamOffload | ShardOffload":
    """Moves ``model``'s float16/bfloat16/float32 parameters into a parameter tier and installs the hooks
    that fetch them around each module's use. Returns the ``ParamOffload`` (for an FSDP2 model a
    ``ShardOffload``); ``remove()`` undoes it, giving the model its weights back; ``close()`` ends it without
    reading them.

    ``device``: where the weights live, ``"cpu"`` (pinned RAM) or ``"nvme"`` (files at ``nvme_path``, one
    path or several). ``prefetch``: how many blocks ahead of the one in use the tier loads.
    ``budget_bytes``: the device pool's size (None: the tier's default). ``block_modules``: module classes
    or a predicate ``(name, module) -> bool``; each chosen module, and the model itself, makes one block of
    the parameters of its subtree down to the next chosen module (None: every module is a block of its own
    parameters). ``tier_factory(entry_bytes, names, home, nvme_paths, budget_bytes, prefetch)``, when
    given, builds the tier in place of ``zoe._zoe.ParamTier`` (tests use a Python double).

    The tier's NVMe files are removed when it ends — ``close()``, ``remove()``, the model and this handle
    garbage-collected, the interpreter's exit (an uncaught exception's too) — without reading the weights
    back (_tier_blocks.py); ``keep_files=True`` leaves them. The tier's RAM and each path's files are counted
    before anything is allocated: one that does not fit what is free is refused (``zoe.OutOfMemoryError``
    for RAM, ``zoe.ZoeError`` for a disk) with both figures and a ``zoe plan`` command, the model unchanged.

    Parameters of other dtypes, and empty ones, stay where they are. The model must be on its device (one
    device) before this call.

    A model wrapped with FSDP2's ``fully_shard`` (its blocks and its root) gets a ``ShardOffload``
    (_fsdp_offload.py): each rank's local shards in its own tier, one block per FSDP parameter group, NVMe
    files under ``<nvme_path>/rank<r>``. An FSDP2 model created on the meta device is initialised group by
    group: ``init(module)`` initialises one module's own parameters and buffers, and is called for each module
    of each group while the group's shards are made, before they are written to the tier."""
    if device not in ("cpu", "nvme"):
        raise ValueError(f"offload_parameters: device must be 'cpu' or 'nvme', not {device!r}")
    _host_memory.map_large_allocations()  # a model larger than memory: what is freed goes back
    if device == "nvme":
        if not nvme_path:
            raise ValueError("offload_parameters: device='nvme' needs nvme_path")
        paths = _checks.paths("offload_parameters", "nvme_path", nvme_path)
    else:
        paths = []
    _checks.integer("offload_parameters", "prefetch", prefetch, 0, _checks.INT_MAX)
    if not isinstance(keep_files, bool):
        raise TypeError(f"offload_parameters: keep_files must be a bool, not {type(keep_files).__name__}")
    if budget_bytes is not None:
        _checks.integer("offload_parameters", "budget_bytes", budget_bytes, 0, 2**63 - 1)
    home = "ram" if device == "cpu" else "nvme"
    if any(is_dtensor(p) for p in model.parameters()):
        if block_modules is not None:
            raise ValueError("offload_parameters: block_modules is for models that are not sharded; on an FSDP2 "
                             "model each fully_shard parameter group is one block")
        from ._fsdp_offload import ShardOffload
        return ShardOffload(model, home, paths, prefetch, budget_bytes or 0, tier_factory, init, keep_files)
    if init is not None:
        raise ValueError("offload_parameters: init is for FSDP2 models created on the meta device; this model's "
                         "parameters are not sharded")
    return ParamOffload(model, home, paths, prefetch, budget_bytes or 0,
                        tier_factory, block_selector(block_modules), keep_files)


class ParamOffload(TierBlocks):
    """The installed parameter offload of one model (see the module docstring).

    ``tier``: the parameter tier. ``blocks``: ``[(module_name, [params])]`` by block index; entry ``e`` of
    block ``b`` is ``blocks[b][1][e]``. Each offloaded parameter carries ``p._zoe_param_offload = (self,
    block, entry)``, the offload held weakly (_tier_blocks._OffloadRef)."""

    def __init__(self, model: nn.Module, home: str, nvme_paths: list[str], prefetch: int, budget_bytes: int,
                 tier_factory: Callable | None, select: Callable[[str, nn.Module], bool], keep_files: bool = False):
        for p in model.parameters():
            if hasattr(p, "_zoe_param_offload"):
                raise RuntimeError("offload_parameters: this model's parameters are offloaded already")
        self._model = model
        self.blocks, self._module_blocks = plan(model, select)
        if not self.blocks:
            raise ValueError("offload_parameters: the model has no float16/bfloat16/float32 parameters")
        devices = {p.device for _, ps in self.blocks for p in ps}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ValueError(f"offload_parameters: the parameters must be on one CPU or CUDA device, not "
                             f"{sorted(map(str, devices))}")
        self._device = next(iter(devices))
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())

        self._names = [name for name, _ in self.blocks]
        self._shapes = {p: p.shape for _, ps in self.blocks for p in ps}
        self._strides = {p: contiguous_strides(p.shape) for p in self._shapes}
        entry_bytes = [[p.numel() * p.element_size() for p in ps] for _, ps in self.blocks]
        self._make_tier(self._device, entry_bytes, self._names, home, nvme_paths, budget_bytes, prefetch,
                        tier_factory, keep_files)
        self._offsets = [[int(self.tier.entry_offset(b, e)) for e in range(len(ps))]
                         for b, (_, ps) in enumerate(self.blocks)]

        self._active: dict[int, Active] = {}
        self._acc_pending = [0] * len(self.blocks)  # gradient accumulations under way, by block
        self._order: list[int] | None = []  # forward order of blocks, until handed to the tier
        self._order_seen: set[int] = set()
        self._gathered = False
        self._local = threading.local()  # the module-call frames of the thread running forward
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._handles: list = []
        self._grad_nodes: list = []
        self._placeholders: dict[nn.Parameter, torch.Tensor] = {}
        # Each parameter's torch version counter as gathered() left it: an in-place edit anywhere else (on the
        # empty placeholder, or on a fetched view during forward) changes nothing kept, and is refused.
        self._known_versions: dict[nn.Parameter, int] = {}
        self._param_names = {p: name for name, p in model.named_parameters(remove_duplicate=True)}

        for b, (_, ps) in enumerate(self.blocks):
            for e, p in enumerate(ps):
                host = p.detach().to("cpu").contiguous()
                self.tier.write(b, e, host)
        for b, (_, ps) in enumerate(self.blocks):
            for e, p in enumerate(ps):
                if p.requires_grad:
                    self._hook_accumulation(p, b)
                p._zoe_param_offload = (self._mark, b, e)
                self._placeholders[p] = torch.empty(0, dtype=p.dtype, device=p.device)
                p.data = self._placeholders[p]
                self._known_versions[p] = p._version

        hooked = [m for m, bs in self._module_blocks.items() if bs]
        if model not in self._module_blocks or not self._module_blocks[model]:
            hooked.append(model)  # the root installs the saved-tensor hooks and ends the order's recording
        for m in hooked:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward, prepend=True))
            self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))

    # -- block memory ------------------------------------------------------------------------------------

    def _acquire(self, block: int, backward: bool) -> None:
        """Makes the block's parameters full views of it (fetching it unless the hooks hold it already)."""
        active = self._active.get(block)
        if active is not None:
            active.count += 1
            return
        storage = self._fetch(block, backward)
        for p, off in zip(self.blocks[block][1], self._offsets[block]):
            p.data = storage_view(storage, off, p.dtype, self._shapes[p], self._strides[p])
        self._active[block] = Active(storage)

    def _drop(self, block: int) -> None:
        active = self._active[block]
        active.count -= 1
        if active.count == 0:
            del self._active[block]
            for p in self.blocks[block][1]:
                p.data = self._placeholders[p]

    # -- saved tensors -----------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if t.layout is torch.strided and t.device.type == self._device.type and self._live:
            try:
                live = self._live.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
                live = None
            if live is not None:
                b = live[0]
                return SavedView(b, t.storage_offset() * t.element_size(), t.dtype, t.size(), t.stride(),
                                  self._write_backs)
        # Detached: a saved output held as itself would keep its own autograd node alive.
        return t.detach()

    def _unpack(self, saved):
        if not isinstance(saved, SavedView):
            return saved
        if self._write_backs != saved.version:
            raise RuntimeError(f"zoe parameter offload: the weights of block {saved.block} "
                               f"('{self._names[saved.block]}') were written after the forward that saved "
                               "them for backward")
        return storage_view(self._fetch(saved.block, True), saved.byte_offset, saved.dtype, saved.size, saved.stride)

    def _push_hooks(self) -> bool:
        """Installs the saved-tensor hooks unless some are in force (this module's, or checkpointing's)."""
        if _top_saved_tensors_hooks is not None:
            if _top_saved_tensors_hooks(False) is not None:
                return False
        elif getattr(self._local, "pushed", 0):
            return False
        self._hooks.__enter__()
        self._local.pushed = getattr(self._local, "pushed", 0) + 1
        return True

    def _pop_hooks(self) -> None:
        self._hooks.__exit__(None, None, None)
        self._local.pushed -= 1

    # -- module hooks ------------------------------------------------------------------------------------

    def _frames(self) -> list[Frame]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _pre_forward(self, module: nn.Module, args) -> None:
        frames = self._frames()
        backward = in_backward()
        if module is self._model and not backward:
            self._recover(frames)
            self.check_edits()
        frame = Frame(module)
        frames.append(frame)
        if self._gathered:
            return
        frame.pushed = self._push_hooks()
        recording = self._order is not None and not backward
        for b in self._module_blocks.get(module, ()):
            self._acquire(b, backward)
            frame.blocks.append(b)
            if recording and b not in self._order_seen:
                self._order_seen.add(b)
                self._order.append(b)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        frames = self._frames()
        if not frames or frames[-1].module is not module:
            return  # an earlier pre-hook raised before this module's ran
        self._unwind(frames.pop())
        if module is self._model and not frames and self._order is not None and not in_backward():
            error = sys.exc_info()[1] if output is None else None
            if error is not None:  # run for a forward that raised (always_call): record the order next time
                self._explain(error)
                self._order, self._order_seen = [], set()
            elif self._order:
                self._set_order(self._order)
                self._order = None
                self._order_seen = set()

    def _explain(self, error: BaseException) -> None:
        """The first forward failed: a likely cause is a module reading parameters of a module whose forward
        it does not call (the demo GPT's blocks read their layers' weights), which find the placeholders."""
        unfetched = [self._names[b] for b in range(len(self.blocks)) if b not in self._order_seen]
        if not unfetched or not hasattr(error, "add_note") or str(error).startswith("zoe parameter offload"):
            return
        shown = ", ".join(unfetched[:6]) + (", ..." if len(unfetched) > 6 else "")
        error.add_note(f"zoe parameter offload: when this forward failed, {len(unfetched)} blocks ({shown}) had "
                       "not been fetched, and their parameters were empty placeholders. If a forward reads "
                       "parameters of a submodule without calling it, make the reading module a block of its "
                       "subtree: offload_parameters(..., block_modules=(ThatModuleClass,)).")

    def _unwind(self, frame: Frame) -> None:
        try:
            for b in reversed(frame.blocks):
                self._drop(b)
        finally:
            if frame.pushed:
                self._pop_hooks()

    def _recover(self, frames: list[Frame]) -> None:
        """Undoes what an interrupted forward or backward left before the model's next forward: a
        KeyboardInterrupt skips the always-called post-hooks (they catch Exception), a backward that raised
        skips the accumulation post-hooks. (A model that calls itself from its own forward is taken for an
        interrupted one.)"""
        while frames:
            self._unwind(frames.pop())
        for b, n in enumerate(self._acc_pending):
            for _ in range(n):
                self._drop(b)
            self._acc_pending[b] = 0

    # -- gradient accumulation ---------------------------------------------------------------------------

    def _hook_accumulation(self, p: nn.Parameter, block: int) -> None:
        # The node that accumulates p.grad, created now while p.data is full (it records p's shape), and held
        # so that autograd reuses it rather than creating one from the placeholder.
        with torch.enable_grad():
            node = p.view_as(p).grad_fn.next_functions[0][0]
        self._grad_nodes.append(node)
        # The node keeps its hooks where the garbage collector cannot see them: they hold this offload weakly
        # (_OffloadRef), or it could never be collected.
        ref = weakref.ref(self)

        def before(grad_outputs):
            off = ref()
            if off is not None and not off._gathered:
                off._acquire(block, True)
                off._acc_pending[block] += 1

        def after(grad_inputs, grad_outputs):
            off = ref()
            if off is not None and off._acc_pending[block]:
                off._acc_pending[block] -= 1
                off._drop(block)

        self._handles.append(node.register_prehook(before))
        self._handles.append(node.register_hook(after))

    # -- whole-model access ------------------------------------------------------------------------------

    def _check_idle(self, what: str) -> None:
        if self._active or self._gathered or self._frames():
            raise RuntimeError(f"zoe parameter offload: {what} while blocks are in use by forward or backward")

    def _read(self, block: int, entry: int, device: torch.device) -> torch.Tensor:
        p = self.blocks[block][1][entry]
        tier = self._live_tier()
        host = torch.empty(self._shapes[p], dtype=p.dtype, pin_memory=device.type == "cuda")
        tier.read(block, entry, host)
        return host if device.type == "cpu" else host.to(device, non_blocking=False)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = True):
        """Gives every offloaded parameter its full weights as a fresh tensor on its device for the block's
        duration (a torch optimizer's ``step()``, ``model.load_state_dict``, ``nn.init``), then writes them back
        to the tier (unless ``write_back`` is False, or the block raised) and restores the placeholders. The
        hooks stand aside meanwhile: a forward run inside must also run its backward inside. zoe's
        OffloadOptimizer needs none of this for its steps (it writes the weights into the tier), and takes
        what a ``gathered()`` wrote into its master weights at its next step."""
        self._check_idle("gathered()")
        self._live_tier()
        self.check_edits()
        self._gathered = True
        edited = None
        try:
            for b, (_, ps) in enumerate(self.blocks):
                for e, p in enumerate(ps):
                    p.data = self._read(b, e, self._device)
            yield self
            if write_back:
                self._write_backs += 1  # first: a write that fails part-way has still changed some blocks
                for b, (_, ps) in enumerate(self.blocks):
                    for e, p in enumerate(ps):
                        host = p.detach().to("cpu").contiguous()
                        self.tier.write(b, e, host)
            else:
                edited = next((p for p in self._placeholders if p._version != self._known_versions[p]), None)
        finally:
            for p, placeholder in self._placeholders.items():
                p.data = placeholder
                self._known_versions[p] = p._version
            self._gathered = False
        if edited is not None:
            raise RuntimeError(
                f"zoe parameter offload: parameter '{self._param_names.get(edited, '?')}' was changed in place "
                "inside materialize(), whose weights are a read-only copy: the change was dropped. Edit "
                "offloaded weights inside `with offload.gathered():`, which writes them back to the tier")

    def materialize(self):
        """``gathered(write_back=False)``: the full weights to read (``model.state_dict()``, evaluation
        without the hooks). An in-place edit made to them is dropped, and refused with an error when the block
        ends."""
        return self.gathered(write_back=False)

    def check_edits(self) -> None:
        """Refuses (once) an in-place edit of an offloaded parameter made outside ``gathered()``: between uses
        ``p.data`` is an empty placeholder, and during forward a view of the device pool that is not written
        back, so such an edit (``nn.init.*_(p)``, ``p.copy_`` under no_grad, ``model.load_state_dict``)
        changed nothing the next forward or step reads. torch's version counter of each parameter says."""
        if self._gathered:
            return
        edited = [p for p, v in self._known_versions.items() if p._version != v]
        if not edited:
            return
        for p in edited:
            self._known_versions[p] = p._version
        names = ", ".join(f"'{self._param_names.get(p, '?')}'" for p in edited[:3])
        more = f" and {len(edited) - 3} more" if len(edited) > 3 else ""
        raise RuntimeError(
            f"zoe parameter offload: parameter {names}{more} was changed in place outside offload.gathered(); "
            "an offloaded parameter holds an empty placeholder between uses (and a pool copy during forward "
            "that is not kept), so the edit changed nothing. Nothing was fetched or stepped. Make the edit inside "
            "`with offload.gathered():`, which writes the weights back to the tier (zoe's optimizer then takes "
            "them into its master weights)")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with each offloaded parameter read from the tier into a CPU tensor (tied
        parameters share one) and everything else copied to the CPU."""
        self._check_idle("full_state_dict()")
        read: dict[nn.Parameter, torch.Tensor] = {}
        out = {}
        for name, t in self._model.state_dict(keep_vars=True).items():
            mark = getattr(t, "_zoe_param_offload", None)
            if mark is not None and mark[0] == self:
                if t not in read:
                    read[t] = self._read(mark[1], mark[2], torch.device("cpu"))
                out[name] = read[t]
            else:
                out[name] = t.detach().to("cpu", copy=True)
        return out

    def weights(self, p: torch.Tensor) -> torch.Tensor:
        """An offloaded parameter's weights as the tier holds them, in a CPU tensor of its full shape."""
        return self._read(*self.param_location(p), torch.device("cpu"))

    def remove(self) -> None:
        """Gives every parameter its full weights back on its device (read from the tier), removes the hooks
        and frees the tier (its files with it, unless keep_files). A second call does nothing."""
        if self.tier is None and not self._closed:
            return
        self._live_tier()
        self._check_idle("remove()")
        self._refuse_while_written()
        busy = [b for b in range(len(self.blocks)) if self.tier.in_use(b)]
        if busy:
            raise RuntimeError(f"zoe parameter offload: remove() while blocks {busy} are in use (a graph not "
                               "yet backpropagated, or a tensor a forward returned, still reads them)")
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grad_nodes.clear()
        for b, (_, ps) in enumerate(self.blocks):
            for e, p in enumerate(ps):
                p.data = self._read(b, e, self._device)
                del p._zoe_param_offload
        self._placeholders.clear()
        self._close_tier()

    def close(self) -> None:
        if self.tier is not None:
            self._check_idle("close()")
        super().close()

    close.__doc__ = TierBlocks.close.__doc__

    def __repr__(self) -> str:
        total = sum(self._block_bytes)
        return f"ParamOffload({len(self.blocks)} blocks, {total} bytes)"
