// delayed (ZeRO-Offload's delayed parameter update): after delayed_warmup_steps sync steps, step() starts
// the step in the background and returns; the next iteration runs on the device with weights one step old
// while the CPU steps. The new weights go up parameter by parameter during that next iteration's backward:
// once a parameter's gradient is final, the device reads its weights no more in that iteration, so its H2D
// may overwrite them while backward goes on. The trainer usually runs ahead of the device, so whichever
// comes second — the gradient's report or the end of the background step — sends the weights; step() sends
// what is left. A send that a parameter tier refuses (a failed write) does not interrupt the backward: it is
// made again by the next step(), from the staging that still holds those weights, before anything else — so
// before any forward reads them; if it fails again, that step() fails having started nothing.
// An iteration the trainer abandons (abandon_iteration(): an exception in its backward) keeps the previous
// step, but not its weights that went up during it: the forward of the iteration run again must read the
// weights the abandoned one read, as an uninterrupted run's does. So the background step first copies the
// weights it is about to replace (previous_, as many bytes as the weights the device holds), and the
// abandon sends them back to the parameters whose new weights had gone up.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "base/warning.h"
#include "src/offload/footprint.h"
#include "src/offload/optimizer_impl.h"
#include "base/work_queue.h"
#include "zoe/param_tier.h"

namespace zoe {
namespace {

class DelayedSchedule final : public StepSchedule {
 public:
  explicit DelayedSchedule(Impl& m)
      : m_(m), reported_(m.params.size(), 0), h2d_sent_(m.params.size(), 0), grad_done_(m.params.size(), 0) {}
  ~DelayedSchedule() override {
    background_.reset();  // joins the step before the members it uses go
    m_.device.free_host(previous_);
  }

  Status grad_ready(std::size_t i) override {
    if (warming_up()) return m_.take_reported_grad(i, 0);  // the sync warm-up takes the others at step()
    if (reported_[i]) return invalid_argument("parameter " + std::to_string(i) + " was reported ready twice in one iteration");
    reported_[i] = 1;
    if (Status s = m_.enqueue_d2h(i, grad_set_); !s.ok()) return s;
    if (m_.grad_leaves_when_reported(i)) {
      if (Status s = m_.grad_left_device(i); !s.ok()) return s;
    }
    // Marks the work that produced gradient i: the last to read weights i in this iteration.
    Result<EventId> produced = m_.device.record(Stream::compute);
    if (!produced.ok()) return produced.status();
    std::lock_guard lock(h2d_mutex_);
    grad_done_[i] = produced.value();
    report_order_.push_back(i);
    if (!update_done_) return Status::success();
    return send_weights(i);
  }

  Status step() override;

  Result<int> take_grads() override {
    if (warming_up()) {
      if (!taken_) {
        if (Status s = take_all_grads(m_); !s.ok()) return s;
        taken_ = true;
      }
      return 0;
    }
    if (Status s = report_all(); !s.ok()) return s;
    Result<EventId> copied = m_.device.record(Stream::d2h);
    if (!copied.ok()) return copied.status();
    if (Status s = m_.device.synchronize(copied.value()); !s.ok()) return s;
    return grad_set_;
  }

  int current_set() const override { return grad_set_; }

  void retake() override {
    retake_ = true;
    taken_ = false;
  }

  Status wait() override {
    Result<EventId> sent = flush();
    if (!sent.ok()) return sent.status();
    return m_.device.synchronize(sent.value());
  }

  Status abandon() override;

 private:
  bool warming_up() const { return m_.step_calls < m_.options.delayed_warmup_steps; }
  // Every parameter not yet reported is reported now; after retake(), every gradient comes down again.
  Status report_all();
  Status send_weights(std::size_t i);                      // with h2d_mutex_ held
  Status send(std::size_t i);                              // with h2d_mutex_ held: a tier's refusal is kept
  Status send_again();                                     // with h2d_mutex_ held: the failed sends
  Status finish_background_step(const Status& status);  // the background step, as its last act
  // Joins the background step and sends what is left of its weights; returns the event the host waits
  // for before the weight staging is written again.
  Result<EventId> flush();
  // In the background step, before it writes the weight staging and the fp32 masters: the weights the
  // device holds now (the sources of enqueue_h2d), into previous_ at each parameter's grad_offsets.
  Status keep_previous_weights();

