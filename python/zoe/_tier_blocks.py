"""What every user of a zoe parameter tier shares (the single-process offload, _param_offload.py, and FSDP2's
shards, _fsdp_offload.py): the tier made for the parameters' device, a fetched block's memory as a torch
storage that holds the fetch until the storage dies (``_Lease``), and the end of the tier's files.

The NVMe home's files are scratch for one run (4 bytes per parameter: two slots of each 16-bit weight). They go
when the tier ends, however it ends, and nothing is read back for it: ``close()``; the offload garbage-collected
with its model (a ``weakref.finalize`` on it); the interpreter's exit, an uncaught exception's included (the
same finalizer, which ``atexit`` runs). Those last two unlink the files' names only (``ParamTier.remove_files``):
an optimizer may still hold the tier and write into it, and an exiting process need not free memory; the
room goes with the tier. ``keep_files=True`` keeps them. A process killed (SIGKILL, SIGTERM without a handler,
``os._exit``) leaves them, and the next tier of that name under that path replaces them."""
from __future__ import annotations

import ctypes
import os
import sys
import weakref
from typing import Callable

import torch

from . import _zoe
from ._data_parallel import _CudaMemory
from ._stream import TorchStream, host_wait_stats

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_backward() -> bool:
    """Autograd's engine is running a backward on this thread (hooks called from it fetch in reverse order)."""
    return _current_graph_task_id() != -1


class _Lease:
    """One ``tier.fetch`` of a block, carried by the object through which torch reads the block's memory
    (the storage keeps that object alive): when the last tensor on the storage dies, the block is released."""

    __slots__ = ("offload", "block", "address")

    def __init__(self, offload: "TierBlocks", block: int, address: int):
        self.offload = offload
        self.block = block
        self.address = address
        offload._live_add(address, block)

    def __del__(self):
        self.offload._release(self.block, self.address)


