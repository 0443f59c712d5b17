// OffloadOptimizer: the offloaded step and its three schedules (DESIGN.md "Schedules").
//
// Per parameter the host holds fp32 master weights and moments, and in device-copyable staging its
// gradients (as the device stores them) and its 16-bit weights (what the device holds; for f32 parameters
// the master itself is sent). Gradients come down (D2H) with their sum of squares and NaN/Inf count
// computed on the device; the CPU Adam step runs with loss-scale unscale and clip coefficient fused;
// weights go up (H2D). Tier nvme keeps master and moments in a swap store instead; a device whose memory is
// host memory (the CPU) is read and written in place; a partitioned optimizer steps this rank's pieces of
// the flattened parameters (see create(..., Collectives*)).
//
// Exactness: every schedule steps each element with the same grad_scale = coef / loss_scale (coef from
// the global norm summed in piece order), and the kernels are element-wise, so overlap and delayed
// give the bits sync would give for the same gradients.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <utility>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "src/aligned_buffer.h"
#include "src/offload/loss_scaler.h"
#include "src/offload/optimizer_impl.h"
#include "simd/dispatch.h"

namespace zoe {

std::string_view tier_name(Tier tier) { return tier == Tier::ram ? "ram" : "nvme"; }

std::string_view schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::sync: return "sync";
    case Schedule::overlap: return "overlap";
    case Schedule::delayed: return "delayed";
  }
  return "invalid";
}

Result<Tier> parse_tier(std::string_view name) {
  for (Tier t : {Tier::ram, Tier::nvme}) {
    if (name == tier_name(t)) return t;
  }
  return invalid_argument("tier '" + std::string(name) + "' is unknown: use ram or nvme");
}

Result<Schedule> parse_schedule(std::string_view name) {
  for (Schedule s : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    if (name == schedule_name(s)) return s;
  }
  return invalid_argument("schedule '" + std::string(name) + "' is unknown: use sync, overlap or delayed");
}

namespace {

constexpr const char* kStoreName = "zoe-optimizer";

std::size_t staging_bytes(const ParamSpec& p) { return p.n * dtype_size(p.dtype); }

Status check_inputs(const std::vector<ParamGroup>& groups, const std::vector<ParamSpec>& params,
                    const OffloadOptions& options) {
  if (groups.empty()) return invalid_argument("no param groups: pass at least one");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    const std::string where = "parameter " + std::to_string(i);
    if (!dtype_valid(p.dtype)) return invalid_argument(where + ": dtype " + std::to_string(int(p.dtype)) + " is invalid");
    if (p.group < 0 || static_cast<std::size_t>(p.group) >= groups.size()) {
      return invalid_argument(where + ": group " + std::to_string(p.group) + " does not exist (" +
                              std::to_string(groups.size()) + " groups)");
    }
    if (p.n > 0 && (p.device_weights == nullptr || p.device_grads == nullptr)) {
      return invalid_argument(where + ": device weights or gradients are null with n = " + std::to_string(p.n));
    }
  }
  if (!(options.max_grad_norm >= 0) || !std::isfinite(options.max_grad_norm)) {
    return invalid_argument("max_grad_norm = " + std::to_string(options.max_grad_norm) + " is invalid: need >= 0");
  }
  const LossScaleOptions& ls = options.loss_scale;
  if (ls.enabled && (!(ls.initial_scale > 0) || !(ls.static_scale > 0) || !(ls.min_scale > 0) ||
                     !(ls.backoff_factor > 0 && ls.backoff_factor < 1) || !(ls.growth_factor >= 1) ||
                     ls.growth_interval < 1)) {
    return invalid_argument("loss scaling: scales must be > 0, 0 < backoff_factor < 1, growth_factor >= 1, "
                            "growth_interval >= 1");
  }
  if (options.tier == Tier::nvme) {
#ifndef ZOE_HAVE_AIO
    return Status(StatusCode::unsupported, "tier nvme: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
#endif
    if (options.nvme.paths.empty()) return invalid_argument("tier nvme needs at least one nvme_path");
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].dtype == DType::f32) {
        return invalid_argument("parameter " + std::to_string(i) +
                                " is f32 on the device: tier nvme sends the device f16 or bf16 weights; use tier ram");
      }
    }
  }
  if (options.delayed_warmup_steps < 0) return invalid_argument("delayed_warmup_steps must be >= 0");
  return Status::success();
}

}  // namespace

