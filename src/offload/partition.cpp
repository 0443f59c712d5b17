// ZeRO partitioning (docs/architecture.md, "Beyond one machine"): every rank passes the same parameters and owns the
// optimizer state of its 1/W of their flattened elements, dtype by dtype. Gradients are reduce-scattered into
// this rank's shard on the device; the updated shards are all-gathered back into every parameter. The
// optimizer under it steps this rank's pieces of the parameters as if they were its own, with schedule sync.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/optimizer_impl.h"

namespace zoe {

void OffloadOptimizer::Impl::Partition::release(Device& device) {
  for (Flat& f : flats) {
    if (!options.flat_buffers) {
      device.free(f.grads);
      device.free(f.weights);
    }
    device.free(f.shard_grads);
    f.grads = f.weights = f.shard_grads = nullptr;
  }
}

namespace {

unsigned char* at(void* base, std::size_t elements, DType dtype) {
  return static_cast<unsigned char*>(base) + elements * dtype_size(dtype);
}

// Each dtype's parameters, in the order its first parameter comes, at their offsets in its flat vector.
std::vector<Impl::Partition::Flat> flatten(const std::vector<ParamSpec>& params, std::size_t world) {
  std::vector<Impl::Partition::Flat> flats;
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto f = std::find_if(flats.begin(), flats.end(), [&](const auto& x) { return x.dtype == params[i].dtype; });
    if (f == flats.end()) {
      flats.emplace_back().dtype = params[i].dtype;
      sizes.push_back(0);
      f = flats.end() - 1;
    }
    std::size_t& size = sizes[f - flats.begin()];
    f->members.push_back(i);
    f->offsets.push_back(size);
    size += params[i].n;
  }
  for (std::size_t k = 0; k < flats.size(); ++k) flats[k].shard = std::max<std::size_t>((sizes[k] + world - 1) / world, 1);
  return flats;
}

// flat_buffers: the trainer's parameters of each dtype must follow each other in its buffers.
Status adopt_trainer_buffers(Impl::Partition::Flat& f, const std::vector<ParamSpec>& user) {
  const ParamSpec& first = user[f.members[0]];
  f.grads = const_cast<void*>(first.device_grads);
  f.weights = first.device_weights;
  for (std::size_t k = 1; k < f.members.size(); ++k) {
    const ParamSpec& p = user[f.members[k]];
    if (p.device_grads != at(f.grads, f.offsets[k], f.dtype) || p.device_weights != at(f.weights, f.offsets[k], f.dtype)) {
      return invalid_argument("partition.flat_buffers: parameter " + std::to_string(f.members[k]) + " (" +
                              std::string(dtype_name(f.dtype)) + ") does not follow parameter " +
                              std::to_string(f.members[k - 1]) + " in the flat weight and gradient buffers");
    }
  }
  return Status::success();
}

// Our own flat vectors: the weights start as the parameters' own; the padding stays zero in both.
Status allocate_flat(Device& device, Impl::Partition::Flat& f, const std::vector<ParamSpec>& user, std::size_t world) {
  const std::size_t padded = f.shard * world, total = f.offsets.back() + user[f.members.back()].n;
  const std::size_t elem = dtype_size(f.dtype);
  for (void** slot : {&f.grads, &f.weights}) {
    Result<void*> r = device.allocate(padded * elem);
    if (!r.ok()) return r.status();
    *slot = r.value();
  }
  Status s;
  void* zeros = nullptr;
  if (padded > total) {
    Result<void*> z = device.allocate_host((padded - total) * elem);
    if (!z.ok()) return z.status();
    zeros = z.value();
    std::memset(zeros, 0, (padded - total) * elem);
    for (void* flat : {f.grads, f.weights}) {
      if (s.ok()) s = device.copy_to_device(at(flat, total, f.dtype), zeros, (padded - total) * elem, Stream::compute);
    }
  }
  for (std::size_t k = 0; k < f.members.size() && s.ok(); ++k) {
    const ParamSpec& p = user[f.members[k]];
    s = device.copy_on_device(at(f.weights, f.offsets[k], f.dtype), p.device_weights, p.n * elem, Stream::compute);
  }
  if (s.ok()) {
    Result<EventId> copied = device.record(Stream::compute);
    s = copied.ok() ? device.synchronize(copied.value()) : copied.status();
  }
  device.free_host(zeros);
  return s;
}

}  // namespace

Status OffloadOptimizer::Impl::partition_reduce_grads() {
  Partition& p = *partition;
  const std::size_t rank = static_cast<std::size_t>(p.comm->rank());
  for (Partition::Flat& f : p.flats) {
    const std::size_t elem = dtype_size(f.dtype), lo = rank * f.shard, hi = lo + f.shard;
    if (p.options.grads_averaged) {
      if (p.options.flat_buffers) continue;  // the pieces read this rank's shard of the trainer's buffer
      // This rank's shard of each gradient, as it is.
      for (std::size_t k = 0; k < f.members.size(); ++k) {
        const ParamSpec& u = p.user[f.members[k]];
        const std::size_t begin = std::max(lo, f.offsets[k]), end = std::min(hi, f.offsets[k] + u.n);
        if (begin >= end) continue;
        const void* from = static_cast<const unsigned char*>(u.device_grads) + (begin - f.offsets[k]) * elem;
        if (Status s = device.copy_on_device(at(f.shard_grads, begin - lo, f.dtype), from, (end - begin) * elem, Stream::compute); !s.ok()) return s;
      }
      continue;
    }
    if (!p.options.flat_buffers) {
      for (std::size_t k = 0; k < f.members.size(); ++k) {
        const ParamSpec& u = p.user[f.members[k]];
        if (Status s = device.copy_on_device(at(f.grads, f.offsets[k], f.dtype), u.device_grads, u.n * elem, Stream::compute); !s.ok()) return s;
      }
    }
    if (Status s = p.comm->reduce_scatter(f.grads, f.shard_grads, f.shard, f.dtype, Stream::compute); !s.ok()) return s;
  }
  return Status::success();
}