  Impl& m_;
  int grad_set_ = 0;
  std::vector<char> reported_;
  bool taken_ = false;   // warm-up: this iteration's gradients are down (grad_norm())
  bool retake_ = false;  // the reported gradients changed: copy them down again
  Status worker_status_;  // the background step's failure
  // The last step's weights wait to be sent (pending_h2d_), the background step has finished
  // (update_done_), which parameters' weights are on their way (h2d_sent_), and the compute event after
  // which each reported parameter's weights may be overwritten (grad_done_, 0: none), in report order
  // (report_order_). Guarded by h2d_mutex_.
  std::mutex h2d_mutex_;
  bool pending_h2d_ = false;
  bool update_done_ = false;
  std::vector<char> h2d_sent_;
  std::vector<EventId> grad_done_;
  std::vector<std::size_t> report_order_;
  std::vector<std::size_t> unsent_;  // sends that failed, with the first failure: made again by flush()
  Status unsent_cause_;
  void* previous_ = nullptr;  // pinned: copied to the device as the staging is
  std::unique_ptr<WorkQueue> background_ = std::make_unique<WorkQueue>();
};

Status DelayedSchedule::send_weights(std::size_t i) {
  if (h2d_sent_[i] || grad_done_[i] == 0) return Status::success();
  const EventId after = std::exchange(grad_done_[i], 0);
  if (Status s = m_.device.wait(Stream::h2d, after); !s.ok()) return s;
  h2d_sent_[i] = 1;
  return pending_h2d_ ? send(i) : Status::success();
}

Status DelayedSchedule::send(std::size_t i) {
  Status s = m_.enqueue_h2d(i);
  if (s.ok() || m_.params[i].tier == nullptr) return s;
  warn("writing the weights of parameter '" + m_.params[i].name + "' to the parameter tier failed (" + s.message() +
       "); the next step() writes them again");
  if (unsent_.empty()) unsent_cause_ = s;
  unsent_.push_back(i);
  return Status::success();
}

Status DelayedSchedule::send_again() {
  while (!unsent_.empty()) {
    const std::size_t i = unsent_.back();
    if (Status s = m_.enqueue_h2d(i); !s.ok()) {
      return Status(s.code(), "the weights of parameter '" + m_.params[i].name + "' after step " +
                                  std::to_string(m_.step_count.load()) + " could not be written to the parameter tier (" +
                                  unsent_cause_.message() + "; again now: " + s.message() +
                                  "); that step was applied and the tier keeps their previous copy: call step() again "
                                  "once the fault is cleared — it writes them first and steps nothing twice",
                    s.sys_errno());
    }
    unsent_.pop_back();
  }
  return Status::success();
}

Status DelayedSchedule::finish_background_step(const Status& status) {
  std::lock_guard lock(h2d_mutex_);
  update_done_ = true;
  Status result = status;
  // In the order the gradients were reported: the device's stream runs in order, and a copy waiting for a
  // late gradient must not hold up those whose gradients came earlier.
  for (std::size_t k = 0; k < report_order_.size() && result.ok(); ++k) result = send_weights(report_order_[k]);
  return result;
}

Result<EventId> DelayedSchedule::flush() {
  background_->drain();
  std::lock_guard lock(h2d_mutex_);
  // Before anything else: nothing has rewritten the staging since those weights were stepped.
  if (Status s = send_again(); !s.ok()) return s;
  Status status = std::exchange(worker_status_, Status::success());
  // Every parameter not reported this iteration: after all the compute enqueued so far.
  Result<EventId> computed = m_.device.record(Stream::compute);
  if (!computed.ok()) return computed.status();
  if (Status s = m_.device.wait(Stream::h2d, computed.value()); !s.ok()) return s;
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    if (h2d_sent_[i]) continue;
    if (grad_done_[i] != 0) {
      if (Status s = m_.device.wait(Stream::h2d, std::exchange(grad_done_[i], 0)); !s.ok()) return s;
    }
    if (pending_h2d_ && status.ok()) {
      if (Status s = send(i); !s.ok()) return s;
    }
  }
  pending_h2d_ = false;
  update_done_ = false;
  std::fill(h2d_sent_.begin(), h2d_sent_.end(), 0);
  report_order_.clear();
  if (Status s = send_again(); !s.ok()) return s;
  // The background step failed or was refused: nothing of it reached the state or the device.
  if (!status.ok()) return Status(status.code(), "the previous step (delayed schedule): " + status.message(), status.sys_errno());
  m_.visible_scale = m_.scaler.scale();
  // The caller waits for the returned event before the weight staging is written again.
  return m_.weights_sent();
}

Status DelayedSchedule::report_all() {
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    if (!reported_[i]) {
      if (m_.is_absent(i, grad_set_)) continue;  // no gradient: the step leaves it as it is
      if (Status s = grad_ready(i); !s.ok()) return s;
    } else if (retake_) {
      // Queued after the compute that changed them; their statistics are taken again with them.
      if (Status s = m_.enqueue_d2h(i, grad_set_); !s.ok()) return s;
    }
  }
  retake_ = false;
  return Status::success();
}