OffloadOptimizer::Impl::Impl(Device& d, std::vector<ParamGroup> g, std::vector<ParamSpec> p, const OffloadOptions& o,
                             CpuAdam a)
    : device(d), options(o), groups(std::move(g)), params(std::move(p)), adam(std::move(a)), scaler(o.loss_scale) {}

OffloadOptimizer::Impl::~Impl() {
  background.reset();  // joins the delayed step before the buffers it uses go
  (void)device.synchronize();
  for (void* h : {grad_staging[0], grad_staging[1], weight_staging}) device.free_host(h);
  if (partition) {
    for (void* d : {partition->flat_grads, partition->flat_weights, partition->shard_grads}) device.free(d);
  }
}

Status OffloadOptimizer::Impl::allocate() {
  offsets.resize(params.size() + 1, 0);
  grad_offsets.resize(params.size() + 1, 0);
  weight_offsets.resize(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    offsets[i + 1] = offsets[i] + params[i].n;
    grad_offsets[i + 1] = grad_offsets[i] + staging_bytes(params[i]);
    weight_offsets[i + 1] = weight_offsets[i] + (params[i].dtype == DType::f32 ? 0 : params[i].n * 2);
  }
  const std::size_t piece = std::max<std::size_t>(options.tile, 1);
  first_piece.assign(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    first_piece[i] = pieces.size();
    for (std::size_t b = 0; b < params[i].n; b += piece) pieces.push_back({i, b, std::min(piece, params[i].n - b)});
  }
  first_piece.back() = pieces.size();
  const std::size_t total = offsets.back();
  in_place = device.host_memory() && options.tier == Tier::ram && options.schedule != Schedule::delayed;
  need_stats = !in_place || options.max_grad_norm > 0 || options.loss_scale.enabled || options.refuse_non_finite;
  for (AlignedBuffer* b : {&master, &exp_avg, &exp_avg_sq}) {
    if (options.tier == Tier::nvme) break;
    Result<AlignedBuffer> r = AlignedBuffer::allocate(total * 4);
    if (!r.ok()) return r.status();
    *b = std::move(r).value();
    // In place, f32 parameters keep their master on the device: their part of `master` is never touched
    // (glibc maps large allocations lazily, so untouched pages cost no memory); the rest is written at start-up.
    if (total > 0 && !(in_place && b == &master)) std::memset(b->data(), 0, total * 4);
  }
  // Speculation in the overlap schedule fails only when clipping, an fp16 overflow or a refused NaN/Inf
  // changes the step: only then is an undo copy kept.
  // Tier nvme does not speculate: its steps are not undone (overlap brings the gradients down during
  // backward, and steps once they are all down).
  speculation_can_fail = options.schedule == Schedule::overlap && options.tier == Tier::ram &&
                         (options.max_grad_norm > 0 || options.loss_scale.enabled || options.refuse_non_finite);
  if (speculation_can_fail) {
    for (AlignedBuffer* b : {&undo_master, &undo_exp_avg, &undo_exp_avg_sq}) {
      Result<AlignedBuffer> r = AlignedBuffer::allocate(total * 4);
      if (!r.ok()) return r.status();
      *b = std::move(r).value();
    }
    Result<AlignedBuffer> r = AlignedBuffer::allocate(weight_offsets.back());
    if (!r.ok()) return r.status();
    undo_weights = std::move(r).value();
  }
  const int grad_sets = options.schedule == Schedule::delayed ? 2 : 1;
  for (int s = 0; s < grad_sets; ++s) {
    Result<void*> r = device.allocate_host(in_place ? 1 : std::max<std::size_t>(grad_offsets.back(), 1));
    if (!r.ok()) return r.status();
    grad_staging[s] = r.value();
    stats[s].assign(pieces.size(), GradStats{});
  }
  Result<void*> w = device.allocate_host(in_place ? 1 : std::max<std::size_t>(weight_offsets.back(), 1));
  if (!w.ok()) return w.status();
  weight_staging = w.value();
  reported.assign(params.size(), 0);
  h2d_sent.assign(params.size(), 0);
  grad_done.assign(params.size(), 0);
  if (options.tier == Tier::nvme) {
    SwapOptions so = SwapOptions::from(options.nvme);
    so.adam = &adam;
    // Tiles are whole O_DIRECT blocks of fp32 values.
    const std::size_t align_elems = std::max<std::size_t>(so.alignment, 4096) / 4;
    const std::size_t tile = (std::max<std::size_t>(options.tile, 1) + align_elems - 1) / align_elems * align_elems;
    if (Status s = SwapStore::remove(so, kStoreName); !s.ok()) return s;
    Result<SwapStore> made = SwapStore::create(so, kStoreName, total, tile);
    if (!made.ok()) return made.status();
    store = std::make_unique<SwapStore>(std::move(made).value());
  }
  stepped.assign(pieces.size(), 0);
  return Status::success();
}

