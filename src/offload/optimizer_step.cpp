// What every schedule and tier shares: the parameters cut into pieces, the device staging, gradients down
// with their statistics, weights up, and the step decision.
//
// Per parameter the host holds fp32 master weights and moments (in the tier), and in device-copyable
// staging its gradients (as the device stores them) and its 16-bit weights (what the device holds; for f32
// parameters the master itself is sent). Gradients come down (D2H) with their sum of squares and NaN/Inf
// count computed on the device; the CPU Adam step runs with loss-scale unscale and clip coefficient fused;
// weights go up (H2D). A device whose memory is host memory (the CPU) is read and written in place.
//
// Exactness: every schedule steps each element with the same grad_scale = coef / loss_scale (coef from
// the global norm summed in piece order), and the kernels are element-wise, so overlap and delayed
// give the bits sync would give for the same gradients.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/footprint.h"
#include "src/offload/host_device.h"
#include "src/offload/optimizer_impl.h"
#include "zoe/param_tier.h"

namespace zoe {
namespace {

constexpr const char* kStoreName = "zoe-optimizer";

std::size_t staging_bytes(const ParamSpec& p) { return p.n * dtype_size(p.dtype); }

}  // namespace

OffloadOptimizer::Impl::Impl(Device& d, std::vector<ParamGroup> g, std::vector<ParamSpec> p, const OffloadOptions& o,
                             CpuAdam a)
    : device(d), options(o), groups(std::move(g)), params(std::move(p)), adam(std::move(a)), scaler(o.loss_scale) {
  rule = groups.at(0).hyper.rule;
  state_count = state_arrays(groups[0].hyper);
  state_names = zoe::state_names(groups[0].hyper);
  first_hyper = groups[0].hyper;
}

OffloadOptimizer::Impl::~Impl() {
  add_worker.reset();  // joins the queued micro-batch adds before the buffers they use go
  schedule.reset();  // joins the delayed step or the overlap worker before the buffers they use go
  (void)device.synchronize();
  spill.reset();  // its file goes while the store's owner lock, which covers the name, is still held
  tier.reset();
  for (void* h : {grad_staging[0], grad_staging[1], weight_staging, weight_aside}) device.free_host(h);
  if (partition) partition->release(device);
}

Status OffloadOptimizer::Impl::allocate() {
  if (Status s = check_optimizer_space(device, params, options, kStoreName, first_hyper); !s.ok()) return s;
  param_steps.assign(params.size(), 0);
  offsets.resize(params.size() + 1, 0);
  grad_offsets.resize(params.size() + 1, 0);
  weight_offsets.resize(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    offsets[i + 1] = offsets[i] + params[i].n;
    grad_offsets[i + 1] = grad_offsets[i] + staging_bytes(params[i]);
    weight_offsets[i + 1] = weight_offsets[i] + (params[i].dtype == DType::f32 ? 0 : params[i].n * 2);
  }
  std::size_t piece = std::max<std::size_t>(options.tile, 1);
  // 8-bit moments are stepped in whole blocks counted from a parameter's first element: pieces start on one.
  if (options.state_dtype == DType::i8) piece = moment_blocks(piece) * kMomentBlock;
  first_piece.assign(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    first_piece[i] = pieces.size();
    for (std::size_t b = 0; b < params[i].n; b += piece) pieces.push_back({i, b, std::min(piece, params[i].n - b)});
  }
  first_piece.back() = pieces.size();
  grad_down.assign(params.size(), 0);
  const StagingRule staging = staging_rule(device, params, options);  // footprint.cpp, which counts by it
  in_place = staging.in_place;
  streamed = staging.streamed;
  grads_in_place = staging.grads_in_place;
  need_norm = !grads_in_place || options.max_grad_norm > 0 || options.loss_scale.enabled;
  need_stats = need_norm || options.refuse_non_finite;
  if (options.tier == Tier::ram) {
    Result<std::unique_ptr<StateTier>> made = make_ram_tier(*this);
    if (!made.ok()) return made.status();
    tier = std::move(made).value();
  }
  const int grad_sets = options.schedule == Schedule::delayed ? 2 : 1;
  for (int s = 0; s < grad_sets; ++s) {
    Result<void*> r = device.allocate_host(grads_in_place || streamed ? 1 : std::max<std::size_t>(grad_offsets.back(), 1));
    if (!r.ok()) return r.status();
    grad_staging[s] = r.value();
    stats[s].assign(pieces.size(), GradStats{});
  }
  Result<void*> w = device.allocate_host(in_place || streamed ? 1 : std::max<std::size_t>(weight_offsets.back(), 1));
  if (!w.ok()) return w.status();
  weight_staging = w.value();
  if (Status s = allocate_accumulation(); !s.ok()) return s;
  if (options.tier == Tier::nvme) {
    Result<std::unique_ptr<StateTier>> made = make_nvme_tier(*this, kStoreName);
    if (!made.ok()) return made.status();
    tier = std::move(made).value();
  }
  if (options.spill_grads) {  // after the store, whose owner lock covers the spill's name
    Result<std::unique_ptr<GradSpill>> made = GradSpill::create(device, params, options, kStoreName);
    if (!made.ok()) return made.status();
    spill = std::move(made).value();
  }
  return Status::success();
}

// The master weights start as the device weights: 16-bit values convert to fp32 exactly.
Status OffloadOptimizer::Impl::load_initial_weights() {
  for (std::size_t i = 0; i < params.size() && !in_place; ++i) {
    const ParamSpec& p = params[i];
    // Streamed: the store's initialisation reads the 16-bit weights window by window (step_windows.cpp).
    if (p.n == 0 || (streamed && p.dtype != DType::f32)) continue;
    void* dst = p.dtype == DType::f32 ? static_cast<void*>(master_of(i)) : weights_of(i);
    if (p.tier != nullptr) {
      if (Status s = p.tier->read(p.tier_block, p.tier_entry, dst, 0, staging_bytes(p)); !s.ok()) return s;
      continue;
    }
    if (Status s = device.copy_to_host(dst, p.device_weights, staging_bytes(p), Stream::d2h); !s.ok()) return s;
  }
  Result<EventId> e = device.record(Stream::d2h);
  if (!e.ok()) return e.status();
  if (Status s = device.synchronize(e.value()); !s.ok()) return s;
  visible_scale = scaler.scale();
  if (Status s = tier->initialize(); !s.ok()) return s;
  return fill_initial_state();
}

// The tiers start the state at zero, which is every rule's start but Adagrad's with torch's
// initial_accumulator_value: its sum starts at the group's value, written through the tier.
Status OffloadOptimizer::Impl::fill_initial_state() {
  if (rule != Rule::adagrad) return Status::success();
  std::vector<float> values;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const float start = groups[static_cast<std::size_t>(params[i].group)].hyper.initial_accumulator_value;
    if (start == 0.0f || params[i].n == 0) continue;
    values.assign(params[i].n, start);
    if (Status s = tier->write(offsets[i], params[i].n, nullptr, values.data(), nullptr, nullptr); !s.ok()) return s;
  }
  return Status::success();
}

