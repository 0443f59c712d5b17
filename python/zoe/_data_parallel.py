"""zoe's own data-parallel mode for plain parameters: with torch.distributed initialised, each of W ranks
owns 1/W of every dtype's flat buffer. The partitioning is the engine's (partition.cpp): it reduce-scatters
the gradients, decides clipping, the NaN/Inf refusal and fp16 overflow on the global statistics, steps its
shard and all-gathers the weights. This module gives it torch.distributed as its collectives, and checks
once that the gradients are averaged where the trainer says they are.
"""
from __future__ import annotations

import ctypes
import warnings

import torch
import torch.distributed as dist

_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class _CudaMemory:
    """Device memory the engine names by address, as torch.as_tensor reads it (__cuda_array_interface__
    has no bfloat16: 16-bit elements travel as int16 and are viewed back)."""

    def __init__(self, address: int, count: int, typestr: str):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (count,), "typestr": typestr,
                                         "version": 3, "strides": None}


def _tensor_at(address: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``address`` in ``device``'s memory, without a copy."""
    if count == 0:
        return torch.empty(0, dtype=dtype, device=device)
    size = torch.empty(0, dtype=dtype).element_size()
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_byte * (count * size)).from_address(address), dtype=dtype)
    typestr = "<f4" if size == 4 else "<i2"
    return torch.as_tensor(_CudaMemory(address, count, typestr), device=device).view(dtype)


class TorchCollectives:
    """The engine's Collectives over a torch.distributed group. Each call finishes its work before it
    returns (the engine's streams are not torch's)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        # gloo has no reduce-scatter: an all-reduce of a copy, of which this rank keeps its shard.
        self._gloo = dist.get_backend(group) == "gloo"

    def rank(self) -> int:
        return self._rank

    def world(self) -> int:
        return self._world

    def _finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: str) -> None:
        dt = _TORCH_DTYPES[dtype]
        full = _tensor_at(send, count * self._world, dt, self.device)
        mine = _tensor_at(recv, count, dt, self.device)
        if self._gloo:
            # A copy: the trainer's gradients (p.grad) keep this rank's own values.
            summed = full.clone()
            dist.all_reduce(summed, group=self.group)
            mine.copy_(summed[self._rank * count:(self._rank + 1) * count])
        else:
            dist.reduce_scatter_tensor(mine, full, group=self.group)
        self._finish()

    def all_gather(self, send: int, recv: int, count: int, dtype: str) -> None:
        dt = _TORCH_DTYPES[dtype]
        everyone = _tensor_at(recv, count * self._world, dt, self.device)
        # This rank's shard may be part of `everyone`: a copy of it is sent.
        mine = _tensor_at(send, count, dt, self.device).clone()
        self.gather_tensor(everyone, mine)
        self._finish()

    def gather_tensor(self, everyone: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's ``mine`` into ``everyone`` (W times as long), in rank order."""
        if self._gloo:
            dist.all_gather(list(everyone.chunk(self._world)), mine, group=self.group)
        else:
            dist.all_gather_into_tensor(everyone, mine, group=self.group)

    def all_reduce_host(self, values: list[float]) -> list[float]:
        where = "cpu" if self._gloo else self.device
        t = torch.tensor(values, dtype=torch.float64, device=where)
        dist.all_reduce(t, group=self.group)
        return t.tolist()


class DataParallel:
    def __init__(self, group, device: torch.device, reduce: bool):
        self.collectives = TorchCollectives(group, device)
        self.reduce = reduce  # False: the gradients come averaged (DistributedDataParallel)
        self._reduction_checked = False

    def absent_everywhere(self, slots, absent) -> list:
        """Of the parameters whose gradient is None here, those whose gradient is None on every rank: only they
        are left unstepped. One that has a gradient elsewhere is averaged with a zero from this rank, as
        DistributedDataParallel does with a parameter a rank did not use."""
        device = "cpu" if self.collectives._gloo else self.collectives.device
        # One element in the usual step, where no rank has a None; the per-parameter flags only otherwise.
        some = torch.tensor([1 if absent else 0], dtype=torch.int32, device=device)
        dist.all_reduce(some, op=dist.ReduceOp.MAX, group=self.collectives.group)
        if not some.item():
            return []
        mine = {id(s) for s in absent}
        present = torch.tensor([0 if id(s) in mine else 1 for s in slots], dtype=torch.int32, device=device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.collectives.group)
        return [s for s, p in zip(slots, present.tolist()) if p == 0]

    def check_reduction(self, buckets) -> None:
        """Once: are the gradients equal on every rank (averaged already, as DistributedDataParallel leaves
        them)? A fingerprint of each bucket (its 1- and 2-norms: sums of positive terms, so a sum in another
        order moves them by rounding only), compared by all-reducing its maximum and minimum."""
        if self._reduction_checked:
            return
        group = self.collectives.group
        fp = torch.stack([torch.linalg.vector_norm(b.grads, ord, dtype=torch.float64)
                          for b in buckets for ord in (1, 2)])
        if not bool(torch.isfinite(fp).all()):
            return  # NaN/Inf compare unequal: decided at a finite step
        both = torch.cat([fp, -fp])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        hi, lo = both[:len(fp)], -both[len(fp):]
        # Equal gradients give equal bits, but a rank may add them in another order (threads): 1e-9 of it.
        equal = bool(((hi - lo) <= 1e-9 * hi).all())
        self._reduction_checked = True
        if not self.reduce and not equal:
            raise RuntimeError(
                "zoe.torch.OffloadOptimizer(reduce_grads=False): the gradients differ across ranks, so they were "
                "not averaged before step() — wrap the model in DistributedDataParallel, or leave reduce_grads=True "
                "for zoe to average them")
        if self.reduce and equal:
            warnings.warn(
                "zoe.torch.OffloadOptimizer: the gradients are equal on every rank before zoe averages them — "
                "averaged already (DistributedDataParallel?). Pass reduce_grads=False to skip zoe's all-reduce "
                "of the gradients at every step; the results are the same.", stacklevel=4)