// The master weights start as the device weights: 16-bit values convert to fp32 exactly.
Status OffloadOptimizer::Impl::load_initial_weights() {
  for (std::size_t i = 0; i < params.size() && !in_place; ++i) {
    const ParamSpec& p = params[i];
    if (p.n == 0) continue;
    void* dst = p.dtype == DType::f32 ? static_cast<void*>(master_of(i)) : weights_of(i);
    if (Status s = device.copy_to_host(dst, p.device_weights, staging_bytes(p), Stream::d2h); !s.ok()) return s;
  }
  Result<EventId> e = device.record(Stream::d2h);
  if (!e.ok()) return e.status();
  if (Status s = device.synchronize(e.value()); !s.ok()) return s;
  visible_scale = scaler.scale();
  if (store) return open_store();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.dtype == DType::f32) continue;
    const auto* w = static_cast<const std::uint16_t*>(weights_of(i));
    float* m = master_of(i);
    for (std::size_t k = 0; k < p.n; ++k) m[k] = p.dtype == DType::f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
  }
  return Status::success();
}

// The swap store starts from the device's 16-bit weights, widened tile by tile: the fp32 state is never
// whole in RAM.
Status OffloadOptimizer::Impl::open_store() {
  std::size_t param = 0;
  return store->initialize([this, &param](std::size_t offset, std::size_t count, float* p) {
    for (std::size_t done = 0; done < count;) {
      while (offsets[param + 1] <= offset + done) ++param;
      const std::size_t at = offset + done - offsets[param];
      const std::size_t n = std::min(count - done, params[param].n - at);
      const auto* w = static_cast<const std::uint16_t*>(weights_of(param)) + at;
      const bool f16 = params[param].dtype == DType::f16;
      for (std::size_t k = 0; k < n; ++k) p[done + k] = f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
      done += n;
    }
    return Status::success();
  });
}

Status OffloadOptimizer::Impl::read_flat(int which, std::size_t offset, std::size_t count, float* dst) {
  if (store) {
    float* arrays[3] = {nullptr, nullptr, nullptr};
    arrays[which] = dst;
    return store->read(offset, count, arrays[0], arrays[1], arrays[2]);
  }
  if (which != 0) {
    std::memcpy(dst, (which == 1 ? exp_avg : exp_avg_sq).as<float>() + offset, count * 4);
    return Status::success();
  }
  // The master, parameter by parameter: in place, an f32 parameter's is on the device.
  std::size_t i = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), offset) - offsets.begin()) - 1;
  for (std::size_t done = 0; done < count; ++i) {
    const std::size_t at = offset + done - offsets[i], n = std::min(count - done, params[i].n - at);
    std::memcpy(dst + done, master_of(i) + at, n * 4);
    done += n;
  }
  return Status::success();
}

AdamTensor OffloadOptimizer::Impl::tensor(const Piece& k, int set) {
  const ParamSpec& p = params[k.param];
  const std::size_t elem = dtype_size(p.dtype);
  AdamTensor t;
  t.param = master_of(k.param) + k.begin;
  t.exp_avg = exp_avg.as<float>() + offsets[k.param] + k.begin;
  t.exp_avg_sq = exp_avg_sq.as<float>() + offsets[k.param] + k.begin;
  t.grad = static_cast<unsigned char*>(grad_of(k.param, set)) + k.begin * elem;
  t.grad_dtype = p.dtype;
  t.out = p.dtype == DType::f32 ? nullptr : static_cast<unsigned char*>(weights_of(k.param)) + k.begin * 2;
  t.out_dtype = p.dtype == DType::f32 ? DType::bf16 : p.dtype;
  t.n = k.n;
  return t;
}

