// Tier nvme's streamed step: see step_windows.h.
#include "src/offload/step_windows.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "src/offload/footprint.h"
#include "zoe/aligned_buffer.h"
#include "zoe/dtype.h"
#include "zoe/param_tier.h"
#include "zoe/plan.h"

namespace zoe {

static_assert(StepWindows::kWindowElements == plan::kStepWindowElements, "zoe plan counts the step's windows");

namespace {

// Elements per window, and bytes per element of the gradient window (4 with an f32 parameter).
std::pair<std::size_t, std::size_t> window_shape(const std::vector<ParamSpec>& params, const OffloadOptions& options,
                                                 std::size_t tile) {
  std::size_t largest = 0, stride = 2;
  for (const ParamSpec& p : params) {
    largest = std::max(largest, p.n);
    if (p.dtype == DType::f32) stride = 4;
  }
  return {std::max(options.step_window > 0 ? options.step_window : StepWindows::kWindowElements, largest + 2 * tile),
          stride};
}

}  // namespace

SpaceNeed step_windows_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t tile,
                                 bool grads_in_place) {
  const auto [capacity, stride] = window_shape(params, options, tile);
  SpaceNeed need;
  need.add_ram("the step's weight window", AlignedBuffer::io_size(capacity * 2));
  if (!grads_in_place) need.add_ram("the step's gradient window", AlignedBuffer::io_size(capacity * stride));
  return need;
}

Result<std::unique_ptr<StepWindows>> StepWindows::make(Impl& m, SwapStore& store, const std::vector<std::size_t>& at,
                                                       std::size_t tile) {
  std::unique_ptr<StepWindows> w(new StepWindows(m, store, at, tile));
  std::tie(w->capacity_, w->grad_stride_) = window_shape(m.params, m.options, tile);
  Result<void*> weights = m.device.allocate_host(w->capacity_ * 2);
  if (!weights.ok()) return weights.status();
  w->weights_ = static_cast<unsigned char*>(weights.value());
  if (!m.grads_in_place) {
    Result<void*> grads = m.device.allocate_host(w->capacity_ * w->grad_stride_);
    if (!grads.ok()) return grads.status();
    w->grads_ = static_cast<unsigned char*>(grads.value());
  }
  return w;
}

StepWindows::~StepWindows() {
  m_.device.free_host(weights_);
  m_.device.free_host(grads_);
}

std::size_t StepWindows::param_at(std::size_t store_at) const {
  return static_cast<std::size_t>(std::upper_bound(at_.begin(), at_.end() - 1, store_at) - at_.begin()) - 1;
}

Status StepWindows::step(float grad_scale, int set, const std::vector<ParamGroup>& hyper, SwapStats* io) {
  const std::size_t P = m_.params.size(), end = at_.back();
  // What an earlier resend (a load, write_state) left unsent stays marked: send_all_weights() retries it.
  if (m_.unsent.size() != P) m_.unsent.assign(P, 0);
  send_error_ = Status();
  StepOptions o;
  o.step = m_.step_count.load() + 1;
  o.grad_scale = grad_scale;
  std::size_t first = 0;  // the first parameter (in store order) whose weights are not sent yet
  std::size_t base = 0;   // the store element weights_[0] holds
  for (std::size_t lo = 0; lo < end;) {
    // Whole tiles from lo, as many as the weights from base leave room for (at least one: capacity_ holds
    // the largest parameter and two tiles).
    std::size_t hi = std::min(end, lo + tile_);
    while (hi < end && std::min(end, hi + tile_) - base <= capacity_) hi = std::min(end, hi + tile_);
    std::vector<SwapSegment> segments;
    std::vector<Piece> parts;  // what comes down into the gradient window: (param, first element, count)
    for (std::size_t i = param_at(lo); i < P && at_[i] < hi; ++i) {
      const ParamSpec& p = m_.params[i];
      const std::size_t a = std::max(lo, at_[i]), b = std::min(hi, at_[i] + p.n);
      if (p.n == 0 || a >= b || m_.is_absent(i, set)) continue;
      DType grad_dtype = p.dtype;
      const void* grad = nullptr;
      if (grads_ == nullptr) {
        grad = static_cast<const unsigned char*>(m_.step_grad(i, set, &grad_dtype)) + (a - at_[i]) * dtype_size(grad_dtype);
      } else {
        grad = grads_ + (a - lo) * grad_stride_;
        parts.push_back({i, a - at_[i], b - a});
      }
      void* out = p.dtype == DType::f32 ? static_cast<void*>(m_.tier->master(i) + (a - at_[i]))
                                        : static_cast<void*>(weights_ + (a - base) * 2);
      segments.push_back({a, b - a, &hyper[p.group].hyper, grad, grad_dtype, out, p.dtype, m_.bias_step(i)});
    }
    if (Status s = grads_down(parts, lo); !s.ok()) return s;
    Status stepped = store_.step(segments, o, /*last=*/hi == end);
    const SwapStats& last = store_.last_stats();
    io->read_bytes += last.read_bytes;
    io->write_bytes += last.write_bytes;
    io->read_s += last.read_s;
    io->write_s += last.write_s;
    io->total_s += last.total_s;
    if (!stepped.ok()) return stepped;
    // Every 16-bit parameter that ends in this window goes whole.
    std::vector<std::size_t> done;
    for (; first < P && at_[first] + m_.params[first].n <= hi; ++first) {
      const ParamSpec& p = m_.params[first];
      if (p.n > 0 && p.dtype != DType::f32 && !m_.is_absent(first, set)) done.push_back(first);
    }
    if (Status s = send(done, base); !s.ok()) return s;
    // The parameter that goes on into the next window keeps what it has so far at the window's start.
    if (first < P && at_[first] < hi) {
      std::memmove(weights_, weights_ + (at_[first] - base) * 2, (hi - at_[first]) * 2);
      base = at_[first];
    } else {
      base = hi;
    }
    lo = hi;
  }
  return Status::success();
}

