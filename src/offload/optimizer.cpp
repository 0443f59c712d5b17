// OffloadOptimizer: the offloaded step (docs/architecture.md, "The step, as data", "Schedules"). This file
// holds the public API and the checks at creation; the engine is cut along two seams (optimizer_impl.h): the tier
// where the fp32 state lives (tier_ram.cpp, tier_nvme.cpp) and the schedule that meets the device's
// forward/backward (schedule_sync.cpp, schedule_overlap.cpp, schedule_delayed.cpp), over what they share
// (optimizer_step.cpp). Partitioning is partition.cpp; save/load optimizer_io.cpp.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/optimizer_impl.h"
#include "src/offload/optimizer_manifest.h"
#include "zoe/param_tier.h"

namespace zoe {

namespace {

// A group's hyper-parameters as the engine can run them: valid, the optimizer's rule with its state arrays
// (every group runs the rule, amsgrad or not, whose arrays the tiers were made for), in a state dtype the
// kernels keep. Refused by name before anything changes.
Status offload_runs(const OptimizerHyper& h, std::size_t group, const OptimizerHyper& first, DType state_dtype) {
  const Rule rule = first.rule;
  const std::string where = "param group " + std::to_string(group);
  if (Status s = validate_hyper(h); !s.ok()) return invalid_argument(where + ": " + s.message());
  const OptimizerRule& r = optimizer_rule(h.rule);
  if (h.rule != rule) {
    return invalid_argument(where + " runs " + std::string(r.name) + ", the optimizer " +
                            std::string(optimizer_rule(rule).name) + ": one optimizer steps one rule (its state arrays)");
  }
  if (state_arrays(h) != state_arrays(first)) {
    return invalid_argument(where + " has amsgrad = " + (h.amsgrad ? "true" : "false") + ", the optimizer " +
                            (first.amsgrad ? "true" : "false") +
                            ": one optimizer's groups agree on it (it adds a state array, max_exp_avg_sq)");
  }
  if (state_dtype == DType::i8 && h.rule == Rule::adam && h.amsgrad) {
    return Status(StatusCode::unsupported, "state_dtype i8 is not supported with amsgrad = true: its kernels keep the "
                                           "state as f32 or bf16");
  }
  if (state_dtype == DType::i8 && !r.int8_state) {
    return Status(StatusCode::unsupported, "state_dtype i8 is not supported for " + std::string(r.name) +
                                               ": its kernels keep the state as f32 or bf16");
  }
  return Status::success();
}

// read_state/write_state given a state array the optimizer does not keep: Lion's and Adagrad's second,
// max_exp_avg_sq without amsgrad.
Status kept_arrays(const Impl& m, const void* second, const void* third, const char* call) {
  if (second != nullptr && !m.two_states()) {
    return invalid_argument(std::string(call) + ": " + std::string(optimizer_rule(m.rule).name) +
                            " keeps one state array (" + m.state_blob(1) + "): pass exp_avg_sq = null");
  }
  if (third != nullptr && m.state_count < 3) {
    return invalid_argument(std::string(call) + ": this optimizer keeps no max_exp_avg_sq (amsgrad is off): pass null");
  }
  return Status::success();
}

}  // namespace

Status OffloadOptimizer::Impl::check_groups() const {
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (Status s = offload_runs(groups[g].hyper, g, first_hyper, options.state_dtype); !s.ok()) return s;
  }
  return Status::success();
}

