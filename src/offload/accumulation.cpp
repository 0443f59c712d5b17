// Gradient accumulation on the host (docs/architecture.md, "Gradient accumulation"): each micro-batch's gradient comes
// down as it is reported and is added into an fp32 accumulator by the SIMD kernel (CpuAdam::accumulate);
// the device's buffer is zeroed for the next micro-batch. On the last report the sum goes back into the
// device's buffer rounded to its dtype — what a trainer that clips or logs p.grad must see — while the step
// reads the fp32 sum itself, never a 16-bit one.
//
// A micro-batch's gradient must be out of the device's buffer before the next micro-batch's backward
// accumulates into it, and the trainer calls nothing in between: in place (the CPU) a report adds and zeroes
// before it returns. A device with its own memory copies the gradient down and zeroes it on its copy stream,
// which the compute stream waits for, and the add runs on a worker while backward goes on. The last report
// of a step is synchronous: the rounded sum must be in the device's buffer when it returns.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "src/offload/host_device.h"
#include "src/offload/footprint.h"
#include "src/offload/optimizer_impl.h"

namespace zoe {
namespace {

// fp32 to the parameter's dtype, round to nearest even, on the engine's threads piece by piece.
void round_into(CpuAdam& adam, const float* from, void* to, DType dtype, std::size_t n, std::size_t piece) {
  if (dtype == DType::f32) {
    std::memcpy(to, from, n * 4);
    return;
  }
  auto* out = static_cast<std::uint16_t*>(to);
  adam.parallel_for((n + piece - 1) / piece, [&](std::size_t k) {
    const std::size_t end = std::min(n, (k + 1) * piece);
    for (std::size_t e = k * piece; e < end; ++e) out[e] = dtype == DType::f16 ? float_to_f16(from[e]) : float_to_bf16(from[e]);
  });
}

}  // namespace

// allocate_accumulation's fp32 sums.
SpaceNeed accumulation_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options) {
  SpaceNeed need;
  if (options.gradient_accumulation_steps <= 1) return need;
  std::size_t total = 0;
  for (const ParamSpec& p : params) total += p.n;
  const std::size_t sets = options.schedule == Schedule::delayed ? 2 : 1;
  need.add_ram("fp32 micro-batch sums", sets * AlignedBuffer::size_for(std::max<std::size_t>(total, 1) * 4));
  return need;
}

Status OffloadOptimizer::Impl::allocate_accumulation() {
  if (!accumulates()) return Status::success();
  reports.assign(params.size(), 0);
  if (!in_place) {
    add_worker = std::make_unique<WorkQueue>();
    add_queued.assign(params.size(), 0);
  }
  const int sets = options.schedule == Schedule::delayed ? 2 : 1;
  for (int s = 0; s < sets; ++s) {
    Result<AlignedBuffer> r = AlignedBuffer::allocate(std::max<std::size_t>(offsets.back(), 1) * 4);
    if (!r.ok()) return r.status();
    accum[s] = std::move(r).value();
    added[s].assign(params.size(), 0);
  }
  return Status::success();
}

Result<EventId> OffloadOptimizer::Impl::copy_down(std::size_t i, int set) {
  const ParamSpec& p = params[i];
  const std::size_t bytes = p.n * dtype_size(p.dtype);
  Result<EventId> produced = device.record(Stream::compute);
  if (!produced.ok()) return produced.status();
  if (Status s = device.wait(Stream::d2h, produced.value()); !s.ok()) return s;
  if (Status s = device.copy_to_host(grad_of(i, set), p.device_grads, bytes, Stream::d2h); !s.ok()) return s;
  count_bytes(stats_.d2h_bytes, bytes);
  return device.record(Stream::d2h);
}

Status OffloadOptimizer::Impl::drain_adds() {
  if (!add_worker) return Status::success();
  add_worker->drain();
  std::fill(add_queued.begin(), add_queued.end(), 0);
  return std::exchange(add_status, Status::success());
}