Status OffloadOptimizer::Impl::enqueue_d2h(std::size_t i, int set, const PieceDown& on_piece) {
  const ParamSpec& p = params[i];
  if (spill != nullptr && p.n > 0 && p.device_grads == nullptr) {
    return invalid_argument("parameter " + std::to_string(i) + " has no gradient to step: with spill_grads each comes "
                            "with its report (spill_grad()); one without a gradient this iteration is named in "
                            "set_grads_absent(). Nothing changed");
  }
  // The copy starts only once the compute stream has produced the gradient.
  Result<EventId> produced = device.record(Stream::compute);
  if (!produced.ok()) return produced.status();
  if (Status s = device.wait(Stream::d2h, produced.value()); !s.ok()) return s;
  const std::size_t elem = dtype_size(p.dtype);
  // Accumulated: the step reads the fp32 sum on the host; its statistics are taken there.
  const bool summed = in_accum(i, set);
  for (std::size_t k = first_piece[i]; k < first_piece[i + 1]; ++k) {
    const std::size_t at = pieces[k].begin * elem, bytes = pieces[k].n * elem;
    const void* from = static_cast<const unsigned char*>(p.device_grads) + at;
    if (summed) {
      stats[set][k] = host_grad_stats(accum[set].as<float>() + offsets[i] + pieces[k].begin, DType::f32, pieces[k].n);
    } else {
      if (!grads_in_place && !streamed) {  // streamed: the step's window takes them
        void* to = static_cast<unsigned char*>(grad_of(i, set)) + at;
        if (Status s = device.copy_to_host(to, from, bytes, Stream::d2h); !s.ok()) return s;
      }
      if (need_stats) {
        if (Status s = device.grad_stats(from, p.dtype, pieces[k].n, &stats[set][k], Stream::d2h); !s.ok()) return s;
      } else {
        stats[set][k] = GradStats{};
      }
    }
    if (on_piece) {
      Result<EventId> copied = device.record(Stream::d2h);
      if (!copied.ok()) return copied.status();
      if (Status s = on_piece(k, copied.value()); !s.ok()) return s;
    }
  }
  if (!grads_in_place && !streamed && !summed) count_bytes(stats_.d2h_bytes, staging_bytes(p));
  if (spill != nullptr && p.n > 0) {  // after the statistics, on the same stream: they read it first
    const std::uint64_t before = spill->written_bytes();
    if (Status s = spill->write(i, p.device_grads); !s.ok()) return s;
    if (!device.host_memory()) count_bytes(stats_.d2h_bytes, staging_bytes(p));
    count_bytes(stats_.nvme_write_bytes, spill->written_bytes() - before);
  }
  return Status::success();
}