// A parameter in a parameter tier: its entry exists and holds exactly the parameter's weights.
Status check_tier_entry(const ParamSpec& p, const std::string& where) {
  if (p.tier_block >= p.tier->blocks()) {
    return invalid_argument(where + ": parameter tier block " + std::to_string(p.tier_block) + " does not exist (" +
                            std::to_string(p.tier->blocks()) + " blocks)");
  }
  if (p.tier_entry >= p.tier->entries(p.tier_block)) {
    return invalid_argument(where + ": block '" + p.tier->block_name(p.tier_block) + "' of the parameter tier has no entry " +
                            std::to_string(p.tier_entry));
  }
  const std::size_t bytes = p.n * dtype_size(p.dtype);
  if (p.tier->entry_bytes(p.tier_block, p.tier_entry) != bytes) {
    return invalid_argument(where + ": entry " + std::to_string(p.tier_entry) + " of block '" +
                            p.tier->block_name(p.tier_block) + "' holds " +
                            std::to_string(p.tier->entry_bytes(p.tier_block, p.tier_entry)) + " bytes, the parameter " +
                            std::to_string(bytes));
  }
  return Status::success();
}

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
    // Spilled gradients may come only with their report (spill_grad()).
    if (p.n > 0 && ((p.device_weights == nullptr && p.tier == nullptr) || (p.device_grads == nullptr && !options.spill_grads))) {
      return invalid_argument(where + ": device weights or gradients are null with n = " + std::to_string(p.n));
    }
    if (p.tier != nullptr) {
      if (Status s = check_tier_entry(p, where); !s.ok()) return s;
    }
    // Recorded in checkpoints: one that does not describe n elements would make them unreadable.
    if (std::string why = shape_mismatch(p.shape, p.n); !why.empty()) return invalid_argument(where + ": " + why);
  }
  if (!(options.max_grad_norm >= 0) || !std::isfinite(options.max_grad_norm)) {
    return invalid_argument("max_grad_norm = " + std::to_string(options.max_grad_norm) + " is invalid: need >= 0");
  }
  const LossScaleOptions& ls = options.loss_scale;
  // An infinite scale makes every scaled gradient overflow: every step would be skipped.
  auto scale_ok = [](float x) { return x > 0 && std::isfinite(x); };
  if (ls.enabled && (!scale_ok(ls.initial_scale) || !scale_ok(ls.static_scale) || !scale_ok(ls.min_scale) ||
                     !(ls.backoff_factor > 0 && ls.backoff_factor < 1) || !(ls.growth_factor >= 1) ||
                     !std::isfinite(ls.growth_factor) || ls.growth_interval < 1)) {
    return invalid_argument("loss scaling: initial_scale " + std::to_string(ls.initial_scale) + ", static_scale " +
                            std::to_string(ls.static_scale) + ", min_scale " + std::to_string(ls.min_scale) +
                            ", backoff_factor " + std::to_string(ls.backoff_factor) + ", growth_factor " +
                            std::to_string(ls.growth_factor) + ", growth_interval " +
                            std::to_string(ls.growth_interval) +
                            ": scales must be finite and > 0, 0 < backoff_factor < 1, growth_factor finite and >= 1, "
                            "growth_interval >= 1");
  }
  if (options.tier == Tier::nvme) {
#ifndef ZOE_HAVE_AIO
    return Status(StatusCode::unsupported, "tier nvme: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
#endif
    if (options.nvme.paths.empty()) return invalid_argument("tier nvme needs at least one nvme_path");
  }
  if (options.state_dtype != DType::f32 && options.state_dtype != DType::bf16 && options.state_dtype != DType::i8) {
    return invalid_argument("state_dtype " + std::string(dtype_name(options.state_dtype)) +
                            " is invalid: the moments are stored as f32, bf16 or i8");
  }
  if (options.delayed_warmup_steps < 0) return invalid_argument("delayed_warmup_steps must be >= 0");
  if (options.spill_grads && (options.tier != Tier::nvme || options.schedule != Schedule::sync ||
                              options.gradient_accumulation_steps > 1)) {
    return invalid_argument("spill_grads is for tier nvme's streamed step: tier nvme, schedule sync, one micro-batch "
                            "per step (here: tier " + std::string(options.tier == Tier::nvme ? "nvme" : "ram") +
                            ", gradient_accumulation_steps " + std::to_string(options.gradient_accumulation_steps) +
                            (options.schedule == Schedule::sync ? "" : ", a schedule other than sync") + ")");
  }
  if (options.gradient_accumulation_steps < 1) {
    return invalid_argument("gradient_accumulation_steps = " + std::to_string(options.gradient_accumulation_steps) +
                            " is invalid: need >= 1 (micro-batches per step)");
  }
  return Status::success();
}


