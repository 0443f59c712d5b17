"""DTensor parameters — torch FSDP2's ``fully_shard`` — stepped as each rank's local shards.

FSDP2 has partitioned the parameters and reduce-scatters their gradients itself, so zoe does not partition
or reduce again: to the engine the world is one rank whose parameters are this rank's local shards.

* Weights: the engine writes each updated shard straight into the DTensor's local tensor. FSDP2 keeps that
  storage (``FSDPParam._sharded_param_data``) for the life of the module and all-gathers from it; with
  ``CPUOffloadPolicy`` it is host memory, so the step is in place. The address is checked at every step.
* Gradients: one flat buffer per dtype beside the shards; ``p.grad`` is a DTensor over a view of it, with
  the parameter's mesh and placements. FSDP2 adds its reduce-scattered gradient into an existing ``p.grad``
  in place, so no copy per step; a gradient it allocated anew (after ``p.grad = None``) is copied in.
  With ``spill_grads`` (tier nvme) there is no such buffer: each shard's gradient goes to the engine's spill
  file from its post-accumulate-grad hook, and ``p.grad`` is set to None, which frees FSDP2's reduce-scatter
  output — neither the device nor the host holds the model's gradients (ZeRO-Infinity's gradient offload).
* The global gradient norm (clipping), NaN/Inf refusal and fp16 overflow need every shard: each rank's engine
  gives the norm of its shards, and the squares are summed over the mesh dimensions the parameters are
  sharded on; every rank then takes the same decision.
* Schedules: sync only. The overlap and delayed schedules would step during backward and rely on version
  counters to see a trainer's later edits, but torch's foreach ops on DTensors (``clip_grad_norm_``) change
  gradients without bumping any version counter: a speculative step would be kept, wrong. They run as sync.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from . import _zoe

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without torch.distributed
    DTensor = None

_F32_TINY = 1.1754943508222875e-38  # smallest normal float32: a max norm the engine still reads as "clip"


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_numel(p: torch.Tensor) -> int:
    return p._local_tensor.numel() if is_dtensor(p) else p.numel()


class _LocalBucket:
    """The gradients of one dtype's local shards (a ``Bucket`` of one rank: no weights of its own — the
    shards are FSDP2's)."""

    def __init__(self, dtype, device, slots, spills: bool):
        self.dtype = dtype
        self.slots = slots
        self.shard_numel = sum(s.numel for s in slots)
        self.weights = None
        self.spills = spills
        self.grads = torch.zeros(0 if spills else self.shard_numel, dtype=dtype, device=device)
        self.window = None  # a shard in a parameter tier takes its gradient from FSDP2 like any other

    def grad_buffer(self, s) -> torch.Tensor | None:
        return None if self.spills else self.grads


