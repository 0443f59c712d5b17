// overlap: each reported parameter comes down piece by piece, and each piece is stepped speculatively — as
// if no clipping and no overflow — and sent up as soon as it is down, while backward goes on; pieces keep the
// work left after the last gradient short. A speculative step reads the piece's current state set and writes
// the other one (ping-pong, Impl::current_set), so the current set is the state before the step until step()
// keeps the speculation (Impl::keep_aside makes the other set current). step() validates: an overflow (or a
// refused NaN/Inf) drops every speculative step and resends the current weights; a clip coefficient below 1
// drops them and steps the current set again with it. Gradients the trainer changed after reporting them
// (retake()) drop every speculative step too, and the step is then sync's, over the gradients taken again.
// Speculative steps use the hyper-parameters set when the iteration's first gradient was reported; a trainer
// that sets others before step() (a learning-rate schedule stepped late) has them dropped and redone too.
// Tier nvme holds no state set in RAM: from the iteration's first report one
// speculative call of the tier steps the whole store on the worker, each tile once the gradients of its
// parameters are down (param_ready), tiles in the order the last iteration reported their parameters, its
// new state written beside the old (SwapStore::speculate). step() then commits it, or discards it and steps
// as sync from the state the store still holds.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "base/aligned_buffer.h"
#include "src/offload/footprint.h"
#include "src/offload/optimizer_impl.h"
#include "base/work_queue.h"

namespace zoe {
namespace {

class OverlapSchedule final : public StepSchedule {
 public:
  explicit OverlapSchedule(Impl& m) : m_(m) {}

  Status allocate() {
    reported_.assign(m_.params.size(), 0);
    stepped_.assign(m_.pieces.size(), 0);
    // Speculation fails when clipping, an fp16 overflow or a refused NaN/Inf changes the step, and when the
    // trainer changes gradients after reporting them (grads_changed(), clip_grad_norm_ by the trainer,
    // set_max_grad_norm() between steps): a tier that steps during backward steps into a second state set.
    speculation_can_fail_ = m_.tier->in_ram();
    in_store_ = m_.tier->speculates();
    down_.assign(m_.params.size(), std::nullopt);
    no_grad_before_.assign(m_.params.size(), 0);
    return speculation_can_fail_ ? m_.allocate_second_set() : Status::success();
  }

  ~OverlapSchedule() override {
    stop_gate();  // a speculation of the store waiting for gradients ends
    worker_.reset();  // its closures use this schedule's members
  }

  Status grad_ready(std::size_t i) override {
    if (reported_[i]) return invalid_argument("parameter " + std::to_string(i) + " was reported ready twice in one iteration");
    reported_[i] = 1;
    if (!speculating_) {
      // Copied for the worker: the trainer may set the groups' hyper-parameters while it steps.
      speculated_with_ = m_.groups;
      speculating_ = true;
      if (in_store_) start_store_speculation();
    }
    if (in_store_) {
      reports_.push_back(i);
      return report_to_store(i);
    }
    Status s = m_.tier->in_ram()
                   ? m_.enqueue_d2h(i, 0, [this](std::size_t k, EventId copied) { return step_piece_when_down(k, copied); })
                   : m_.enqueue_d2h(i, 0);
    if (!s.ok() || !m_.grad_leaves_when_reported(i)) return s;
    return m_.grad_left_device(i);
  }

  Status step() override;
  // The one check of both tiers' speculation: it stepped what sync steps now, given decision d — gradients
  // as reported (not taken again), no skip, no clipping (the scale it used), the same hyper-parameters.
  // Which parameters it stepped is each tier's own question (tier ram: per parameter, below; the store:
  // speculated_params()).
  bool steps_as_sync(const Impl::Decision& d) const;

  Result<int> take_grads() override {
    if (Status s = report_the_rest(); !s.ok()) return s;
    if (retake_) {
      if (Status s = in_store_ ? stop_store_speculation() : drop_speculation(); !s.ok()) return s;
      if (Status s = take_all_grads(m_); !s.ok()) return s;
      retake_ = false;
      taken_again_ = true;
      return 0;
    }
    Result<EventId> copied = m_.device.record(Stream::d2h);
    if (!copied.ok()) return copied.status();
    if (Status s = m_.device.synchronize(copied.value()); !s.ok()) return s;
    return 0;
  }

  void retake() override { retake_ = true; }