// The window's gradients down from the device — or back from the spill file (spill_grads) — waited for
// before its tiles step.
Status StepWindows::grads_down(const std::vector<Piece>& parts, std::size_t lo) {
  if (parts.empty()) return Status::success();
  if (m_.spill != nullptr) {
    const std::uint64_t before = m_.spill->read_bytes();
    for (const Piece& k : parts) {
      void* to = grads_ + (at_[k.param] + k.begin - lo) * grad_stride_;
      if (Status s = m_.spill->read(k.param, k.begin, k.n, to); !s.ok()) return s;
    }
    Impl::count_bytes(m_.stats_.nvme_read_bytes, m_.spill->read_bytes() - before);
    return Status::success();
  }
  std::size_t bytes = 0;
  for (const Piece& k : parts) {
    const ParamSpec& p = m_.params[k.param];
    const std::size_t elem = dtype_size(p.dtype);
    void* to = grads_ + (at_[k.param] + k.begin - lo) * grad_stride_;
    const void* from = static_cast<const unsigned char*>(p.device_grads) + k.begin * elem;
    if (Status s = m_.device.copy_to_host(to, from, k.n * elem, Stream::d2h); !s.ok()) return s;
    bytes += k.n * elem;
  }
  Impl::count_bytes(m_.stats_.d2h_bytes, bytes);
  Result<EventId> copied = m_.device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  return m_.device.synchronize(copied.value());
}

// Parameters `done` (their weights in weights_ from store element `base`) to their parameter tier, a call per
// tier with each block's entries together, or to the device; the device's copies are waited for, so the
// window can be written again. A parameter whose write failed is marked unsent: send_all_weights() retries it.
Status StepWindows::send(const std::vector<std::size_t>& done, std::size_t base) {
  TierWrites writes;
  for (std::size_t i : done) {
    const ParamSpec& p = m_.params[i];
    const unsigned char* w = weights_ + (at_[i] - base) * 2;
    if (p.tier == nullptr) {
      Impl::count_bytes(m_.stats_.h2d_bytes, p.n * 2);
      if (Status s = m_.device.copy_to_device(p.device_weights, w, p.n * 2, Stream::h2d); !s.ok()) return s;
      m_.unsent[i] = 0;
      continue;
    }
    writes.add(p, i, w);
  }
  // A failed write: each entry kept its previous copy, or has the new one; either way, sent again.
  Status written = writes.write([&](std::size_t i, bool ok) { m_.unsent[i] = ok ? 0 : 1; });
  if (!written.ok() && send_error_.ok()) send_error_ = std::move(written);
  Result<EventId> sent = m_.device.record(Stream::h2d);
  if (!sent.ok()) return sent.status();
  return m_.device.synchronize(sent.value());
}