class ShardedParams:
    """This rank's view of an optimizer's DTensor parameters: their mesh, where the engine finds each shard,
    and the cross-rank agreement before each step."""

    def __init__(self, mesh, shard_dims: tuple[int, ...]):
        self.mesh = mesh
        self.shard_dims = shard_dims
        self._shards: list[tuple] = []  # (slot, the local shard's address the engine writes)
        self._norm_taken = False  # clip_grad_norm_ had the engine take this iteration's gradients
        self._injected = None  # (bucket, value) a clean rank marked non-finite to skip with the others
        self._engine_max_norm = 0.0
        self.spills = False  # spill_grads: every shard's gradient goes to the engine's spill file
        self.zero_filled = False  # spilling, after zero_grad(set_to_none=False): a shard without one steps a zero

    @classmethod
    def detect(cls, param_groups, process_group) -> "ShardedParams | None":
        """None when no parameter is a DTensor; else checks that zoe can step them all as local shards."""
        params = [p for g in param_groups for p in g["params"]]
        trainable = [i for i, p in enumerate(params) if p.requires_grad or p.is_floating_point()]
        sharded = [i for i in trainable if is_dtensor(params[i])]
        if not sharded:
            return None
        if len(sharded) != len(trainable):
            plain = [i for i in trainable if not is_dtensor(params[i])]
            raise ValueError(
                f"zoe.torch.OffloadOptimizer: parameters [{_indices(sharded)}] are DTensors (FSDP2 fully_shard), "
                f"parameters [{_indices(plain)}] plain tensors. zoe steps DTensor parameters as each rank's local "
                "shards and plain ones by partitioning them itself, not both in one optimizer: apply fully_shard to "
                "the root module as well, or give the plain parameters an optimizer of their own")
        if process_group is not None:
            raise ValueError(
                "zoe.torch.OffloadOptimizer: process_group is for plain parameters, which zoe partitions itself; "
                "DTensor parameters (FSDP2) come with their device mesh, which zoe uses — leave process_group=None")
        first = params[sharded[0]]
        mesh = first.device_mesh
        shard_dims = _shard_dims(first, sharded[0])
        for i in sharded:
            p = params[i]
            if p.device_mesh != mesh:
                raise ValueError(
                    f"zoe.torch.OffloadOptimizer: parameter {i} is on the {_mesh_str(p.device_mesh)}, parameter "
                    f"{sharded[0]} on the {_mesh_str(mesh)}; one optimizer serves one mesh (its norm and skip "
                    "decisions are agreed over it) — create one optimizer per mesh")
            if _shard_dims(p, i) != shard_dims:
                raise ValueError(
                    f"zoe.torch.OffloadOptimizer: parameter {i} has placements {p.placements}, parameter "
                    f"{sharded[0]} {first.placements}; the global gradient norm sums each rank's shards over "
                    "the mesh dimensions the parameters are sharded on, so they must be the same for all "
                    "(FSDP2 and HSDP meshes are; mixing tensor-parallel layouts is not supported)")
            if not p._local_tensor.is_contiguous():
                raise ValueError(f"zoe.torch.OffloadOptimizer: parameter {i}'s local shard is not contiguous; "
                                 "zoe steps each shard as one run of memory")
        return cls(mesh, shard_dims)

    def schedule(self, schedule: str) -> str:
        if schedule != "sync":
            warnings.warn(
                f"zoe.torch.OffloadOptimizer: schedule='{schedule}' runs as 'sync' with DTensor (FSDP2) "
                "parameters — torch's foreach ops on DTensor gradients (torch.nn.utils.clip_grad_norm_) change "
                "them without bumping version counters, so zoe could not see a trainer's edits after backward "
                "and undo its steps during backward. The steps are exact, not overlapped.", stacklevel=3)
        return "sync"

    def ranks(self) -> tuple[int, int]:
        """(world size, rank) that a state_dict records: each rank's holds its own shards."""
        return self.mesh.size(), dist.get_rank()

    @staticmethod
    def describe(p) -> list:
        """What a state_dict's layout records beside the global shape: this rank's shard of it."""
        return [list(p._local_tensor.shape), [str(pl) for pl in p.placements]] if is_dtensor(p) else []

    # ---- layout ---------------------------------------------------------------------------------------

    def make_buckets(self, slots_by_dtype: dict, device: torch.device, spills: bool) -> list[_LocalBucket]:
        self.spills = spills
        buckets = [_LocalBucket(dt, device, slots, spills) for dt, slots in slots_by_dtype.items()]
        if sum(b.shard_numel for b in buckets) == 0:
            raise ValueError(
                f"zoe.torch.OffloadOptimizer: rank {dist.get_rank()} holds no element of any parameter (the model "
                f"is smaller than the mesh of {self.mesh.size()}); its loss scale and skip decisions could not "
                "follow the other ranks' — shard over fewer ranks")
        with torch.no_grad():
            for b in buckets:
                for s in b.slots if not spills else ():
                    p = s.param
                    local = p._local_tensor
                    view = b.grads[s.offset:s.offset + s.numel].view(local.shape)
                    s.grad_view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                                     shape=p.shape, stride=p.stride())
                    if p.grad is not None:
                        self.copy_grad(s, p.grad)
                    p.grad = s.grad_view
        # A shard in a parameter tier (offload_parameters) has no storage of FSDP2's to check.
        self._shards = [(s, s.param._local_tensor.data_ptr()) for b in buckets for s in b.slots
                        if s.numel and s.tier is None]
        return buckets

    def adopt_grads(self, flat, owner) -> list:
        """The post-accumulate-grad hooks of every shard: spilling it (spill_grads), or keeping it in the flat
        buffer. ``owner``: a weak reference to the optimizer (a hook must not keep it alive)."""
        if not self.spills:
            return self._adopt_hooks(flat.slots)
        if flat.loss_scaling and self.mesh.size() > 1:
            raise _zoe.UnsupportedError(
                "zoe.torch.OffloadOptimizer: spill_grads with loss scaling across ranks is not supported: a rank "
                "skips an overflowing step with the others by marking a gradient it holds, and spilled gradients "
                "are not held. Use bf16 without loss scaling, or spill_grads=False")
        return [s.param.register_post_accumulate_grad_hook(self._spill_hook(s, owner))
                for s in flat.slots if s.param.requires_grad]

    def _spill_hook(self, slot, owner):
        def hook(p):
            opt = owner()
            if opt is None or p.grad is None:
                return
            opt._note_backward()  # a backward that raises after this gives its iteration up at the next call
            self.spill(slot, opt._flat.engine)
        return hook

    def spill(self, slot, engine) -> None:
        """The shard's gradient to the engine's spill file, and ``p.grad`` None (FSDP2's reduce-scatter output
        is freed with the group's last). A second gradient of one iteration is refused by the engine: the
        spill does not sum micro-batches."""
        p = slot.param
        g = p.grad
        self._check_layout(slot, g)
        self._spill_local(slot, engine, g._local_tensor.contiguous())
        p.grad = None

    def spill_zeros(self, slot, engine) -> None:
        """A zero gradient for a shard that got none after ``zero_grad(set_to_none=False)``: torch steps it so."""
        self._spill_local(slot, engine, torch.zeros_like(slot.param._local_tensor))

    def _spill_local(self, slot, engine, local) -> None:
        if self.mesh.device_type == "cuda":
            # FSDP2 reduces on a stream of its own (current here), and with CPUOffloadPolicy copies the result
            # to pinned memory on it without blocking (torch before 2.15): the engine reads it when it is done.
            torch.cuda.current_stream().synchronize()
        for i in slot.engine_ids:
            engine.spill_grad(i, local.reshape(-1))
        slot.spilled = True

    def _adopt_hooks(self, slots) -> list:
        """Hooks that keep each shard's gradient in the flat buffer as backward goes. FSDP2 runs a sharded
        parameter's post-accumulate-grad hooks once it has set or added its gradient; after
        ``zero_grad(set_to_none=True)`` it sets a new DTensor viewing its reduce-scatter output, which the
        whole group's gradients share. Copied into the flat buffer at once (``p.grad`` its view again), that
        output is freed group by group — else every group's would live until step(), a second copy of the
        model's gradients (measured: 2 bytes per parameter at the end of each backward, bench_infinity at 1B).
        A torch that does not run the hooks leaves the copy to step(), as before; so does a gradient laid out
        otherwise than its shard (step() refuses it, naming it — not an error in the middle of FSDP2's
        reduce)."""
        gpu_mesh = self.mesh.device_type == "cuda"

        def adopt(slot):
            def hook(p):
                g = p.grad
                if g is None or g is slot.grad_view or not is_dtensor(g) or \
                        g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
                    return
                if gpu_mesh and g._local_tensor.device.type == "cpu":
                    # CPUOffloadPolicy: an FSDP2 that copies a new gradient to pinned memory without blocking
                    # though hooks are set (2.15 blocks then; older ones may not) runs the hook before the copy
                    # is done; the copy is on the stream current here, FSDP2's post-reduce stream.
                    torch.cuda.current_stream().synchronize()
                self.copy_grad(slot, g)
                p.grad = slot.grad_view
            return hook
        return [s.param.register_post_accumulate_grad_hook(adopt(s)) for s in slots if s.param.requires_grad]

    def local_weights(self, slot) -> torch.Tensor:
        return slot.param._local_tensor

    def check_storage(self) -> None:
        for s, ptr in self._shards:
            if s.param._local_tensor.data_ptr() != ptr:
                raise RuntimeError(
                    f"zoe.torch.OffloadOptimizer: the local shard of parameter {s.index} (shape "
                    f"{tuple(s.param.shape)}) is no longer the storage zoe was given (a model.to(), .float() or "
                    ".cuda() after construction replaced it); zoe would update memory the model no longer uses. "
                    "Create the optimizer after the model is on its device, in its dtype")

    def copy_grad(self, slot, g) -> None:
        """A gradient FSDP2 or the trainer allocated anew, into the slot's place in the flat buffer."""
        self._check_layout(slot, g)
        local = g._local_tensor
        if local.data_ptr() != slot.grad_view._local_tensor.data_ptr():
            slot.grad_view._local_tensor.copy_(local)

    @staticmethod
    def _check_layout(slot, g) -> None:
        p = slot.param
        if not is_dtensor(g) or g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
            what = f"a DTensor with placements {g.placements}" if is_dtensor(g) else f"a plain {type(g).__name__}"
            raise RuntimeError(
                f"zoe.torch.OffloadOptimizer: parameter {slot.index} (placements {p.placements}) has as gradient "
                f"{what}; zoe steps gradients laid out as their parameter's shards — set p.grad to a DTensor "
                "on the parameter's mesh with its placements (redistribute it first)")

    # ---- agreement across the mesh --------------------------------------------------------------------

    def _global(self, local_norm: float) -> tuple[float, int]:
        """The unscaled global gradient norm from each rank's, and on how many ranks some shard is non-finite."""
        bad = not math.isfinite(local_norm)
        # Where the mesh's backend takes tensors: NCCL's on the GPU even when the shards are offloaded.
        device = (torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda"
                  else torch.device(self.mesh.device_type))
        t = torch.tensor([0.0 if bad else local_norm * local_norm, float(bad)], dtype=torch.float64, device=device)
        for d in self.shard_dims:
            dist.all_reduce(t, group=self.mesh.get_group(d))
        sum_sq, ranks_bad = t.tolist()
        return math.sqrt(sum_sq), int(ranks_bad)

    def global_norm(self, engine) -> float:
        """clip_grad_norm_'s total norm: over every rank's shards."""
        norm, ranks_bad = self._global(engine.grad_norm())
        self._norm_taken = True
        return math.nan if ranks_bad else norm

    def agree(self, flat, max_norm: float, refuse: bool) -> None:
        """Before the engine's step of the optimizer's FlatState (``flat``), so that every rank of the mesh
        decides alike: the clip coefficient from the global norm (``max_norm``: this step's, 0 for none), and
        a refusal (``refuse``: of non-finite gradients) or fp16 overflow skip when any rank's shard is
        non-finite."""
        self.check_storage()
        engine = flat.engine
        if not (max_norm or flat.loss_scaling or refuse):
            self._set_max_norm(engine, 0.0)
            return
        if self._norm_taken:
            # Taken for clip_grad_norm_: a trainer's edit since then may be invisible to version counters.
            # (Spilled gradients cannot be edited: they left p.grad.)
            if not self.spills:
                engine.grads_changed()
            self._norm_taken = False
        local = engine.grad_norm()
        norm, ranks_bad = self._global(local)
        if ranks_bad:
            self._set_max_norm(engine, 0.0)  # as in one process: no clipping by a non-finite norm
            if refuse:
                # Refused before the engine steps, on every rank alike; the engine takes the gradients anew
                # next time (spilled ones are gone: the step gives the iteration up).
                if not self.spills:
                    engine.grads_changed()
                here = "non-finite" if not math.isfinite(local) else "finite"
                raise _zoe.InvalidArgumentError(
                    f"step refused: NaN/Inf gradients on {ranks_bad} of the ranks of the {_mesh_str(self.mesh)} "
                    f"(this rank's shards are {here}); no state changed (refuse_non_finite=False lets them propagate "
                    "as torch.optim does)")
            if flat.loss_scaling and math.isfinite(local):
                self._inject_overflow(flat)
            return
        # The engine clips by max_norm' / (local + 1e-6); this max_norm' makes that torch's coefficient
        # max_norm / (global + 1e-6), to the float rounding of max_norm'.
        coef = max_norm / (norm + 1e-6) if max_norm else 1.0
        self._set_max_norm(engine, max(coef * (local + 1e-6), _F32_TINY) if coef < 1.0 else 0.0)

    def _set_max_norm(self, engine, value: float) -> None:
        if value != self._engine_max_norm:
            engine.set_max_grad_norm(value)
            self._engine_max_norm = value

    def _inject_overflow(self, flat) -> None:
        # The engine's loss scaler must skip and back off with the ranks that overflowed; it skips what it
        # sees, so it is shown one non-finite element, put back after the step.
        b = next(b for b in flat.buckets if b.grads.numel())
        self._injected = (b, b.grads[0].item())
        b.grads[0] = math.inf
        flat.engine.grads_changed()

    def end_iteration(self) -> None:
        if self._injected is not None:
            b, value = self._injected
            b.grads[0] = value
            self._injected = None
        self._norm_taken = False


def _shard_dims(p, index: int) -> tuple[int, ...]:
    for pl in p.placements:
        if not (pl.is_shard() or pl.is_replicate()):
            raise ValueError(f"zoe.torch.OffloadOptimizer: parameter {index} has placement {pl}; zoe steps "
                             "parameters that are sharded or replicated (a Partial parameter has no values of "
                             "its own to step)")
    return tuple(d for d, pl in enumerate(p.placements) if pl.is_shard())


def _mesh_str(mesh) -> str:
    names = f" {list(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"{mesh.device_type} mesh{names} of ranks {mesh.mesh.tolist()}"


def _indices(ix: list[int]) -> str:
    return ", ".join(map(str, ix[:5])) + (", ..." if len(ix) > 5 else "")