Result<std::unique_ptr<StepSchedule>> make_schedule(Impl& m) {
  switch (m.options.schedule) {
    case Schedule::sync: return make_sync_schedule(m);
    case Schedule::overlap: return make_overlap_schedule(m);
    case Schedule::delayed: return make_delayed_schedule(m);
  }
  return invalid_argument("schedule " + std::to_string(int(m.options.schedule)) + " is invalid");
}

Result<OffloadOptimizer> OffloadOptimizer::create(Device& device, std::vector<ParamGroup> groups,
                                                  std::vector<ParamSpec> params, const OffloadOptions& options) {
  if (Status s = check_inputs(groups, params, options); !s.ok()) return s;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (Status s = offload_runs(groups[g].hyper, g, groups[0].hyper, options.state_dtype); !s.ok()) return s;
  }
  Result<CpuAdam> adam = CpuAdam::create(options.cpu);
  if (!adam.ok()) return adam.status();
  auto impl = std::make_unique<Impl>(device, std::move(groups), std::move(params), options, std::move(adam).value());
  if (Status s = impl->allocate(); !s.ok()) return s;
  if (Status s = impl->load_initial_weights(); !s.ok()) return s;
  Result<std::unique_ptr<StepSchedule>> schedule = make_schedule(*impl);
  if (!schedule.ok()) return schedule.status();
  impl->schedule = std::move(schedule).value();
  return OffloadOptimizer(std::move(impl));
}

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadOptimizer::OffloadOptimizer(OffloadOptimizer&&) noexcept = default;
OffloadOptimizer& OffloadOptimizer::operator=(OffloadOptimizer&&) noexcept = default;
OffloadOptimizer::~OffloadOptimizer() = default;

Status OffloadOptimizer::grad_ready(std::size_t param) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  const std::size_t count = m.partition ? m.partition->user.size() : m.params.size();
  if (param >= count) {
    return invalid_argument("grad_ready: parameter " + std::to_string(param) + " does not exist (" +
                            std::to_string(count) + " parameters)");
  }
  if (m.partition) return Status::success();  // sync: every gradient is taken at step()
  if (m.accumulates()) {
    const int k = m.options.gradient_accumulation_steps;
    if (m.reports[param] >= k) {
      return invalid_argument("grad_ready: parameter " + std::to_string(param) + " reported " + std::to_string(k + 1) +
                              " times in one step, but gradient_accumulation_steps = " + std::to_string(k));
    }
    const bool last = ++m.reports[param] == k;
    if (Status s = m.add_micro_batch(param, m.schedule->current_set(), last); !s.ok()) return s;
    if (!last) return Status::success();
  }
  return m.schedule->grad_ready(param);
}

Status OffloadOptimizer::set_grads_absent(const std::vector<std::size_t>& which) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  std::vector<char> absent(m.params.size(), 0);
  for (std::size_t i : which) {
    if (i >= m.params.size()) {
      return invalid_argument("set_grads_absent: parameter " + std::to_string(i) + " does not exist (" +
                              std::to_string(m.params.size()) + " parameters); nothing changed");
    }
    if (m.accumulates() && m.reports[i] > 0) {
      return invalid_argument("set_grads_absent: parameter " + std::to_string(i) + " had " +
                              std::to_string(m.reports[i]) + " micro-batch gradient(s) reported this step; nothing changed");
    }
    absent[i] = 1;
  }
  m.schedule->wait_for_speculative_steps();
  const int set = m.schedule->current_set();
  if (which.empty()) {
    m.absent[set].clear();
  } else {
    m.absent[set] = std::move(absent);
  }
  return Status::success();
}

Status OffloadOptimizer::set_grad_source(std::size_t param, const void* grads) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (param >= m.params.size()) {
    return invalid_argument("set_grad_source: parameter " + std::to_string(param) + " does not exist (" +
                            std::to_string(m.params.size()) + " parameters)");
  }
  if (grads == nullptr && m.params[param].n > 0) return invalid_argument("set_grad_source: null gradient address");
  if (m.partition) return invalid_argument("set_grad_source: a partitioned optimizer reduces its gradients in flat buffers");
  if (m.grad_leaves_when_reported(param) && m.spill == nullptr) {
    return invalid_argument("set_grad_source: parameter " + std::to_string(param) +
                            " is tiered on a device with its own memory: its gradient's place is a window");
  }
  m.params[param].device_grads = grads;
  return Status::success();
}