Status OffloadOptimizer::Impl::grad_left_device(std::size_t i) {
  // The statistics (grad_stats) read the device's buffer on the same stream, before this event.
  Result<EventId> copied = device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  if (Status s = device.wait(Stream::compute, copied.value()); !s.ok()) return s;
  grad_down[i] = 1;
  return Status::success();
}

Status OffloadOptimizer::Impl::take_reported_grad(std::size_t i, int set) {
  if (!grad_leaves_when_reported(i)) return Status::success();
  if (spill != nullptr && grad_down[i]) {
    return invalid_argument("parameter " + std::to_string(i) + (params[i].name.empty() ? "" : " '" + params[i].name + "'") +
                            " reported twice in one iteration, and its first gradient is in the spill file already "
                            "(spill_grads): the spill does not sum micro-batches — step() after each backward, or "
                            "sum them in the trainer's gradients before reporting. Nothing changed");
  }
  if (Status s = enqueue_d2h(i, set); !s.ok()) return s;
  return grad_left_device(i);
}

// The gradients are host memory already: their statistics (the NaN/Inf refusal's count, the norm) run on
// the engine's threads at memory speed, where the device's copy stream would take them piece by piece on one
// thread. The same kernel as the host device's grad_stats(), per piece: the decision is the same bits.
Status OffloadOptimizer::Impl::grad_stats_in_place(int set) {
  Result<EventId> produced = device.record(Stream::compute);
  if (!produced.ok()) return produced.status();
  if (Status s = device.synchronize(produced.value()); !s.ok()) return s;
  std::vector<GradStats>& out = stats[set];
  if (!need_stats) {
    std::fill(out.begin(), out.end(), GradStats{});
    return Status::success();
  }
  adam.parallel_for(pieces.size(), [&](std::size_t k) {
    const Piece& piece = pieces[k];
    if (is_absent(piece.param, set)) {  // no gradient: nothing to read (its memory may be gone)
      out[k] = GradStats{};
      return;
    }
    DType dtype;
    const void* grad = step_grad(piece.param, set, &dtype);
    grad = static_cast<const unsigned char*>(grad) + piece.begin * dtype_size(dtype);
    out[k] = need_norm ? host_grad_stats(grad, dtype, piece.n) : host_non_finite(grad, dtype, piece.n);
  });
  return Status::success();
}

Status OffloadOptimizer::Impl::enqueue_h2d(std::size_t i) {
  const ParamSpec& p = params[i];
  if (p.n == 0 || in_place) return Status::success();  // in place: the step wrote the device's weights
  if (streamed && p.dtype != DType::f32) {
    return Status(StatusCode::internal, "parameter " + std::to_string(i) + ": streamed 16-bit weights have no staging to send");
  }
  const void* src = p.dtype == DType::f32 ? static_cast<const void*>(master_of(i)) : weights_of(i);
  if (p.tier != nullptr) return p.tier->write(p.tier_block, p.tier_entry, src, 0, staging_bytes(p));
  count_bytes(stats_.h2d_bytes, staging_bytes(p));
  return device.copy_to_device(p.device_weights, src, staging_bytes(p), Stream::h2d);
}