Status OffloadOptimizer::Impl::enqueue_d2h(std::size_t i, int set, bool step_pieces) {
  const ParamSpec& p = params[i];
  // The copy starts only once the compute stream has produced the gradient.
  Result<EventId> produced = device.record(Stream::compute);
  if (!produced.ok()) return produced.status();
  if (Status s = device.wait(Stream::d2h, produced.value()); !s.ok()) return s;
  const std::size_t elem = dtype_size(p.dtype);
  for (std::size_t k = first_piece[i]; k < first_piece[i + 1]; ++k) {
    const std::size_t at = pieces[k].begin * elem, bytes = pieces[k].n * elem;
    const void* from = static_cast<const unsigned char*>(p.device_grads) + at;
    if (!in_place) {
      void* to = static_cast<unsigned char*>(grad_of(i, set)) + at;
      if (Status s = device.copy_to_host(to, from, bytes, Stream::d2h); !s.ok()) return s;
    }
    if (need_stats) {
      if (Status s = device.grad_stats(from, p.dtype, pieces[k].n, &stats[set][k], Stream::d2h); !s.ok()) return s;
    } else {
      stats[set][k] = GradStats{};
    }
    if (step_pieces) {
      Result<EventId> copied = device.record(Stream::d2h);
      if (!copied.ok()) return copied.status();
      if (Status s = step_piece_when_down(k, copied.value()); !s.ok()) return s;
    }
  }
  if (!in_place) stats_.d2h_bytes += staging_bytes(p);
  return Status::success();
}

Status OffloadOptimizer::Impl::enqueue_h2d(std::size_t i) {
  const ParamSpec& p = params[i];
  if (p.n == 0 || in_place) return Status::success();  // in place: the step wrote the device's weights
  const void* src = p.dtype == DType::f32 ? static_cast<const void*>(master_of(i)) : weights_of(i);
  stats_.h2d_bytes += staging_bytes(p);
  return device.copy_to_device(p.device_weights, src, staging_bytes(p), Stream::h2d);
}

Status OffloadOptimizer::Impl::enqueue_h2d(const Piece& k) {
  const ParamSpec& p = params[k.param];
  if (in_place) return Status::success();
  const std::size_t elem = dtype_size(p.dtype), at = k.begin * elem, bytes = k.n * elem;
  const void* src = p.dtype == DType::f32 ? static_cast<const void*>(master_of(k.param) + k.begin)
                                          : static_cast<const unsigned char*>(weights_of(k.param)) + at;
  stats_.h2d_bytes += bytes;
  return device.copy_to_device(static_cast<unsigned char*>(p.device_weights) + at, src, bytes, Stream::h2d);
}

Result<EventId> OffloadOptimizer::Impl::weights_sent() {
  Result<EventId> sent = device.record(Stream::h2d);
  if (!sent.ok()) return sent.status();
  if (Status s = device.wait(Stream::compute, sent.value()); !s.ok()) return s;
  return device.record(Stream::h2d);
}

Status OffloadOptimizer::Impl::finish_h2d() {
  Result<EventId> sent = weights_sent();
  // The host waits too: the weight staging is rewritten by the next step.
  return sent.ok() ? device.synchronize(sent.value()) : sent.status();
}

// One CpuAdam call per param group over the given pieces (a multi-tensor step).
Status OffloadOptimizer::Impl::adam_pieces(const std::vector<std::size_t>& which, float grad_scale, int set,
                                           const std::vector<ParamGroup>& hyper) {
  const auto start = std::chrono::steady_clock::now();
  StepOptions o;
  o.step = step_count.load() + 1;
  o.grad_scale = grad_scale;
  for (std::size_t g = 0; g < hyper.size(); ++g) {
    std::vector<AdamTensor> tensors;
    for (std::size_t k : which) {
      if (static_cast<std::size_t>(params[pieces[k].param].group) == g) tensors.push_back(tensor(pieces[k], set));
    }
    if (tensors.empty()) continue;
    if (Status s = adam.step(hyper[g].hyper, o, tensors); !s.ok()) return s;
  }
  stats_.adam_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::success();
}

Status OffloadOptimizer::Impl::adam_all(float grad_scale, int set, const std::vector<ParamGroup>& hyper) {
  if (store) {
    std::vector<SwapSegment> segments;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const ParamSpec& p = params[i];
      if (p.n == 0) continue;
      segments.push_back({offsets[i], p.n, &hyper[p.group].hyper, grad_of(i, set), p.dtype, weights_of(i), p.dtype});
    }
    StepOptions o;
    o.step = step_count.load() + 1;
    o.grad_scale = grad_scale;
    const Status s = store->step(segments, o);
    const SwapStats& io = store->last_stats();
    stats_.adam_s += io.total_s;
    stats_.nvme_read_bytes += io.read_bytes;
    stats_.nvme_write_bytes += io.write_bytes;
    stats_.nvme_read_s += io.read_s;
    stats_.nvme_write_s += io.write_s;
    return s;
  }
  std::vector<std::size_t> all(pieces.size());
  for (std::size_t k = 0; k < all.size(); ++k) all[k] = k;
  return adam_pieces(all, grad_scale, set, hyper);
}

