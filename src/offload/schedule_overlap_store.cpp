// overlap on tier nvme: the state is not in RAM, so from the iteration's first report one speculative call
// of the tier steps the whole store on the worker, each tile once the gradients of its parameters are down
// (param_ready), tiles in the order the last iteration reported their parameters, its new state written
// beside the old (SwapStore::speculate). step() then commits it, or discards it and steps as sync from the
// state the store still holds.
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/schedule_overlap.h"

namespace zoe {
namespace {

class StoreOverlap final : public OverlapSchedule {
 public:
  explicit StoreOverlap(Impl& m) : OverlapSchedule(m) {
    reported_.assign(m_.params.size(), 0);
    down_.assign(m_.params.size(), std::nullopt);
    no_grad_before_.assign(m_.params.size(), 0);
  }
  ~StoreOverlap() override {
    stop_gate();  // a speculation of the store waiting for gradients ends
    worker_.reset();  // its closures use this schedule's members
  }

  Status step() override;

 private:
  void start() override;  // the store's speculation, on the worker
  Status report(std::size_t i) override {
    reports_.push_back(i);
    return report_to_store(i);
  }
  void all_reported() override {
    {
      const std::lock_guard lock(down_mutex_);
      all_reported_ = true;
    }
    down_cv_.notify_all();
  }
  Status drop() override;  // stops the speculation, waits for it and discards what it stepped
  // Learns the order of the reports and who had none, then forgets the iteration.
  void end_iteration() override;
  void forget_iteration() override;
  Status report_to_store(std::size_t i);
  Result<bool> param_ready(std::size_t i);
  void stop_gate();

  // The store's speculation (store_speculation_: started this iteration and not stopped), and the hand-off
  // from the trainer's reports to its gate: each reported parameter's copy event.
  bool store_speculation_ = false;
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
};

void StoreOverlap::end_iteration() {
  for (std::size_t i = 0; i < m_.params.size(); ++i) no_grad_before_[i] = !reported_[i] || m_.is_absent(i, 0);
  if (!reports_.empty()) {
    arrival_.assign(m_.params.size(), m_.params.size());  // not reported: left out of the next speculation
    for (std::size_t k = 0; k < reports_.size(); ++k) arrival_[reports_[k]] = k;
  }
  forget_iteration();
}

void StoreOverlap::forget_iteration() {
  reports_.clear();
  {
    const std::lock_guard lock(down_mutex_);
    std::fill(down_.begin(), down_.end(), std::nullopt);
    all_reported_ = gate_stopped_ = false;
  }
  store_speculation_ = false;
  OverlapSchedule::forget_iteration();
}

void StoreOverlap::start() {
  store_speculation_ = true;
  worker_->enqueue([this, speculative_scale = speculation_scale(), arrival = arrival_] {
    // The speculation writes the weights into the staging the device may still be reading.
    if (Status s = m_.staging_writable(); !s.ok()) {
      worker_status_ = s;
      return;
    }
    worker_status_ = m_.tier->speculate(speculative_scale, speculated_with_, no_grad_before_, arrival,
                                        [this](std::size_t i) { return param_ready(i); });
  });
}

Status StoreOverlap::report_to_store(std::size_t i) {
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
Result<bool> StoreOverlap::param_ready(std::size_t i) {
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

void StoreOverlap::stop_gate() {
  {
    const std::lock_guard lock(down_mutex_);
    gate_stopped_ = true;
  }
  down_cv_.notify_all();
}

Status StoreOverlap::drop() {
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
Status StoreOverlap::step() {
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
    if (Status s = drop(); !s.ok()) return s;
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

Result<std::unique_ptr<StepSchedule>> make_store_overlap(Impl& m) {
  return std::unique_ptr<StepSchedule>(std::make_unique<StoreOverlap>(m));
}

}  // namespace zoe