  Status discard_speculative_steps() override {
    if (in_store_) return stop_store_speculation();
    if (!speculation_can_fail_) return Status::success();
    return drop_speculation();
  }

  // What reads or writes the state (save, load, read_state, write_state, the step counts) must not run beside
  // the speculation, and sees the state before this iteration's step: on tier nvme the store's speculation
  // is stopped and dropped, on tier ram the speculative steps are dropped. step() then steps them again.
  Status wait() override { return in_store_ ? stop_store_speculation() : discard_speculative_steps(); }

  // Nothing of the iteration is kept: no speculative step, no report, and nothing learnt from its partial
  // order of reports (the next speculation uses the last whole iteration's).
  Status abandon() override {
    Status s = in_store_ ? stop_store_speculation() : speculation_can_fail_ ? drop_speculation() : Status::success();
    worker_->drain();
    forget_iteration();
    return s;
  }

  // Tier ram: a piece's step reads whether its parameter is absent (then whether to write it aside and
  // mark the piece stepped) and where its gradient is (the micro-batches' sum or the copy): what
  // set_grads_absent() and grads_changed() change must not change under it. The store's speculation reads
  // neither.
  void wait_for_speculative_steps() override {
    if (!in_store_) worker_->drain();
  }

 private:
  Status step_piece_when_down(std::size_t k, EventId copied);
  // Waits for the speculative steps and drops what they wrote aside, resending the current weights; no
  // piece is then stepped, and step() steps them all.
  Status drop_speculation();
  // Every parameter the trainer did not report is reported now: its gradient is final at the end of backward.
  // Those still unreported then have none this iteration (the store's speculation leaves them out).
  Status report_the_rest() {
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      if (!reported_[i] && !m_.is_absent(i, 0)) {
        if (Status s = grad_ready(i); !s.ok()) return s;
      }
    }
    {
      const std::lock_guard lock(down_mutex_);
      all_reported_ = true;
    }
    down_cv_.notify_all();
    return Status::success();
  }
  // Tier nvme (in_store_).
  void start_store_speculation();
  Status report_to_store(std::size_t i);
  Result<bool> param_ready(std::size_t i);
  Status step_in_store();
  void stop_gate();
  Status stop_store_speculation();  // stops it, waits for it and discards what it stepped
  void end_iteration();     // learns the order of the reports and who had none, then forgets the iteration
  void forget_iteration();