void OffloadOptimizer::Impl::save_undo(const Piece& k) {
  const std::size_t off = offsets[k.param] + k.begin, w = weight_offsets[k.param] + k.begin * 2;
  std::memcpy(undo_master.as<float>() + off, master_of(k.param) + k.begin, k.n * 4);
  std::memcpy(undo_exp_avg.as<float>() + off, exp_avg.as<float>() + off, k.n * 4);
  std::memcpy(undo_exp_avg_sq.as<float>() + off, exp_avg_sq.as<float>() + off, k.n * 4);
  if (params[k.param].dtype != DType::f32) {
    std::memcpy(undo_weights.as<unsigned char>() + w, static_cast<unsigned char*>(weights_of(k.param)) + k.begin * 2, k.n * 2);
  }
}

void OffloadOptimizer::Impl::restore_undo(const Piece& k) {
  const std::size_t off = offsets[k.param] + k.begin, w = weight_offsets[k.param] + k.begin * 2;
  std::memcpy(master_of(k.param) + k.begin, undo_master.as<float>() + off, k.n * 4);
  std::memcpy(exp_avg.as<float>() + off, undo_exp_avg.as<float>() + off, k.n * 4);
  std::memcpy(exp_avg_sq.as<float>() + off, undo_exp_avg_sq.as<float>() + off, k.n * 4);
  if (params[k.param].dtype != DType::f32) {
    std::memcpy(static_cast<unsigned char*>(weights_of(k.param)) + k.begin * 2, undo_weights.as<unsigned char>() + w, k.n * 2);
  }
}

// From the gradients' statistics, summed in parameter order: skip (fp16 overflow), and the grad_scale that
// unscales and clips. Clipping follows torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6),
// applied only when below 1.
OffloadOptimizer::Impl::Decision OffloadOptimizer::Impl::decide(int set, float scale_used) const {
  double sum_sq = 0;
  std::uint64_t non_finite = 0;
  for (const GradStats& s : stats[set]) {
    sum_sq += s.sum_sq;
    non_finite += s.non_finite;
  }
  // Partitioned: the norm is over every rank's shard, and the summed gradients are averaged.
  double ranks = 1;
  if (partition) {
    double global[2] = {sum_sq, static_cast<double>(non_finite)};
    if (Status s = partition->comm->all_reduce_host(global, 2); !s.ok()) {
      Decision failed{true, NAN, 0.0f, s};
      return failed;
    }
    sum_sq = global[0];
    non_finite = static_cast<std::uint64_t>(global[1]);
    ranks = partition->comm->world();
  }
  Decision d{};
  d.overflow = options.loss_scale.enabled && non_finite > 0;
  d.refused = !options.loss_scale.enabled && options.refuse_non_finite && non_finite > 0;
  d.grad_norm = non_finite > 0 ? NAN : std::sqrt(sum_sq) / scale_used / ranks;
  double coef = 1.0;
  if (options.max_grad_norm > 0 && non_finite == 0) {
    coef = std::min(1.0, static_cast<double>(options.max_grad_norm) / (d.grad_norm + 1e-6));
  }
  d.grad_scale = static_cast<float>(coef / (scale_used * ranks));
  return d;
}

Status OffloadOptimizer::Impl::non_finite_error(int set) const {
  std::string which;
  std::uint64_t total = 0;
  std::size_t listed = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    std::uint64_t count = 0;
    for (std::size_t k = first_piece[i]; k < first_piece[i + 1]; ++k) count += stats[set][k].non_finite;
    if (count == 0) continue;
    total += count;
    if (listed++ < 5) which += (which.empty() ? "" : ", ") + std::to_string(i) + " (" + std::to_string(count) + ")";
  }
  if (listed > 5) which += ", ...";
  if (total == 0) which = "on another rank";
  return invalid_argument("step refused: NaN/Inf gradients in parameter(s) " + which +
                          "; no state changed (fp16 loss scaling would skip such a step; refuse_non_finite = false "
                          "lets them propagate as torch.optim does)");
}

void OffloadOptimizer::Impl::record_outcome(const Decision& d) {
  stats_.last_grad_norm = d.grad_norm;
  last_skipped = d.overflow;
  if (d.overflow) {
    ++stats_.skipped;
  } else {
    ++step_count;
    ++stats_.steps;
  }
  scaler.update(d.overflow);
}