Status StepWindows::widen(std::size_t i, std::size_t begin, std::size_t n, float* out) {
  if (i < loaded_first_ || i >= loaded_end_) {
    // Parameters from i on, as many as the window holds, read in whole.
    loaded_first_ = i;
    loaded_base_ = at_[i];
    std::size_t j = i;
    for (; j < m_.params.size() && (j == i || at_[j] + m_.params[j].n - loaded_base_ <= capacity_); ++j) {
      const ParamSpec& p = m_.params[j];
      if (p.n == 0 || p.dtype == DType::f32) continue;
      void* to = weights_ + (at_[j] - loaded_base_) * 2;
      const Status s = p.tier != nullptr ? p.tier->read(p.tier_block, p.tier_entry, to, 0, p.n * 2)
                                         : m_.device.copy_to_host(to, p.device_weights, p.n * 2, Stream::d2h);
      if (!s.ok()) {
        loaded_end_ = loaded_first_;
        return s;
      }
    }
    loaded_end_ = j;
    Result<EventId> copied = m_.device.record(Stream::d2h);
    if (!copied.ok()) return copied.status();
    if (Status s = m_.device.synchronize(copied.value()); !s.ok()) return s;
  }
  const auto* w = reinterpret_cast<const std::uint16_t*>(weights_ + (at_[i] - loaded_base_ + begin) * 2);
  const bool f16 = m_.params[i].dtype == DType::f16;
  for (std::size_t k = 0; k < n; ++k) out[k] = f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
  return Status::success();
}

Status StepWindows::round_masters(std::size_t i, std::size_t first, std::size_t count, void* out) {
  const ParamSpec& p = m_.params[i];
  constexpr std::size_t kSlice = std::size_t(1) << 20;
  std::vector<float> masters(std::min(kSlice, count));
  const bool f16 = p.dtype == DType::f16;
  auto* w16 = static_cast<unsigned char*>(out);
  for (std::size_t b = 0; b < count; b += kSlice) {
    const std::size_t n = std::min(kSlice, count - b);
    if (Status s = store_.read(at_[i] + first + b, n, masters.data(), nullptr, nullptr, nullptr); !s.ok()) return s;
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint16_t w = f16 ? float_to_f16(masters[k]) : float_to_bf16(masters[k]);
      std::memcpy(w16 + (b + k) * 2, &w, 2);  // `out` may be a checkpoint slice at any even offset
    }
  }
  return Status::success();
}

Status StepWindows::resend(const std::vector<char>* which) {
  loaded_end_ = loaded_first_;  // weights_ is rewritten
  if (m_.unsent.size() != m_.params.size()) m_.unsent.assign(m_.params.size(), 0);
  send_error_ = Status();
  Status first;
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    const ParamSpec& p = m_.params[i];
    if (p.n == 0 || p.dtype == DType::f32 || (which != nullptr && !(*which)[i])) continue;
    Status s = round_masters(i, 0, p.n, weights_);
    if (s.ok()) {
      m_.unsent[i] = 0;  // send() marks it again if its write fails
      s = send({i}, at_[i]);
    }
    if (s.ok() && m_.unsent[i]) s = std::exchange(send_error_, Status());
    if (!s.ok()) {
      m_.unsent[i] = 1;
      if (first.ok()) first = std::move(s);
    }
  }
  return first;
}

// Only the elements asked for: rounding is element by element, and a checkpoint asks slice by slice.
Status StepWindows::read_weights16(std::size_t offset, std::size_t n, void* out) {
  auto* dst = static_cast<unsigned char*>(out);
  const std::vector<std::size_t>& wo = m_.weight_offsets;
  std::size_t i = static_cast<std::size_t>(std::upper_bound(wo.begin(), wo.end(), offset) - wo.begin()) - 1;
  for (; i < m_.params.size() && wo[i] < offset + n; ++i) {
    const std::size_t lo = std::max(offset, wo[i]), hi = std::min(offset + n, wo[i + 1]);
    if (lo >= hi) continue;  // an f32 parameter: no bytes in the blob
    // Byte offsets of 16-bit weights are even: elements [first, first + count) of parameter i.
    if (Status s = round_masters(i, (lo - wo[i]) / 2, (hi - lo) / 2, dst + (lo - offset)); !s.ok()) return s;
  }
  return Status::success();
}

}  // namespace zoe
