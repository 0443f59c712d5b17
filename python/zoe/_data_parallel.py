"""zoe's own data-parallel mode for plain parameters: with torch.distributed initialised, each of W ranks
owns 1/W of every flat buffer. The gradients are averaged (reduce-scatter; all-reduce where the backend has
no reduce-scatter, as gloo), each rank's engine steps its shard, and the weights are all-gathered. The
decisions that need every shard — clipping by the global norm, the NaN/Inf refusal, fp16 overflow — are
taken here, on the reduced shards, the same on every rank.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from . import _zoe


class DataParallel:
    def __init__(self, group, world: int, rank: int, reduce: bool, device: torch.device):
        self.group, self.world, self.rank = group, world, rank
        self.reduce = reduce  # False: the gradients come averaged (DistributedDataParallel)
        self.device = device
        self._reduction_checked = False  # whether the gradients' equality across ranks agreed with `reduce`
        self._reduced = False  # this iteration's gradients are reduced
        self._stats: tuple[float, float] | None = None  # their global (sum of squares, NaN/Inf count)

    def reduce_scatter_available(self) -> bool:
        return dist.get_backend(self.group) != "gloo"

    def shard(self, b, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.rank * b.shard_numel:(self.rank + 1) * b.shard_numel]

    def shard_grads(self, b) -> torch.Tensor:
        return b.shard_grads if b.shard_grads is not None else self.shard(b, b.grads)

    def end_iteration(self) -> None:
        """The next gradients are new (a step ended, or the trainer changed them): reduce them again."""
        self._reduced, self._stats = False, None

    def reduce_grads(self, buckets) -> None:
        """Once an iteration: the gradients averaged over the ranks (unless they come averaged)."""
        if self._reduced:
            return
        self._reduced = True
        if not self._reduction_checked:
            self._check_reduction(buckets)
        if not self.reduce:
            return
        for b in buckets:
            if b.shard_grads is not None:
                dist.reduce_scatter_tensor(b.shard_grads, b.grads, group=self.group)
                b.shard_grads.div_(self.world)
            else:
                dist.all_reduce(b.grads, group=self.group)
                b.grads.div_(self.world)

    def _check_reduction(self, buckets) -> None:
        """Once: are the gradients equal on every rank (averaged already, as DistributedDataParallel leaves
        them)? A fingerprint of each bucket (its 1- and 2-norms: sums of positive terms, so a sum in another
        order moves them by rounding only), compared by all-reducing its maximum and minimum."""
        fp = torch.stack([torch.linalg.vector_norm(b.grads, ord, dtype=torch.float64)
                          for b in buckets for ord in (1, 2)])
        if not bool(torch.isfinite(fp).all()):
            return  # NaN/Inf compare unequal: decided at a finite step
        both = torch.cat([fp, -fp])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
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
                "of the gradients at every step; the results are the same.", stacklevel=5)

    def grad_stats(self, buckets) -> tuple[float, float]:
        """The sum of squares and NaN/Inf count of the averaged gradients over every rank's shard."""
        self.reduce_grads(buckets)
        if self._stats is None:
            stats = torch.zeros(2, dtype=torch.float64, device=self.device)
            for b in buckets:
                g = self.shard_grads(b).double()
                finite = torch.isfinite(g)
                stats[0] += torch.where(finite, g, 0).square().sum()
                stats[1] += (~finite).sum()
            dist.all_reduce(stats, group=self.group)
            self._stats = tuple(stats.tolist())
        return self._stats

    def norm(self, buckets, loss_scale: float) -> float:
        sum_sq, non_finite = self.grad_stats(buckets)
        return math.nan if non_finite > 0 else math.sqrt(sum_sq) / loss_scale

    def clip_and_check(self, buckets, max_norm: float, refuse: bool, loss_scaling: bool, loss_scale: float) -> None:
        """Refusal, overflow agreement and clipping of the reduced shards, before any engine steps."""
        self.reduce_grads(buckets)
        if not max_norm and not loss_scaling and not refuse:
            return
        sum_sq, non_finite = self.grad_stats(buckets)
        if non_finite > 0 and refuse:
            # Every rank refuses together, before its engine changes anything.
            raise _zoe.InvalidArgumentError(
                f"step refused: {int(non_finite)} NaN/Inf gradient values across the ranks; no state changed "
                "(refuse_non_finite=False lets them propagate as torch.optim does)")
        if non_finite > 0:
            if loss_scaling:
                # Every rank must skip and back off together: a rank whose shard is clean is made to see the
                # overflow too, so that its engine's loss scaler stays in step with the others.
                for b in buckets:
                    g = self.shard_grads(b)
                    if g.numel():
                        g[0] = float("inf")
                        break
            return
        if max_norm:
            coef = max_norm / (math.sqrt(sum_sq) / loss_scale + 1e-6)
            if coef < 1.0:
                for b in buckets:
                    self.shard_grads(b).mul_(coef)

    def gather_weights(self, buckets) -> None:
        for b in buckets:
            shard = self.shard(b, b.weights)
            if self.reduce_scatter_available():
                dist.all_gather_into_tensor(b.weights, shard.clone(), group=self.group)
            else:
                dist.all_gather(list(b.weights.chunk(self.world)), shard.clone(), group=self.group)