// sync: every gradient down, then the decision, then the step, then every weight up.
Status OffloadOptimizer::Impl::step_sync() {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (Status s = enqueue_d2h(i, 0, false); !s.ok()) return s;
  }
  return finish_sync_step();
}

Status OffloadOptimizer::Impl::finish_sync_step() {
  Result<EventId> copied = device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  if (Status s = device.synchronize(copied.value()); !s.ok()) return s;
  const Decision d = decide(0, visible_scale);
  if (!d.error.ok()) return d.error;
  if (d.refused) return non_finite_error(0);
  if (!d.overflow) {
    if (Status s = adam_all(d.grad_scale, 0, groups); !s.ok()) return s;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (Status s = enqueue_h2d(i); !s.ok()) return s;
    }
    if (Status s = finish_h2d(); !s.ok()) return s;
  }
  record_outcome(d);
  visible_scale = scaler.scale();
  return Status::success();
}

// overlap: each reported parameter comes down piece by piece, and each piece is stepped speculatively — as
// if no clipping and no overflow — and sent up as soon as it is down, while backward goes on; pieces keep the
// work left after the last gradient short. step() validates: an overflow undoes every speculative step and
// resends the old weights; a clip coefficient below 1 undoes and redoes them with it.
Status OffloadOptimizer::Impl::grad_ready_overlap(std::size_t i) {
  if (reported[i]) return invalid_argument("parameter " + std::to_string(i) + " was reported ready twice in one iteration");
  reported[i] = 1;
  return enqueue_d2h(i, 0, store == nullptr);
}

Status OffloadOptimizer::Impl::step_piece_when_down(std::size_t k, EventId copied) {
  const float speculative_scale = static_cast<float>(1.0 / visible_scale);
  worker->enqueue([this, k, copied, speculative_scale] {
    if (!worker_status.ok()) return;
    if (Status s = device.synchronize(copied); !s.ok()) {
      worker_status = s;
      return;
    }
    if ((options.loss_scale.enabled || options.refuse_non_finite) && stats[0][k].non_finite > 0) overflow_seen = true;
    if (overflow_seen) return;  // this step will be skipped: stepping more would only be undone
    if (speculation_can_fail) save_undo(pieces[k]);
    if (Status s = adam_pieces({k}, speculative_scale, 0, groups); !s.ok()) {
      worker_status = s;
      return;
    }
    stepped[k] = 1;
    if (Status s = enqueue_h2d(pieces[k]); !s.ok()) worker_status = s;
  });
  return Status::success();
}

Status OffloadOptimizer::Impl::step_overlap() {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!reported[i]) {
      if (Status s = grad_ready_overlap(i); !s.ok()) return s;
    }
  }
  if (store) {
    std::fill(reported.begin(), reported.end(), 0);
    return finish_sync_step();
  }
  worker->drain();
  if (!worker_status.ok()) return std::exchange(worker_status, Status::success());
  const Decision d = decide(0, visible_scale);
  const float speculative_scale = static_cast<float>(1.0 / visible_scale);
  const bool skip = d.overflow || d.refused;
  const bool wrong = skip || d.grad_scale != speculative_scale;
  std::vector<std::size_t> redo;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (stepped[k] && wrong) {
      restore_undo(pieces[k]);
      if (skip) {
        if (Status s = enqueue_h2d(pieces[k]); !s.ok()) return s;  // the device gets its old weights back
      }
    }
    if (!skip && (!stepped[k] || wrong)) redo.push_back(k);
  }
  if (!redo.empty()) {
    ++stats_.redone;
    if (Status s = adam_pieces(redo, d.grad_scale, 0, groups); !s.ok()) return s;
    for (std::size_t k : redo) {
      if (Status s = enqueue_h2d(pieces[k]); !s.ok()) return s;
    }
  }
  if (Status s = finish_h2d(); !s.ok()) return s;
  std::fill(reported.begin(), reported.end(), 0);
  std::fill(stepped.begin(), stepped.end(), 0);
  overflow_seen = false;
  if (d.refused) return non_finite_error(0);
  record_outcome(d);
  visible_scale = scaler.scale();
  return Status::success();
}