Status OffloadOptimizer::Impl::add_micro_batch(std::size_t i, int set, bool last) {
  const ParamSpec& p = params[i];
  const std::size_t bytes = p.n * dtype_size(p.dtype);
  if (p.n == 0) {
    ++added[set][i];
    return Status::success();
  }
  if (!in_place && !last) return queue_micro_batch(i, set);
  // The queued adds first: each element's additions stay in micro-batch order, and the step (or the
  // overlap schedule's speculative steps) may use the engine's threads once they are done.
  if (Status s = drain_adds(); !s.ok()) return s;
  // The gradient on the host: in place, or copied down once the compute stream has produced it.
  void* grad = const_cast<void*>(p.device_grads);
  if (!in_place) {
    grad = grad_of(i, set);
    Result<EventId> copied = copy_down(i, set);
    if (!copied.ok()) return copied.status();
    if (Status s = device.synchronize(copied.value()); !s.ok()) return s;
  } else {
    Result<EventId> produced = device.record(Stream::compute);
    if (!produced.ok()) return produced.status();
    if (Status s = device.synchronize(produced.value()); !s.ok()) return s;
  }
  float* sum = accum[set].as<float>() + offsets[i];
  AccumulateOptions ao;
  ao.first = added[set][i] == 0;
  ao.zero_source = in_place && !last;
  if (Status s = adam.accumulate(AccumulateTensor{sum, grad, p.dtype, p.n}, ao); !s.ok()) {
    return Status(s.code(), "gradient accumulation, parameter " + std::to_string(i) + ": " + s.message(), s.sys_errno());
  }
  ++added[set][i];
  if (!last) return Status::success();  // in place: zeroed by the add
  round_into(adam, sum, grad, p.dtype, p.n, std::max<std::size_t>(options.tile, 1));
  if (in_place) return Status::success();
  // A tiered parameter's gradient leaves the device when reported: its buffer may be the next block's now,
  // and the rounded sum stays in the staging, where a step called again after a failure reads it.
  if (grad_leaves_when_reported(i)) return Status::success();
  // The rounded sum back into the device's buffer; the compute stream (the trainer reading it, the next
  // backward) waits for it.
  if (Status s = device.copy_to_device(const_cast<void*>(p.device_grads), grad, bytes, Stream::h2d); !s.ok()) return s;
  count_bytes(stats_.h2d_bytes, bytes);
  Result<EventId> done = device.record(Stream::h2d);
  if (!done.ok()) return done.status();
  return device.wait(Stream::compute, done.value());
}

Status OffloadOptimizer::Impl::queue_micro_batch(std::size_t i, int set) {
  const ParamSpec& p = params[i];
  const std::size_t bytes = p.n * dtype_size(p.dtype);
  if (add_queued[i]) {
    if (Status s = drain_adds(); !s.ok()) return s;  // its staging still holds the previous micro-batch
  }
  void* grad = grad_of(i, set);
  Result<EventId> copied = copy_down(i, set);
  if (!copied.ok()) return copied.status();
  // After the copy on the same stream: the next backward (which waits for it) starts from zeros.
  if (Status s = device.fill_zero(const_cast<void*>(p.device_grads), bytes, Stream::d2h); !s.ok()) return s;
  Result<EventId> zeroed = device.record(Stream::d2h);
  if (!zeroed.ok()) return zeroed.status();
  if (Status s = device.wait(Stream::compute, zeroed.value()); !s.ok()) return s;
  AccumulateOptions ao;
  ao.first = added[set][i]++ == 0;
  add_queued[i] = 1;
  float* sum = accum[set].as<float>() + offsets[i];
  add_worker->enqueue([this, i, sum, grad, ao, copied = copied.value()] {
    if (!add_status.ok()) return;
    Status s = device.synchronize(copied);
    if (s.ok()) s = adam.accumulate(AccumulateTensor{sum, grad, params[i].dtype, params[i].n}, ao);
    if (!s.ok()) add_status = Status(s.code(), "gradient accumulation, parameter " + std::to_string(i) + ": " + s.message(), s.sys_errno());
  });
  return Status::success();
}

Status OffloadOptimizer::Impl::finish_accumulation(int set) {
  if (!accumulates()) return Status::success();
  if (Status s = drain_adds(); !s.ok()) return s;
  const int k = options.gradient_accumulation_steps;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (added[set][i] > 0 && reports[i] < k) {
      if (Status s = add_micro_batch(i, set, true); !s.ok()) return s;
    }
  }
  return Status::success();
}

void OffloadOptimizer::Impl::drop_accumulation(int set) {
  if (!accumulates()) return;
  (void)drain_adds();  // what they added is dropped with the sums
  std::fill(added[set].begin(), added[set].end(), 0);
}

void OffloadOptimizer::Impl::reset_accumulation(int set) {
  if (!accumulates()) return;
  std::fill(reports.begin(), reports.end(), 0);
  std::fill(added[set].begin(), added[set].end(), 0);
}

}  // namespace zoe