  Impl& m_;
  bool speculation_can_fail_ = false;
  // This iteration: which parameters were reported, and which pieces stepped speculatively.
  std::vector<char> reported_, stepped_;
  std::atomic<bool> overflow_seen_{false};
  // The gradients changed after they were reported (retake()); they were taken again, synchronously, after
  // the speculation was undone (taken_again_): step() then steps every piece.
  bool retake_ = false, taken_again_ = false;
  // The groups' hyper-parameters the speculative steps of this iteration use (speculating_: set).
  std::vector<ParamGroup> speculated_with_;
  bool speculating_ = false;
  // Tier nvme: the store's speculation (store_speculation_: started this iteration and not stopped), and the
  // hand-off from the trainer's reports to its gate: each reported parameter's copy event.
  bool in_store_ = false, store_speculation_ = false;
  std::mutex down_mutex_;
  std::condition_variable down_cv_;
  std::vector<std::optional<EventId>> down_;
  bool all_reported_ = false, gate_stopped_ = false;
  // Parameters without a gradient in the last iteration (frozen ones, typically): the next speculation
  // leaves them out, so that tiles only they cover are not read and rewritten unchanged.
  std::vector<char> no_grad_before_;
  // The parameters in the order this iteration reported them, and each one's place in the last iteration's
  // order: the next speculation steps tiles in the order their gradients are then expected in (a model laid
  // out bucket by bucket, one per dtype or param group, reports across the buckets).
  std::vector<std::size_t> reports_, arrival_;
  Status worker_status_;  // the first failure inside the worker
  std::unique_ptr<WorkQueue> worker_ = std::make_unique<WorkQueue>();  // per-piece steps during backward
};

Status OverlapSchedule::step_piece_when_down(std::size_t k, EventId copied) {
  const float speculative_scale = static_cast<float>(1.0 / m_.visible_scale);
  worker_->enqueue([this, k, copied, speculative_scale] {
    if (!worker_status_.ok()) return;
    if (Status s = m_.device.synchronize(copied); !s.ok()) {
      worker_status_ = s;
      return;
    }
    const OffloadOptions& o = m_.options;
    if ((o.loss_scale.enabled || o.refuse_non_finite) && m_.stats[0][k].non_finite > 0) overflow_seen_ = true;
    if (overflow_seen_) return;  // this step will be skipped: stepping more would only be undone
    if (Status s = m_.staging_writable(); !s.ok()) {
      worker_status_ = s;
      return;
    }
    // Into the other state set: the current one stays the state before the step (Impl::current_set).
    if (Status s = m_.tier->step({k}, speculative_scale, 0, speculated_with_, true); !s.ok()) {
      worker_status_ = s;
      return;
    }
    // A parameter named absent is left out by the step: nothing written aside.
    stepped_[k] = m_.is_absent(m_.pieces[k].param, 0) ? 0 : 1;
    if (Status s = m_.enqueue_h2d(m_.pieces[k], true); !s.ok()) worker_status_ = s;
  });
  return Status::success();
}

Status OverlapSchedule::drop_speculation() {
  worker_->drain();
  overflow_seen_ = false;
  Status failed = std::exchange(worker_status_, Status::success());
  bool sent = false;
  for (std::size_t k = 0; k < m_.pieces.size(); ++k) {
    if (!stepped_[k]) continue;
    stepped_[k] = 0;
    sent = true;
    // The device has the speculative weights: it gets the current ones back (after them on the same
    // stream), in case the step is then skipped.
    if (Status s = m_.enqueue_h2d(m_.pieces[k]); !s.ok() && failed.ok()) failed = s;
  }
  // The next write of the staging (the step taken again) waits for those copies (staging_writable).
  if (sent) {
    if (Status s = m_.finish_h2d(); !s.ok() && failed.ok()) failed = s;
  }
  return failed;
}

void OverlapSchedule::end_iteration() {
  for (std::size_t i = 0; in_store_ && i < m_.params.size(); ++i) no_grad_before_[i] = !reported_[i] || m_.is_absent(i, 0);
  if (!reports_.empty()) {
    arrival_.assign(m_.params.size(), m_.params.size());  // not reported: left out of the next speculation
    for (std::size_t k = 0; k < reports_.size(); ++k) arrival_[reports_[k]] = k;
  }
  forget_iteration();
}

void OverlapSchedule::forget_iteration() {
  reports_.clear();
  {
    const std::lock_guard lock(down_mutex_);
    std::fill(down_.begin(), down_.end(), std::nullopt);
    all_reported_ = gate_stopped_ = false;
  }
  store_speculation_ = false;
  std::fill(reported_.begin(), reported_.end(), 0);
  std::fill(stepped_.begin(), stepped_.end(), 0);
  overflow_seen_ = false;
  retake_ = taken_again_ = false;
  speculating_ = false;
}

bool same_hyper(const std::vector<ParamGroup>& a, const std::vector<ParamGroup>& b);

bool OverlapSchedule::steps_as_sync(const Impl::Decision& d) const {
  return !retake_ && !taken_again_ && d.error.ok() && !d.overflow && !d.refused &&
         d.grad_scale == static_cast<float>(1.0 / m_.visible_scale) && same_hyper(speculated_with_, m_.groups);
}

bool same_hyper(const std::vector<ParamGroup>& a, const std::vector<ParamGroup>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const ParamGroup& x, const ParamGroup& y) {
    const AdamHyper &p = x.hyper, &q = y.hyper;
    return p.lr == q.lr && p.beta1 == q.beta1 && p.beta2 == q.beta2 && p.eps == q.eps &&
           p.weight_decay == q.weight_decay && p.adamw == q.adamw && p.bias_correction == q.bias_correction &&
           p.maximize == q.maximize;
  });
}