Status OffloadOptimizer::Impl::enqueue_h2d(const Piece& k, bool aside) {
  const ParamSpec& p = params[k.param];
  if (in_place) return Status::success();
  const std::size_t elem = dtype_size(p.dtype), at = k.begin * elem, bytes = k.n * elem;
  const void* src = p.dtype == DType::f32
                        ? static_cast<const void*>((aside ? master_aside(k.param) : master_of(k.param)) + k.begin)
                        : static_cast<const unsigned char*>(aside ? weights_aside(k.param) : weights_of(k.param)) + at;
  if (p.tier != nullptr) return Status::success();  // written whole once the step is decided
  count_bytes(stats_.h2d_bytes, bytes);
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
  if (!sent.ok()) return sent.status();
  // The CPU as the device: the trainer computes on the host at once, with nothing to order it after the
  // copies but this wait.
  if (device.host_memory()) return device.synchronize(sent.value());
  const std::lock_guard lock(weights_in_flight_mutex);
  weights_in_flight = sent.value();
  return Status::success();
}

Status OffloadOptimizer::Impl::staging_writable() {
  std::optional<EventId> sent;
  {
    const std::lock_guard lock(weights_in_flight_mutex);
    sent = std::exchange(weights_in_flight, std::nullopt);
  }
  return sent ? device.synchronize(*sent) : Status::success();
}

Status OffloadOptimizer::Impl::allocate_second_set() {
  if (Status s = tier->allocate_second_set(); !s.ok()) return s;
  // Staged, the device's copies are sent from it; in place, the scratch of the weights a step aside writes.
  Result<void*> w = device.allocate_host(std::max<std::size_t>(weight_offsets.back(), 1));
  if (!w.ok()) return w.status();
  weight_aside = w.value();
  current_set.assign(params.size(), 0);
  return Status::success();
}

// Parameter i's state and weights written aside become current. Staged, the sets switch: the device
// already received the weights from the set that is now current. In place, the device's weights are the
// model's own and stay where they are: the new ones are copied into them (an f32 parameter's master
// included: in place it is those weights), on all of the engine's threads.
void OffloadOptimizer::Impl::keep_aside(std::size_t i) {
  const ParamSpec& p = params[i];
  if (in_place && p.n > 0) {
    constexpr std::size_t kChunk = 1 << 18;  // bytes per task
    const std::size_t bytes = p.n * dtype_size(p.dtype);
    auto* dst = static_cast<unsigned char*>(p.device_weights);
    const auto* src = p.dtype == DType::f32 ? reinterpret_cast<const unsigned char*>(master_aside(i))
                                            : static_cast<const unsigned char*>(weights_aside(i));
    adam.parallel_for((bytes + kChunk - 1) / kChunk, [&](std::size_t c) {
      std::memcpy(dst + c * kChunk, src + c * kChunk, std::min(kChunk, bytes - c * kChunk));
    });
  }
  current_set[i] ^= 1;
}

Status OffloadOptimizer::Impl::step_all(float grad_scale, int set, const std::vector<ParamGroup>& hyper) {
  std::vector<std::size_t> all(pieces.size());
  for (std::size_t k = 0; k < all.size(); ++k) all[k] = k;
  return tier->step(all, grad_scale, set, hyper, false);
}

// From the gradients' statistics, summed in parameter order: skip (fp16 overflow), and the grad_scale that
// unscales and clips. Clipping follows torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6),
// applied only when below 1.
OffloadOptimizer::Impl::Decision OffloadOptimizer::Impl::decide(int set, float scale_used, float max_grad_norm) const {
  double sum_sq = 0;
  std::uint64_t non_finite = 0;
  for (std::size_t k = 0; k < stats[set].size(); ++k) {
    if (is_absent(pieces[k].param, set)) continue;  // torch's norm and step leave out a None gradient
    sum_sq += stats[set][k].sum_sq;
    non_finite += stats[set][k].non_finite;
  }
  // Partitioned: the norm is over every rank's shard, and gradients summed over the ranks are averaged.
  double ranks = 1;
  if (partition) {
    double global[2] = {sum_sq, static_cast<double>(non_finite)};
    if (Status s = partition->comm->all_reduce_host(global, 2); !s.ok()) {
      Decision failed{true, NAN, 0.0f, s};
      return failed;
    }
    sum_sq = global[0];
    non_finite = static_cast<std::uint64_t>(global[1]);
    if (!partition->options.grads_averaged) ranks = partition->comm->world();
  }
  Decision d{};
  d.overflow = options.loss_scale.enabled && non_finite > 0;
  d.refused = !options.loss_scale.enabled && options.refuse_non_finite && non_finite > 0;
  d.grad_norm = non_finite > 0 ? NAN : std::sqrt(sum_sq) / scale_used / ranks;
  double coef = 1.0;
  if (max_grad_norm > 0 && non_finite == 0) {
    coef = std::min(1.0, static_cast<double>(max_grad_norm) / (d.grad_norm + 1e-6));
  }
  d.grad_scale = static_cast<float>(coef / (scale_used * ranks));
  return d;
}