Status DelayedSchedule::step() {
  if (warming_up()) {
    retake_ = false;
    return std::exchange(taken_, false) ? finish_sync_step(m_) : sync_step(m_);
  }
  const int set = grad_set_;
  if (Status s = report_all(); !s.ok()) return s;
  std::fill(reported_.begin(), reported_.end(), 0);
  const float scale_used = m_.visible_scale;  // what this iteration's loss was scaled by
  // The clipping set for this step: the trainer may set the next step's (set_max_grad_norm) while this one
  // is decided in the background.
  const float max_norm = m_.options.max_grad_norm;
  Result<EventId> sent = flush();
  if (!sent.ok()) return sent.status();
  Result<EventId> copied = m_.device.record(Stream::d2h);
  Result<EventId> copied_compute = m_.device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  if (!copied_compute.ok()) return copied_compute.status();
  // The next backward must not overwrite the gradients before they are down.
  if (Status s = m_.device.wait(Stream::compute, copied_compute.value()); !s.ok()) return s;
  grad_set_ ^= 1;
  background_->enqueue([this, set, scale_used, max_norm, copied = copied.value(), sent = sent.value(), hyper = m_.groups] {
    Status s = m_.device.synchronize(copied);
    // The weight staging is still being sent up until `sent` completes.
    if (Status t = m_.device.synchronize(sent); s.ok()) s = t;
    if (s.ok()) {
      const Impl::Decision d = m_.decide(set, scale_used, max_norm);
      if (d.refused) s = m_.non_finite_error(set);
      if (s.ok() && !d.overflow) {
        s = keep_previous_weights();
        if (s.ok()) s = m_.step_all(d.grad_scale, set, hyper);
        if (s.ok()) pending_h2d_ = true;
      }
      if (s.ok()) m_.record_outcome(d, set);
    }
    s = finish_background_step(s);
    if (!s.ok()) worker_status_ = s;
  });
  return Status::success();
}

Status DelayedSchedule::keep_previous_weights() {
  if (previous_ == nullptr) {
    Result<void*> r = m_.device.allocate_host(std::max<std::size_t>(m_.grad_offsets.back(), 1));
    if (!r.ok()) return r.status();
    previous_ = r.value();
  }
  // Piece by piece on the engine's threads: as large as the weights, a small part of the step's traffic.
  m_.adam.parallel_for(m_.pieces.size(), [this](std::size_t k) {
    const Piece& piece = m_.pieces[k];
    const ParamSpec& p = m_.params[piece.param];
    const std::size_t elem = dtype_size(p.dtype);
    const void* from = p.dtype == DType::f32 ? static_cast<const void*>(m_.master_of(piece.param))
                                             : m_.weights_of(piece.param);
    std::memcpy(static_cast<unsigned char*>(previous_) + m_.grad_offsets[piece.param] + piece.begin * elem,
                static_cast<const unsigned char*>(from) + piece.begin * elem, piece.n * elem);
  });
  return Status::success();
}

Status DelayedSchedule::abandon() {
  retake_ = taken_ = false;
  std::fill(reported_.begin(), reported_.end(), 0);
  background_->drain();  // its own sends to parameters reported already are made first, then put back
  std::lock_guard lock(h2d_mutex_);
  std::fill(grad_done_.begin(), grad_done_.end(), 0);
  report_order_.clear();
  bool resent = false;
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    // h2d_sent_ marks parameters whose new weights went up (pending_h2d_) or had nothing to send: those are
    // sent again in the iteration run again, as its reports come.
    if (!std::exchange(h2d_sent_[i], 0) || !pending_h2d_ || previous_ == nullptr || m_.params[i].n == 0) continue;
    if (!std::exchange(resent, true)) {
      // After the compute enqueued so far: the abandoned backward may still read the weights.
      Result<EventId> computed = m_.device.record(Stream::compute);
      if (!computed.ok()) return computed.status();
      if (Status s = m_.device.wait(Stream::h2d, computed.value()); !s.ok()) return s;
    }
    const ParamSpec& p = m_.params[i];
    const void* from = static_cast<const unsigned char*>(previous_) + m_.grad_offsets[i];
    const std::size_t bytes = p.n * dtype_size(p.dtype);
    Status s = p.tier != nullptr ? p.tier->write(p.tier_block, p.tier_entry, from, 0, bytes)
                                 : m_.device.copy_to_device(p.device_weights, from, bytes, Stream::h2d);
    if (!s.ok()) return s;
  }
  return resent ? m_.finish_h2d() : Status::success();
}

}  // namespace

// keep_previous_weights's copy of the weights the background step replaces (allocated at its first step).
SpaceNeed delayed_footprint(const std::vector<ParamSpec>& params) {
  std::size_t grad_bytes = 0;
  for (const ParamSpec& p : params) grad_bytes += p.n * dtype_size(p.dtype);
  SpaceNeed need;
  need.add_ram("delayed's previous weights", AlignedBuffer::io_size(std::max<std::size_t>(grad_bytes, 1)));
  return need;
}

std::unique_ptr<StepSchedule> make_delayed_schedule(Impl& m) { return std::make_unique<DelayedSchedule>(m); }

}  // namespace zoe