// delayed (ZeRO-Offload's delayed parameter update): step() starts this step in the background and returns;
// the next iteration runs on the device with weights one step old while the CPU steps. The new weights go up
// parameter by parameter during that next iteration's backward: once a parameter's gradient is final, the
// device reads its weights no more in that iteration, so its H2D may overwrite them while backward goes on.
// The trainer usually runs ahead of the device, so whichever comes second — the gradient's report or the
// end of the background step — sends the weights; step() sends what is left.
Status OffloadOptimizer::Impl::grad_ready_delayed(std::size_t i) {
  if (reported[i]) return invalid_argument("parameter " + std::to_string(i) + " was reported ready twice in one iteration");
  reported[i] = 1;
  if (Status s = enqueue_d2h(i, grad_set, false); !s.ok()) return s;
  // Marks the work that produced gradient i: the last to read weights i in this iteration.
  Result<EventId> produced = device.record(Stream::compute);
  if (!produced.ok()) return produced.status();
  std::lock_guard lock(h2d_mutex);
  grad_done[i] = produced.value();
  report_order.push_back(i);
  if (!update_done) return Status::success();
  return send_weights(i);
}

Status OffloadOptimizer::Impl::send_weights(std::size_t i) {
  if (h2d_sent[i] || grad_done[i] == 0) return Status::success();
  const EventId after = std::exchange(grad_done[i], 0);
  if (Status s = device.wait(Stream::h2d, after); !s.ok()) return s;
  h2d_sent[i] = 1;
  return pending_h2d ? enqueue_h2d(i) : Status::success();
}

Status OffloadOptimizer::Impl::finish_background_step(const Status& status) {
  std::lock_guard lock(h2d_mutex);
  update_done = true;
  Status result = status;
  // In the order the gradients were reported: the device's stream runs in order, and a copy waiting for a
  // late gradient must not hold up those whose gradients came earlier.
  for (std::size_t k = 0; k < report_order.size() && result.ok(); ++k) result = send_weights(report_order[k]);
  return result;
}

Result<EventId> OffloadOptimizer::Impl::flush_delayed() {
  background->drain();
  std::lock_guard lock(h2d_mutex);
  Status status = std::exchange(worker_status, Status::success());
  // Every parameter not reported this iteration: after all the compute enqueued so far.
  Result<EventId> computed = device.record(Stream::compute);
  if (!computed.ok()) return computed.status();
  if (Status s = device.wait(Stream::h2d, computed.value()); !s.ok()) return s;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (h2d_sent[i]) continue;
    if (grad_done[i] != 0) {
      if (Status s = device.wait(Stream::h2d, std::exchange(grad_done[i], 0)); !s.ok()) return s;
    }
    if (pending_h2d && status.ok()) {
      if (Status s = enqueue_h2d(i); !s.ok()) return s;
    }
  }
  pending_h2d = false;
  update_done = false;
  std::fill(h2d_sent.begin(), h2d_sent.end(), 0);
  report_order.clear();
  // The background step failed or was refused: nothing of it reached the state or the device.
  if (!status.ok()) return Status(status.code(), "the previous step (delayed schedule): " + status.message(), status.sys_errno());
  visible_scale = scaler.scale();
  // The caller waits for the returned event before the weight staging is written again.
  return weights_sent();
}

Status OffloadOptimizer::Impl::step_delayed() {
  const int set = grad_set;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!reported[i]) {
      if (Status s = grad_ready_delayed(i); !s.ok()) return s;
    }
  }
  std::fill(reported.begin(), reported.end(), 0);
  const float scale_used = visible_scale;  // what this iteration's loss was scaled by
  Result<EventId> sent = flush_delayed();
  if (!sent.ok()) return sent.status();
  Result<EventId> copied = device.record(Stream::d2h);
  Result<EventId> copied_compute = device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  if (!copied_compute.ok()) return copied_compute.status();
  // The next backward must not overwrite the gradients before they are down.
  if (Status s = device.wait(Stream::compute, copied_compute.value()); !s.ok()) return s;
  grad_set ^= 1;
  background->enqueue([this, set, scale_used, copied = copied.value(), sent = sent.value(), hyper = groups] {
    Status s = device.synchronize(copied);
    // The weight staging is still being sent up until `sent` completes.
    if (Status t = device.synchronize(sent); s.ok()) s = t;
    if (s.ok()) {
      const Decision d = decide(set, scale_used);
      if (d.refused) s = non_finite_error(set);
      if (s.ok() && !d.overflow) {
        s = adam_all(d.grad_scale, set, hyper);
        if (s.ok()) pending_h2d = true;
      }
      if (s.ok()) record_outcome(d);
    }
    s = finish_background_step(s);
    if (!s.ok()) worker_status = s;
  });
  return Status::success();
}