Status OffloadOptimizer::spill_grad(std::size_t param, const void* grads) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (m.spill == nullptr) return invalid_argument("spill_grad: this optimizer does not spill gradients (spill_grads)");
  if (param >= m.params.size()) {
    return invalid_argument("spill_grad: parameter " + std::to_string(param) + " does not exist (" +
                            std::to_string(m.params.size()) + " parameters)");
  }
  if (grads == nullptr && m.params[param].n > 0) return invalid_argument("spill_grad: null gradient address");
  // Read once, now: the address is not kept, so a gradient freed after this call is never read again.
  const void* before = std::exchange(m.params[param].device_grads, grads);
  Status s = m.schedule->grad_ready(param);
  m.params[param].device_grads = before;
  return s;
}

Status OffloadOptimizer::step() {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  if (Status refused = m.check_groups(); !refused.ok()) return refused;  // group_hyper() may have changed them
  Status s;
  if (m.weights_pending) {
    s = m.send_pending_weights();
  } else if (m.partition) {
    if (!std::exchange(m.grads_reduced, false)) s = m.partition_reduce_grads();
    if (s.ok()) s = m.schedule->step();
    if (s.ok() && !m.last_skipped) s = m.partition_gather_weights();
  } else {
    const int set = m.schedule->current_set();
    s = m.finish_accumulation(set);
    if (s.ok()) s = m.schedule->step();
    // The sums were read (delayed: the background step reads the other set's); the next step starts anew.
    m.reset_accumulation(m.schedule->current_set());
  }
  // A failed step may be called again: it reads the gradients taken at their report from the staging, and
  // leaves out the same parameters. Once applied (delayed: started on the other set, whose previous step has
  // ended), the set the next iteration uses starts with every gradient present.
  if (s.ok()) {
    std::fill(m.grad_down.begin(), m.grad_down.end(), 0);
    m.absent[m.schedule->current_set()].clear();
    if (m.spill != nullptr) m.spill->forget();
  }
  ++m.step_calls;
  m.stats_.step_call_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

Status OffloadOptimizer::wait() {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (Status s = m.schedule->wait(); !s.ok()) return s;
  return m.device.synchronize();
}

Status OffloadOptimizer::grads_changed() {
  const std::lock_guard serial(impl_->calls);
  const std::vector<char>& down = impl_->grad_down;
  if (auto it = std::find(down.begin(), down.end(), 1); it != down.end()) {
    const std::size_t i = static_cast<std::size_t>(it - down.begin());
    const bool spilled = impl_->spill != nullptr;
    const std::string where = spilled ? "went to the gradient spill file " + impl_->spill->path() + " when it was reported"
                                      : "left the device when it was reported, and the device's buffer may hold "
                                        "another block's since";
    return invalid_argument("grads_changed: the gradient of " + std::string(spilled ? "" : "offloaded ") + "parameter '" +
                            impl_->params[i].name + "' (" + std::to_string(i) + ") " + where +
                            "; change gradients before reporting them (clipping: max_grad_norm or set_max_grad_norm). "
                            "Nothing changed");
  }
  impl_->grads_reduced = false;
  impl_->schedule->wait_for_speculative_steps();
  impl_->drop_accumulation(impl_->schedule->current_set());
  impl_->schedule->retake();
  return Status::success();
}

Status OffloadOptimizer::discard_speculative_steps() {
  const std::lock_guard serial(impl_->calls);
  if (Status s = impl_->staging_writable(); !s.ok()) return s;
  return impl_->schedule->discard_speculative_steps();
}

Status OffloadOptimizer::abandon_iteration() {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  const int set = m.schedule->current_set();
  // The queued micro-batch adds first: they write the staging and the sums. What they added is dropped.
  (void)m.drain_adds();
  Status s = m.staging_writable();
  if (s.ok()) s = m.schedule->abandon();
  m.grads_reduced = false;
  m.reset_accumulation(set);
  std::fill(m.grad_down.begin(), m.grad_down.end(), 0);
  m.absent[set].clear();
  if (m.spill != nullptr) {
    (void)m.spill->flush();  // no write may still use a bounce; what it failed to write is dropped with it
    m.spill->forget();
  }
  return s;
}

Result<double> OffloadOptimizer::grad_norm() {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (!m.need_norm) {
    // In place without clipping or loss scaling, the statistics skip the norm: from now on they take it.
    m.need_norm = m.need_stats = true;
    m.schedule->retake();
  }
  if (m.partition && !m.grads_reduced) {
    if (Status s = m.partition_reduce_grads(); !s.ok()) return s;
    m.grads_reduced = true;
  }
  Result<int> set = m.schedule->take_grads();
  if (!set.ok()) return set.status();
  const Impl::Decision d = m.decide(set.value(), m.visible_scale, m.options.max_grad_norm);
  if (!d.error.ok()) return d.error;
  return d.grad_norm;
}

Status OffloadOptimizer::set_max_grad_norm(float max_norm) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm)) {
    return invalid_argument("max_grad_norm = " + std::to_string(max_norm) + " is invalid: need >= 0 (0: no clipping)");
  }
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  m.options.max_grad_norm = max_norm;
  if (max_norm > 0 && !m.need_norm) {
    m.need_norm = m.need_stats = true;
    m.schedule->retake();  // gradients taken already have no norm
  }
  return Status::success();
}