def _end_files(tier, pid: int, made_dirs: list[str]) -> None:
    """The finalizer of a TierBlocks (garbage collection, interpreter exit): unlinks the tier's files without
    freeing or reading anything, then the folders the offload made for them, where empty. Not in a forked
    child, whose exit must not take its parent's files."""
    if os.getpid() != pid:
        return
    try:
        if hasattr(tier, "remove_files"):
            tier.remove_files()
    except Exception as e:  # an exit path: say it, and let the rest of the exit go on
        print(f"zoe parameter offload: the tier's files could not be removed: {e}", file=sys.stderr)
    for d in reversed(made_dirs):
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty (someone else's files), or gone already


class _OffloadRef:
    """What an offloaded parameter carries to name its offload (``p._zoe_param_offload = (ref, block, entry)``):
    the offload itself, held weakly. A parameter is kept alive from C++ — by the autograd node that
    accumulates its gradient, which the offload keeps and the garbage collector cannot see into — so a strong
    reference there would keep the offload, its model and its tier alive for ever. Attributes are the
    offload's; it equals the offload; once the offload is gone, using it says so."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, offload: "TierBlocks"):
        self._ref = weakref.ref(offload)

    def _get(self) -> "TierBlocks":
        offload = self._ref()
        if offload is None:
            raise RuntimeError("zoe parameter offload: the offload of this parameter was deleted with its model "
                               "(its tier and files are gone)")
        return offload

    def __getattr__(self, name):
        return getattr(self._get(), name)

    def __eq__(self, other):
        return other is self or (self._ref() is not None and self._ref() is other)

    def __hash__(self):
        return id(self)

    def __repr__(self) -> str:
        return repr(self._ref() or "zoe parameter offload (deleted)")


class TierBlocks:
    """A parameter tier and the fetched blocks' leases. ``tier``: the tier (None once removed or closed);
    ``_names``: each block's name; ``_block_bytes``: each block's bytes; ``_live``: block address -> [block,
    leases]; ``_finalizer``: removes the tier's files when this object is collected or the interpreter exits."""

    _closed = False  # close() ran, not remove(): see _gone()

    def _make_tier(self, device: torch.device, entry_bytes: list[list[int]], names: list[str], home: str,
                   nvme_paths: list[str], budget_bytes: int, prefetch: int, tier_factory: Callable | None,
                   keep_files: bool = False, made_dirs: list[str] | None = None) -> None:
        self._device = device
        self._names = names
        if tier_factory is None:
            zdev = _zoe.cpu_device() if device.type == "cpu" else _zoe.cuda_device(device.index)
            # On CUDA the tier's compute-stream work is torch's current stream (_stream): a fetch makes
            # torch's stream wait for the block's copy, a release records when torch is done with it.
            self.tier = _zoe.ParamTier(zdev, entry_bytes, names, home, nvme_paths, budget_bytes, prefetch,
                                       keep_files=keep_files)
            self._zoe_device = zdev
            self._stream = TorchStream(zdev, device)
        else:
            self.tier = tier_factory(entry_bytes, names, home, nvme_paths, budget_bytes, prefetch)
            self._zoe_device = None
            self._stream = None
        self._keep_files = keep_files
        self._made_dirs = list(made_dirs or [])
        self._mark = _OffloadRef(self)  # what each offloaded parameter carries
        # Holds the tier, not this object: the files go when this object does (its model with it), at the
        # latest at the interpreter's exit.
        self._finalizer = weakref.finalize(self, _end_files, self.tier, os.getpid(), self._made_dirs)
        if keep_files:
            self._finalizer.detach()
        self._block_bytes = [int(self.tier.block_bytes(b)) for b in range(len(entry_bytes))]
        self._live: dict[int, list] = {}
        self._write_backs = 0
        self._first_block: int | None = None  # the forward's first block, once the order is recorded

    def _set_order(self, order: list[int]) -> None:
        self.tier.set_order(list(order))
        self._first_block = order[0]

    def after_step(self) -> None:
        """After the optimizer wrote the step's weights into the tier: the next forward's first block starts on
        its way (its loads follow one another from there), so that the forward does not begin with a wait."""
        if self.tier is not None and self._first_block is not None:
            self.tier.prefetch(self._first_block)

    def _gone(self) -> str:
        """Why the tier is None."""
        if self._closed:
            return ("zoe parameter offload was closed (offload.close()): the weights went with the tier, unread; "
                    "remove() is what gives them back to the model")
        return "zoe parameter offload was removed"

    def _live_tier(self):
        if self.tier is None:
            raise RuntimeError(self._gone())
        return self.tier

    def _fetch(self, block: int, backward: bool) -> torch.UntypedStorage:
        """A storage over the block's memory in the pool, holding one fetch until it dies."""
        if self.tier is None:
            raise RuntimeError(f"{self._gone()}: its blocks cannot be fetched")
        try:
            self._follow_stream()
            address = int(self.tier.fetch(block, backward))
        except Exception as e:
            raise RuntimeError(f"zoe parameter offload: fetching block {block} ('{self._names[block]}', "
                               f"{self._block_bytes[block]} bytes) failed: {e}") from e
        lease = _Lease(self, block, address)
        n = self._block_bytes[block]
        if self._device.type == "cpu":
            memory = (ctypes.c_byte * n).from_address(address)
            memory.lease = lease
            return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
        memory = _CudaMemory(address, n, "|u1")
        memory.lease = lease
        return torch.as_tensor(memory, device=self._device).untyped_storage()

    def _follow_stream(self) -> None:
        if self._stream is not None:
            self._stream.follow()

    def _live_add(self, address: int, block: int) -> None:
        live = self._live.get(address)
        if live is None:
            self._live[address] = [block, 1]
        else:
            live[1] += 1

    def _release(self, block: int, address: int) -> None:
        live = self._live.get(address)
        if live is not None:
            live[1] -= 1
            if live[1] == 0:
                del self._live[address]
        if self.tier is not None:
            # The tier gives this memory to another block only after torch's stream has passed this point.
            self._follow_stream()
            self.tier.release(block)

    def param_location(self, p: torch.Tensor) -> tuple[int, int]:
        """(block, entry) of an offloaded parameter."""
        mark = getattr(p, "_zoe_param_offload", None)
        if mark is None or mark[0] != self:
            raise KeyError("zoe parameter offload: not one of this offload's parameters")
        return mark[1], mark[2]

    def _refuse_while_written(self, what: str = "remove()") -> None:
        """remove() or close() before it changes anything: not while an optimizer still writes into the tier."""
        if getattr(self._live_tier(), "users", 0):
            raise RuntimeError(f"zoe parameter offload: {what} while an OffloadOptimizer still writes into the "
                               "parameter tier: delete the optimizer first")

    def _close_tier(self, closed: bool = False) -> None:
        """Frees the tier now (its destructor removes the files, unless keep_files), and the folders made for
        them where empty; the finalizer has nothing left to do. ``closed``: by close(), the weights unread."""
        self._finalizer.detach()
        tier, self.tier = self.tier, None
        self._closed = closed
        if hasattr(tier, "close"):
            tier.close()
        if not self._keep_files:
            _end_files(None, os.getpid(), self._made_dirs)

    def close(self) -> None:
        """Ends the offload without bringing the weights back: frees the tier (its pool, its pinned home) and
        removes its NVMe files (unless ``keep_files=True``), reading nothing. The offloaded parameters are
        unusable afterwards: a forward, ``gathered()``, ``weights()`` or a read of an FSDP2 shard raises,
        saying so. ``remove()`` is the end that gives the model its weights back. Refused, changing nothing,
        while an optimizer still writes into the tier or a block is in use (a graph not yet backpropagated, a
        tensor a forward returned); a second call does nothing."""
        if self.tier is None:
            return
        self._refuse_while_written("close()")
        busy = sorted({v[0] for v in self._live.values()})
        if hasattr(self.tier, "in_use"):
            busy = sorted(set(busy) | {b for b in range(len(self._names)) if self.tier.in_use(b)})
        if busy:
            raise RuntimeError(f"zoe parameter offload: close() while blocks {busy} are in use (a graph not yet "
                               "backpropagated, or a tensor a forward returned, still reads them)")
        self._close_tier(closed=True)

    def edits(self) -> int:
        """How many times the weights were written back to the tier by the trainer (``gathered()``): an
        optimizer that keeps master weights of its own takes them again when this changes."""
        return self._write_backs

    def stats(self) -> dict:
        """The tier's counters, and the host waits of its device as in OffloadOptimizer.stats()."""
        s = dict(self._live_tier().stats())
        if self._zoe_device is not None:
            s.update(host_wait_stats(self._zoe_device))
        return s