Status OverlapSchedule::step() {
  if (in_store_) return step_in_store();
  if (retake_ || taken_again_) {
    // Every gradient down (again, after the speculation was dropped, where they changed), then sync's step.
    Result<int> taken = take_grads();
    end_iteration();
    if (!taken.ok()) return taken.status();
    return finish_sync_step(m_);
  }
  if (Status s = report_the_rest(); !s.ok()) return s;
  worker_->drain();
  if (!worker_status_.ok()) return std::exchange(worker_status_, Status::success());
  const Impl::Decision d = m_.decide(0, m_.visible_scale, m_.options.max_grad_norm);
  const bool skip = d.overflow || d.refused;
  const bool wrong = !steps_as_sync(d);
  if (Status s = m_.staging_writable(); !s.ok()) return s;
  // A parameter's speculation is kept when every piece of it was stepped aside with what sync would have
  // used; then its other set becomes current. Any other piece is stepped (again) in its current set, which
  // no speculation wrote. A parameter reported, stepped, then named absent (set_grads_absent) keeps its
  // current set and is not stepped again.
  std::vector<char> keep(m_.params.size(), 0);
  for (std::size_t i = 0; i < m_.params.size() && !wrong; ++i) {
    const std::size_t first = m_.first_piece[i], end = m_.first_piece[i + 1];
    keep[i] = first < end && !m_.is_absent(i, 0) &&
              std::all_of(stepped_.begin() + first, stepped_.begin() + end, [](char x) { return x != 0; });
  }
  std::vector<std::size_t> redo;
  for (std::size_t k = 0; k < m_.pieces.size(); ++k) {
    const std::size_t i = m_.pieces[k].param;
    if (keep[i]) continue;
    const bool absent = m_.is_absent(i, 0);
    if (stepped_[k] && (skip || absent)) {
      if (Status s = m_.enqueue_h2d(m_.pieces[k]); !s.ok()) return s;  // the device gets its current weights back
    }
    if (!skip && !absent) redo.push_back(k);
  }
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    if (keep[i]) m_.keep_aside(i);
  }
  if (!redo.empty()) {
    ++m_.stats_.redone;
    if (Status s = m_.tier->step(redo, d.grad_scale, 0, m_.groups, false); !s.ok()) return s;
    for (std::size_t k : redo) {
      if (Status s = m_.enqueue_h2d(m_.pieces[k]); !s.ok()) return s;
    }
  }
  end_iteration();
  if (!skip) {
    if (Status s = m_.write_tier_weights(); !s.ok()) return m_.weights_not_sent(d, 0, s);
  }
  if (Status s = m_.finish_h2d(); !s.ok()) return s;
  if (d.refused) return m_.non_finite_error(0);
  m_.record_outcome(d, 0);
  m_.visible_scale = m_.scaler.scale();
  return Status::success();
}

// ---- tier nvme: the store's speculation ----

void OverlapSchedule::start_store_speculation() {
  store_speculation_ = true;
  const float speculative_scale = static_cast<float>(1.0 / m_.visible_scale);
  worker_->enqueue([this, speculative_scale, arrival = arrival_] {
    // The speculation writes the weights into the staging the device may still be reading.
    if (Status s = m_.staging_writable(); !s.ok()) {
      worker_status_ = s;
      return;
    }
    worker_status_ = m_.tier->speculate(speculative_scale, speculated_with_, no_grad_before_, arrival,
                                        [this](std::size_t i) { return param_ready(i); });
  });
}

Status OverlapSchedule::report_to_store(std::size_t i) {
  Status s = m_.enqueue_d2h(i, 0);
  Result<EventId> copied = s.ok() ? m_.device.record(Stream::d2h) : Result<EventId>(s);
  {
    const std::lock_guard lock(down_mutex_);
    if (copied.ok()) down_[i] = copied.value();
    else gate_stopped_ = true;  // the speculation cannot complete: step() steps as sync
  }
  down_cv_.notify_all();
  if (!copied.ok()) return copied.status();
  return m_.grad_leaves_when_reported(i) ? m_.grad_left_device(i) : Status::success();
}

// On the worker, inside the store's speculation: parameter i's gradient is down (true), or it has none
// this iteration (false: not reported by the end of backward). An fp16 overflow (or a NaN/Inf the step would
// refuse) stops the speculation: the step will be skipped.
Result<bool> OverlapSchedule::param_ready(std::size_t i) {
  std::optional<EventId> copied;
  {
    std::unique_lock lock(down_mutex_);
    down_cv_.wait(lock, [&] { return down_[i].has_value() || all_reported_ || gate_stopped_; });
    if (gate_stopped_) return Status(StatusCode::internal, "the speculation was stopped");
    copied = down_[i];
  }
  if (!copied) return false;
  if (Status s = m_.device.synchronize(*copied); !s.ok()) return s;
  const OffloadOptions& o = m_.options;
  for (std::size_t k = m_.first_piece[i]; k < m_.first_piece[i + 1]; ++k) {
    if ((o.loss_scale.enabled || o.refuse_non_finite) && m_.stats[0][k].non_finite > 0) {
      overflow_seen_ = true;
      return Status(StatusCode::non_finite, "parameter " + std::to_string(i) + " has a NaN/Inf gradient");
    }
  }
  return true;
}