Result<OffloadOptimizer> OffloadOptimizer::create(Device& device, std::vector<ParamGroup> groups,
                                                  std::vector<ParamSpec> params, const OffloadOptions& options) {
  if (Status s = check_inputs(groups, params, options); !s.ok()) return s;
  for (const ParamGroup& g : groups) {
    // Validate each group's hyper-parameters once, as the kernel would.
    if (Status s = CpuAdam::validate(g.hyper); !s.ok()) return s;
  }
  Result<CpuAdam> adam = CpuAdam::create(options.cpu);
  if (!adam.ok()) return adam.status();
  auto impl = std::make_unique<Impl>(device, std::move(groups), std::move(params), options, std::move(adam).value());
  if (Status s = impl->allocate(); !s.ok()) return s;
  if (Status s = impl->load_initial_weights(); !s.ok()) return s;
  if (options.schedule == Schedule::overlap) impl->worker = std::make_unique<WorkQueue>();
  if (options.schedule == Schedule::delayed) impl->background = std::make_unique<WorkQueue>();
  return OffloadOptimizer(std::move(impl));
}

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

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadOptimizer::OffloadOptimizer(OffloadOptimizer&&) noexcept = default;
OffloadOptimizer& OffloadOptimizer::operator=(OffloadOptimizer&&) noexcept = default;
OffloadOptimizer::~OffloadOptimizer() = default;

Status OffloadOptimizer::grad_ready(std::size_t param) {
  Impl& m = *impl_;
  const std::size_t count = m.partition ? m.partition->user.size() : m.params.size();
  if (param >= count) {
    return invalid_argument("grad_ready: parameter " + std::to_string(param) + " does not exist (" +
                            std::to_string(count) + " parameters)");
  }
  if (m.partition) return Status::success();  // sync: every gradient is taken at step()
  const bool warming_up = m.step_calls < m.options.delayed_warmup_steps;
  if (m.options.schedule == Schedule::overlap) return m.grad_ready_overlap(param);
  if (m.options.schedule == Schedule::delayed && !warming_up) return m.grad_ready_delayed(param);
  return Status::success();  // sync takes every gradient at step()
}

Status OffloadOptimizer::step() {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  Status s;
  if (m.options.schedule == Schedule::overlap) {
    s = m.step_overlap();
  } else if (m.options.schedule == Schedule::delayed && m.step_calls >= m.options.delayed_warmup_steps) {
    s = m.step_delayed();
  } else if (m.partition) {
    s = m.partition_reduce_grads();
    if (s.ok()) s = m.step_sync();
    if (s.ok() && !m.last_skipped) s = m.partition_gather_weights();
  } else {
    s = m.step_sync();
  }
  ++m.step_calls;
  m.stats_.step_call_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

Status OffloadOptimizer::wait() {
  Impl& m = *impl_;
  if (m.background) {
    Result<EventId> sent = m.flush_delayed();
    if (!sent.ok()) return sent.status();
    if (Status s = m.device.synchronize(sent.value()); !s.ok()) return s;
  }
  return m.device.synchronize();
}

AdamHyper& OffloadOptimizer::group_hyper(std::size_t group) { return impl_->groups.at(group).hyper; }
float OffloadOptimizer::loss_scale() const { return impl_->visible_scale; }
std::int64_t OffloadOptimizer::step_count() const { return impl_->step_count.load(); }
bool OffloadOptimizer::last_step_skipped() const { return impl_->last_skipped.load(); }
const StepStats& OffloadOptimizer::stats() const { return impl_->stats_; }

Status OffloadOptimizer::read_state(std::size_t param, float* master, float* exp_avg, float* exp_avg_sq) const {
  Impl& m = *impl_;
  if (param >= m.params.size()) return invalid_argument("read_state: parameter " + std::to_string(param) + " does not exist");
  const std::size_t off = m.offsets[param], n = m.params[param].n;
  if (m.store) return m.store->read(off, n, master, exp_avg, exp_avg_sq);
  if (master) std::memcpy(master, m.master_of(param), n * 4);
  if (exp_avg) std::memcpy(exp_avg, m.exp_avg.as<float>() + off, n * 4);
  if (exp_avg_sq) std::memcpy(exp_avg_sq, m.exp_avg_sq.as<float>() + off, n * 4);
  return Status::success();
}

}  // namespace zoe