Status OffloadOptimizer::Impl::partition_gather_weights() {
  Partition& p = *partition;
  const std::size_t rank = static_cast<std::size_t>(p.comm->rank());
  for (Partition::Flat& f : p.flats) {
    if (Status s = p.comm->all_gather(at(f.weights, rank * f.shard, f.dtype), f.weights, f.shard, f.dtype, Stream::compute); !s.ok()) return s;
    if (p.options.flat_buffers) continue;
    for (std::size_t k = 0; k < f.members.size(); ++k) {
      const ParamSpec& u = p.user[f.members[k]];
      if (Status s = device.copy_on_device(u.device_weights, at(f.weights, f.offsets[k], f.dtype), u.n * dtype_size(f.dtype), Stream::compute); !s.ok()) return s;
    }
  }
  return Status::success();
}

Result<OffloadOptimizer> OffloadOptimizer::create(Device& device, std::vector<ParamGroup> groups,
                                                  std::vector<ParamSpec> params, const OffloadOptions& options,
                                                  Collectives* comm) {
  if (comm != nullptr && comm->world() > 1 && options.gradient_accumulation_steps > 1) {
    return Status(StatusCode::unsupported, "a partitioned optimizer does not accumulate micro-batches on the host yet: "
                  "accumulate them in the device's gradients and report each step once (gradient_accumulation_steps = 1)");
  }
  if (comm == nullptr || comm->world() == 1) return create(device, std::move(groups), std::move(params), options);
  if (Status s = check_inputs(groups, params, options); !s.ok()) return s;
  if (options.spill_grads) {
    return Status(StatusCode::unsupported, "spill_grads with a partitioned optimizer: its gradients are reduced in "
                  "flat buffers on the device; shard the model with FSDP2 instead, whose gradient shards each rank spills");
  }
  for (const ParamSpec& p : params) {
    if (p.tier != nullptr) {
      return Status(StatusCode::unsupported, "parameter '" + p.name + "' lives in a parameter tier: a partitioned "
                    "optimizer cannot gather weights into a tier yet; offload parameters with world size 1");
    }
  }
  if (options.schedule != Schedule::sync) {
    return invalid_argument("a partitioned optimizer (world " + std::to_string(comm->world()) +
                            ") runs schedule sync; " + std::string(schedule_name(options.schedule)) +
                            " is not supported with partitioning yet");
  }
  const std::size_t world = static_cast<std::size_t>(comm->world()), rank = static_cast<std::size_t>(comm->rank());
  auto part = std::make_unique<Impl::Partition>();
  part->comm = comm;
  part->options = options.partition;
  part->flats = flatten(params, world);
  Status s;
  for (Impl::Partition::Flat& f : part->flats) {
    if (part->options.flat_buffers) {
      s = adopt_trainer_buffers(f, params);
    } else {
      s = allocate_flat(device, f, params, world);
    }
    const bool reduced_here = !(part->options.grads_averaged && part->options.flat_buffers);
    if (s.ok() && reduced_here) {
      Result<void*> r = device.allocate(f.shard * dtype_size(f.dtype));
      s = r.status();
      if (r.ok()) f.shard_grads = r.value();
    }
    if (!s.ok()) break;
  }
  if (!s.ok()) {
    part->release(device);
    return s;
  }
  // This rank's pieces, dtype by dtype: each parameter's intersection with [rank * shard, (rank + 1) * shard).
  std::vector<ParamSpec> pieces;
  for (const Impl::Partition::Flat& f : part->flats) {
    const std::size_t lo = rank * f.shard, hi = lo + f.shard;
    for (std::size_t k = 0; k < f.members.size(); ++k) {
      const ParamSpec& u = params[f.members[k]];
      const std::size_t begin = std::max(lo, f.offsets[k]), end = std::min(hi, f.offsets[k] + u.n);
      if (begin >= end) continue;
      ParamSpec piece;
      piece.n = end - begin;
      piece.dtype = f.dtype;
      piece.group = u.group;
      piece.device_weights = at(f.weights, begin, f.dtype);
      piece.device_grads = f.shard_grads != nullptr ? at(f.shard_grads, begin - lo, f.dtype) : at(f.grads, begin, f.dtype);
      pieces.push_back(piece);
      part->origin.push_back(Piece{f.members[k], begin - f.offsets[k], end - begin});
    }
  }
  part->user = std::move(params);
  Result<OffloadOptimizer> made = create(device, std::move(groups), std::move(pieces), options);
  if (!made.ok()) {
    part->release(device);
    return made.status();
  }
  made->impl_->partition = std::move(part);
  return made;
}

}  // namespace zoe
