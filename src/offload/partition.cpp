// ZeRO partitioning (DESIGN.md "Beyond one machine"): every rank passes the same parameters and owns the
// optimizer state of its 1/W of their flattened elements. Gradients are reduce-scattered into this rank's
// shard on the device; the updated shards are all-gathered back into every parameter. The optimizer under
// it steps this rank's pieces of the parameters as if they were its own, with schedule sync.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/optimizer_impl.h"

namespace zoe {

Status OffloadOptimizer::Impl::partition_reduce_grads() {
  Partition& p = *partition;
  const std::size_t elem = dtype_size(p.dtype);
  for (std::size_t i = 0; i < p.user.size(); ++i) {
    void* to = static_cast<unsigned char*>(p.flat_grads) + p.user_offsets[i] * elem;
    if (Status s = device.copy_on_device(to, p.user[i].device_grads, p.user[i].n * elem, Stream::compute); !s.ok()) return s;
  }
  return p.comm->reduce_scatter(p.flat_grads, p.shard_grads, p.shard, p.dtype, Stream::compute);
}

Status OffloadOptimizer::Impl::partition_gather_weights() {
  Partition& p = *partition;
  const std::size_t elem = dtype_size(p.dtype);
  auto* flat = static_cast<unsigned char*>(p.flat_weights);
  const void* mine = flat + static_cast<std::size_t>(p.comm->rank()) * p.shard * elem;
  if (Status s = p.comm->all_gather(mine, flat, p.shard, p.dtype, Stream::compute); !s.ok()) return s;
  for (std::size_t i = 0; i < p.user.size(); ++i) {
    const void* from = flat + p.user_offsets[i] * elem;
    if (Status s = device.copy_on_device(p.user[i].device_weights, from, p.user[i].n * elem, Stream::compute); !s.ok()) return s;
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
  if (options.schedule != Schedule::sync) {
    return invalid_argument("a partitioned optimizer (world " + std::to_string(comm->world()) +
                            ") runs schedule sync; " + std::string(schedule_name(options.schedule)) +
                            " is not supported with partitioning yet");
  }
  auto part = std::make_unique<Impl::Partition>();
  part->comm = comm;
  part->dtype = params.empty() ? DType::bf16 : params[0].dtype;
  std::size_t total = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].dtype != part->dtype) {
      return invalid_argument("parameter " + std::to_string(i) + " is " + std::string(dtype_name(params[i].dtype)) +
                              ", parameter 0 is " + std::string(dtype_name(part->dtype)) +
                              ": a partitioned optimizer needs one dtype");
    }
    part->user_offsets.push_back(total);
    total += params[i].n;
  }
  const std::size_t world = static_cast<std::size_t>(comm->world()), rank = static_cast<std::size_t>(comm->rank());
  const std::size_t elem = dtype_size(part->dtype);
  part->shard = std::max<std::size_t>((total + world - 1) / world, 1);
  const std::size_t padded = part->shard * world;
  // Device buffers, freed on any failure below (and by the optimizer once it owns them).
  auto release = [&device](Impl::Partition& p) {
    for (void* d : {p.flat_grads, p.flat_weights, p.shard_grads}) device.free(d);
  };
  for (auto [slot, bytes] : {std::pair{&part->flat_grads, padded * elem}, std::pair{&part->flat_weights, padded * elem},
                             std::pair{&part->shard_grads, part->shard * elem}}) {
    Result<void*> r = device.allocate(bytes);
    if (!r.ok()) {
      release(*part);
      return r.status();
    }
    *slot = r.value();
  }
  // The flattened weights start as the parameters' own; the padding stays zero in both flat buffers.
  Status s;
  void* zeros = nullptr;
  if (padded > total) {
    Result<void*> z = device.allocate_host((padded - total) * elem);
    s = z.status();
    if (s.ok()) {
      zeros = z.value();
      std::memset(zeros, 0, (padded - total) * elem);
      for (void* flat : {part->flat_grads, part->flat_weights}) {
        if (s.ok()) s = device.copy_to_device(static_cast<unsigned char*>(flat) + total * elem, zeros, (padded - total) * elem, Stream::compute);
      }
    }
  }
  for (std::size_t i = 0; i < params.size() && s.ok(); ++i) {
    s = device.copy_on_device(static_cast<unsigned char*>(part->flat_weights) + part->user_offsets[i] * elem,
                              params[i].device_weights, params[i].n * elem, Stream::compute);
  }
  if (s.ok()) {
    Result<EventId> copied = device.record(Stream::compute);
    s = copied.ok() ? device.synchronize(copied.value()) : copied.status();
  }
  device.free_host(zeros);
  if (!s.ok()) {
    release(*part);
    return s;
  }
  // This rank's pieces: each parameter's intersection with [rank * shard, (rank + 1) * shard).
  const std::size_t lo = rank * part->shard, hi = lo + part->shard;
  std::vector<ParamSpec> pieces;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::size_t begin = std::max(lo, part->user_offsets[i]), end = std::min(hi, part->user_offsets[i] + params[i].n);
    if (begin >= end) continue;
    ParamSpec piece;
    piece.n = end - begin;
    piece.dtype = part->dtype;
    piece.group = params[i].group;
    piece.device_weights = static_cast<unsigned char*>(part->flat_weights) + begin * elem;
    piece.device_grads = static_cast<unsigned char*>(part->shard_grads) + (begin - lo) * elem;
    pieces.push_back(piece);
  }
  part->user = std::move(params);
  Result<OffloadOptimizer> made = create(device, std::move(groups), std::move(pieces), options);
  if (!made.ok()) {
    release(*part);
    return made.status();
  }
  made->impl_->partition = std::move(part);
  return made;
}

}  // namespace zoe