OptimizerHyper& OffloadOptimizer::group_hyper(std::size_t group) { return impl_->groups.at(group).hyper; }
float OffloadOptimizer::loss_scale() const {
  const std::lock_guard serial(impl_->calls);
  return impl_->visible_scale;
}
LossScaleState OffloadOptimizer::loss_scale_state() const {
  const std::lock_guard serial(impl_->calls);
  return impl_->scaler.state();
}

Status OffloadOptimizer::set_loss_scale_state(const LossScaleState& state) {
  const std::lock_guard serial(impl_->calls);
  if (!std::isfinite(state.scale) || state.scale <= 0 || state.clean_steps < 0 || state.hysteresis_left < 0) {
    return invalid_argument("set_loss_scale_state: scale " + std::to_string(state.scale) + ", clean_steps " +
                            std::to_string(state.clean_steps) + ", hysteresis_left " +
                            std::to_string(state.hysteresis_left) + " (need a finite scale > 0 and counts >= 0)");
  }
  if (!impl_->options.loss_scale.enabled) {
    return invalid_argument("set_loss_scale_state: this optimizer runs without loss scaling (fp16 only)");
  }
  if (Status s = wait(); !s.ok()) return s;
  impl_->scaler.restore(state);
  impl_->visible_scale = impl_->scaler.scale();
  return Status::success();
}

std::int64_t OffloadOptimizer::step_count() const { return impl_->step_count.load(); }
float* OffloadOptimizer::moments_of(std::size_t param, int which) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (param >= m.params.size() || which < 1 || which > static_cast<int>(m.state_count)) return nullptr;
  // The parameter's current state set (the overlap schedule switches sets at each kept step).
  return m.tier->moments(param, which);
}

std::int64_t OffloadOptimizer::param_step_count(std::size_t param) const {
  const std::lock_guard serial(impl_->calls);
  if (param >= impl_->param_steps.size()) return -1;
  // The delayed schedule's background step may be counting it (record_outcome).
  return std::atomic_ref(impl_->param_steps[param]).load(std::memory_order_relaxed);
}
bool OffloadOptimizer::last_step_skipped() const { return impl_->last_skipped.load(); }
// The streamed step on a device with memory of its own copies each window's gradients during step(), after
// whatever the trainer did to them since the norm: for that contract it reads them in place too.
// Spilled gradients are read back from the spill file: what the trainer does to its buffers after reporting
// them is not seen.
bool OffloadOptimizer::reads_grads_in_place() const {
  return (impl_->grads_in_place || impl_->streamed) && impl_->spill == nullptr;
}
const StepStats& OffloadOptimizer::stats() const { return impl_->stats_; }