void OverlapSchedule::stop_gate() {
  {
    const std::lock_guard lock(down_mutex_);
    gate_stopped_ = true;
  }
  down_cv_.notify_all();
}

Status OverlapSchedule::stop_store_speculation() {
  if (!store_speculation_) return Status::success();
  stop_gate();
  worker_->drain();
  worker_status_ = Status::success();  // whatever stopped it, nothing of it is kept
  store_speculation_ = false;
  overflow_seen_ = false;
  return m_.tier->discard_speculation();
}

// The speculation is kept when it stepped what sync would have: no skip, no clipping, the same
// hyper-parameters, every gradient as reported, no parameter stepped that is now named absent and none left
// out that has a gradient after all.
Status OverlapSchedule::step_in_store() {
  bool keep = !retake_ && !taken_again_;
  if (keep) {
    if (Status s = report_the_rest(); !s.ok()) return s;  // the end of backward; starts the speculation if unstarted
    worker_->drain();
    keep = store_speculation_ && std::exchange(worker_status_, Status::success()).ok();
  }
  Impl::Decision d{};
  if (keep) {
    d = m_.decide(0, m_.visible_scale, m_.options.max_grad_norm);
    const std::vector<char>& stepped = m_.tier->speculated_params();
    bool as_sync = stepped.size() == m_.params.size();
    for (std::size_t i = 0; i < stepped.size() && as_sync; ++i) {
      const bool has_grad = reported_[i] && !m_.is_absent(i, 0) && m_.params[i].n > 0;
      as_sync = (stepped[i] != 0) == has_grad;
    }
    keep = steps_as_sync(d) && as_sync;
  }
  if (!keep) {
    // The store still holds the state before the step: sync's step from there, over the gradients (taken
    // again where they changed).
    if (store_speculation_) ++m_.stats_.redone;
    if (Status s = stop_store_speculation(); !s.ok()) return s;
    Result<int> taken = take_grads();
    end_iteration();
    if (!taken.ok()) return taken.status();
    return finish_sync_step(m_);
  }
  const Status committed = m_.tier->commit_speculation();
  end_iteration();
  if (!committed.ok()) return committed;
  // The staging holds the step's weights: up to the device and into the parameter tiers.
  if (Status s = m_.send_all_weights(); !s.ok()) return m_.weights_not_sent(d, 0, s);
  m_.record_outcome(d, 0);
  m_.visible_scale = m_.scaler.scale();
  return Status::success();
}

}  // namespace

// OverlapSchedule::allocate's second state set (Impl::allocate_second_set), where the tier steps in RAM
// (tier ram): the tier's arrays once more, the master whole (in place, an f32 parameter's speculative master
// is written there), and the 16-bit weights from device.allocate_host, as the weight staging.
SpaceNeed overlap_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options) {
  SpaceNeed need;
  if (options.tier != Tier::ram) return need;
  std::size_t total = 0, weights = 0, blocks = 0;
  for (const ParamSpec& p : params) {
    total += p.n;
    weights += p.dtype == DType::f32 ? 0 : p.n * 2;
    blocks += moment_blocks(p.n);
  }
  const std::size_t moments = 2 * AlignedBuffer::size_for(total * dtype_size(options.state_dtype));
  need.add_ram("overlap's second state set", AlignedBuffer::size_for(total * 4) + moments +
                                                 AlignedBuffer::io_size(std::max<std::size_t>(weights, 1)));
  if (options.state_dtype == DType::i8) need.add_ram("overlap's second state set", 2 * AlignedBuffer::size_for(blocks * 4));
  return need;
}

Result<std::unique_ptr<StepSchedule>> make_overlap_schedule(Impl& m) {
  auto schedule = std::make_unique<OverlapSchedule>(m);
  if (Status s = schedule->allocate(); !s.ok()) return s;
  return std::unique_ptr<StepSchedule>(std::move(schedule));
}

}  // namespace zoe
