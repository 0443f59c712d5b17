"""What every user of a zoe parameter tier shares (the single-process offload, _param_offload.py, and FSDP2's
shards, _fsdp_offload.py): the tier made for the parameters' device, and a fetched block's memory as a torch
storage that holds the fetch until the storage dies (``_Lease``)."""
from __future__ import annotations

import ctypes
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


class TierBlocks:
    """A parameter tier and the fetched blocks' leases. ``tier``: the tier (None once removed); ``_names``:
    each block's name; ``_block_bytes``: each block's bytes; ``_live``: block address -> [block, leases]."""

    def _make_tier(self, device: torch.device, entry_bytes: list[list[int]], names: list[str], home: str,
                   nvme_paths: list[str], budget_bytes: int, prefetch: int, tier_factory: Callable | None) -> None:
        self._device = device
        self._names = names
        if tier_factory is None:
            zdev = _zoe.cpu_device() if device.type == "cpu" else _zoe.cuda_device(device.index)
            # On CUDA the tier's compute-stream work is torch's current stream (_stream): a fetch makes
            # torch's stream wait for the block's copy, a release records when torch is done with it.
            self.tier = _zoe.ParamTier(zdev, entry_bytes, names, home, nvme_paths, budget_bytes, prefetch)
            self._zoe_device = zdev
            self._stream = TorchStream(zdev, device)
        else:
            self.tier = tier_factory(entry_bytes, names, home, nvme_paths, budget_bytes, prefetch)
            self._zoe_device = None
            self._stream = None
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

    def _fetch(self, block: int, backward: bool) -> torch.UntypedStorage:
        """A storage over the block's memory in the pool, holding one fetch until it dies."""
        if self.tier is None:
            raise RuntimeError("zoe parameter offload was removed: its blocks cannot be fetched")
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
        if mark is None or mark[0] is not self:
            raise KeyError("zoe parameter offload: not one of this offload's parameters")
        return mark[1], mark[2]

    def _refuse_while_written(self) -> None:
        """remove() before it changes anything: not while an optimizer still writes into the tier."""
        if getattr(self.tier, "users", 0):
            raise RuntimeError("zoe parameter offload: remove() while an OffloadOptimizer still writes into the "
                               "parameter tier: delete the optimizer first")

    def _close_tier(self) -> None:
        tier, self.tier = self.tier, None
        if hasattr(tier, "close"):
            tier.close()

    def edits(self) -> int:
        """How many times the weights were written back to the tier by the trainer (``gathered()``): an
        optimizer that keeps master weights of its own takes them again when this changes."""
        return self._write_backs

    def stats(self) -> dict:
        """The tier's counters, and the host waits of its device as in OffloadOptimizer.stats()."""
        s = dict(self.tier.stats())
        if self._zoe_device is not None:
            s.update(host_wait_stats(self._zoe_device))
        return s