std::vector<std::size_t> OffloadOptimizer::state_sizes() const {
  std::vector<std::size_t> n;
  for (const ParamSpec& p : impl_->params) n.push_back(p.n);
  return n;
}

Status OffloadOptimizer::read_state(std::size_t param, float* master, float* exp_avg, float* exp_avg_sq,
                                    float* max_exp_avg_sq) const {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (param >= m.params.size()) return invalid_argument("read_state: parameter " + std::to_string(param) + " does not exist");
  if (Status s = kept_arrays(m, exp_avg_sq, max_exp_avg_sq, "read_state"); !s.ok()) return s;
  // A speculation or a background step in flight writes what is read: the state of a whole step is read.
  if (Status s = m.schedule->wait(); !s.ok()) return s;
  return m.tier->read(m.offsets[param], m.params[param].n, master, exp_avg, exp_avg_sq, max_exp_avg_sq);
}

Status OffloadOptimizer::write_state(std::size_t param, const float* master, const float* exp_avg,
                                     const float* exp_avg_sq, const float* max_exp_avg_sq) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (param >= m.params.size()) {
    return invalid_argument("write_state: parameter " + std::to_string(param) + " does not exist (" +
                            std::to_string(m.params.size()) + " parameters)");
  }
  if (Status s = kept_arrays(m, exp_avg_sq, max_exp_avg_sq, "write_state"); !s.ok()) return s;
  const ParamSpec& p = m.params[param];
  const float* arrays[4] = {master, exp_avg, exp_avg_sq, max_exp_avg_sq};
  for (int k = 0; k < 4; ++k) {
    if (arrays[k] == nullptr) continue;
    const bool non_negative = k > 0 && (optimizer_rule(m.rule).non_negative_states >> (k - 1) & 1u) != 0;
    for (std::size_t j = 0; j < p.n; ++j) {
      if (!std::isfinite(arrays[k][j]) || (non_negative && arrays[k][j] < 0)) {
        return invalid_argument("write_state: parameter " + std::to_string(param) + ": " + m.state_blob(k) + "[" +
                                std::to_string(j) + "] = " + std::to_string(arrays[k][j]) +
                                (non_negative ? " (need finite and >= 0)" : " (need finite)") + "; nothing changed");
      }
    }
  }
  if (Status s = wait(); !s.ok()) return s;
  if (Status s = m.tier->write(m.offsets[param], p.n, master, exp_avg, exp_avg_sq, max_exp_avg_sq); !s.ok()) return s;
  if (master == nullptr || p.n == 0) return Status::success();
  // The device weights follow the master: rounded into the 16-bit copy (f32: copied where tier nvme keeps
  // the device's), sent up unless it is the device's.
  if (m.streamed && p.dtype != DType::f32) {  // no staging: rounded from the store's master and sent
    std::vector<char> which(m.params.size(), 0);
    which[param] = 1;
    if (Status s = m.tier->resend_weights(&which); !s.ok()) return s;
    return m.finish_h2d();
  }
  m.weights_follow_master(param, 0, master, p.n);
  if (Status s = m.enqueue_h2d(param); !s.ok()) return s;
  return m.finish_h2d();
}

Status OffloadOptimizer::set_step_count(std::int64_t steps) {
  const std::lock_guard serial(impl_->calls);
  if (steps < 0) return invalid_argument("set_step_count: " + std::to_string(steps) + " steps (need >= 0)");
  if (Status s = wait(); !s.ok()) return s;
  impl_->step_count = steps;
  std::fill(impl_->param_steps.begin(), impl_->param_steps.end(), steps);
  return Status::success();
}

Status OffloadOptimizer::set_param_step_count(std::size_t param, std::int64_t steps) {
  const std::lock_guard serial(impl_->calls);
  if (param >= impl_->params.size()) {
    return invalid_argument("set_param_step_count: parameter " + std::to_string(param) + " does not exist");
  }
  if (steps < 0) return invalid_argument("set_param_step_count: " + std::to_string(steps) + " steps (need >= 0)");
  if (Status s = wait(); !s.ok()) return s;
  impl_->param_steps[param] = steps;
  return Status::success();
}

}  // namespace zoe