Status OffloadOptimizer::Impl::non_finite_error(int set) const {
  std::string which;
  std::uint64_t total = 0;
  std::size_t listed = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (is_absent(i, set)) continue;
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

void TierWrites::add(const ParamSpec& p, std::size_t param, const void* src) {
  auto t = std::find_if(tiers_.begin(), tiers_.end(), [&](const Tier& x) { return x.tier == p.tier; });
  if (t == tiers_.end()) t = tiers_.insert(tiers_.end(), Tier{p.tier, {}, {}, {}});
  auto [at, first] = t->block_at.try_emplace(p.tier_block, t->writes.size());
  if (first) t->writes.push_back({p.tier_block, std::vector<const void*>(p.tier->entries(p.tier_block))});
  t->writes[at->second].src[p.tier_entry] = src;
  t->params.push_back(param);
}

Status TierWrites::write(const std::function<void(std::size_t, bool)>& written) {
  Status first;
  for (const Tier& t : tiers_) {
    Status s = t.tier->write_blocks(t.writes);
    if (written) {
      for (std::size_t i : t.params) written(i, s.ok());
    }
    if (!s.ok() && first.ok()) first = std::move(s);
  }
  return first;
}

Status OffloadOptimizer::Impl::write_tier_weights() {
  TierWrites writes;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    // Streamed: a 16-bit parameter's weights went to the tier from the step's window.
    if (p.tier == nullptr || p.n == 0 || in_place || (streamed && p.dtype != DType::f32)) continue;
    writes.add(p, i, p.dtype == DType::f32 ? static_cast<const void*>(master_of(i)) : weights_of(i));
  }
  return writes.write();
}

Status OffloadOptimizer::Impl::send_all_weights() {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].tier != nullptr || (streamed && params[i].dtype != DType::f32)) continue;
    if (Status s = enqueue_h2d(i); !s.ok()) return s;
  }
  if (streamed && std::find(unsent.begin(), unsent.end(), 1) != unsent.end()) {
    if (Status s = tier->resend_weights(&unsent); !s.ok()) return s;
  }
  if (Status s = write_tier_weights(); !s.ok()) return s;
  return finish_h2d();
}

Status OffloadOptimizer::Impl::weights_not_sent(const Decision& d, int set, const Status& cause) {
  weights_pending = true;
  pending_decision = d;
  pending_set = set;
  return Status(cause.code(), "the step was applied, but its updated weights did not all reach their place: " +
                                  cause.message() + "; call step() again once the fault is cleared: it writes them "
                                  "and does nothing else",
                cause.sys_errno());
}

Status OffloadOptimizer::Impl::send_pending_weights() {
  if (Status s = send_all_weights(); !s.ok()) return weights_not_sent(pending_decision, pending_set, s);
  weights_pending = false;
  record_outcome(pending_decision, pending_set);
  visible_scale = scaler.scale();
  return Status::success();
}

void OffloadOptimizer::Impl::record_outcome(const Decision& d, int set) {
  stats_.last_grad_norm = d.grad_norm;
  last_skipped = d.overflow;
  if (d.overflow) {
    ++stats_.skipped;
  } else {
    for (std::size_t i = 0; i < params.size(); ++i) {
      // param_step_count() may read it beside the delayed schedule's background step.
      if (!is_absent(i, set)) std::atomic_ref(param_steps[i]).fetch_add(1, std::memory_order_relaxed);
    }
    ++step_count;
    ++stats_.steps;
  }
  scaler.update(d.overflow);
}

}  // namespace zoe
