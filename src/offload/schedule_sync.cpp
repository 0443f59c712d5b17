// sync: after backward, every gradient down, then the decision, then the step, then every weight up. The
// reference the other schedules are tested against, and the fallback they share (the delayed warm-up,
// overlap on tier nvme, partitioned optimizers).
#include "src/offload/optimizer_impl.h"

namespace zoe {

Status take_all_grads(Impl& m) {
  if (m.grads_in_place) return m.grad_stats_in_place(0);
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    if (m.grad_down[i]) continue;  // taken when reported; the device's buffer may hold another block's now
    if (m.is_absent(i, 0)) continue;  // no gradient: the step leaves it as it is
    if (Status s = m.enqueue_d2h(i, 0); !s.ok()) return s;
  }
  Result<EventId> copied = m.device.record(Stream::d2h);
  if (!copied.ok()) return copied.status();
  if (Status s = m.device.synchronize(copied.value()); !s.ok()) return s;
  // Spilled: a gradient whose write failed is lost (the trainer may have freed it); nothing steps without it.
  if (m.spill != nullptr) {
    if (Status s = m.spill->flush(); !s.ok()) {
      return Status(s.code(), "a gradient could not be written to the spill file " + m.spill->path() + ": " +
                    s.message() + "; this iteration's gradients are incomplete and nothing was stepped: "
                    "abandon_iteration() and run the iteration again");
    }
  }
  return Status::success();
}

Status sync_step(Impl& m) {
  if (Status s = take_all_grads(m); !s.ok()) return s;
  return finish_sync_step(m);
}

Status finish_sync_step(Impl& m) {
  const Impl::Decision d = m.decide(0, m.visible_scale, m.options.max_grad_norm);
  if (!d.error.ok()) return d.error;
  if (d.refused) return m.non_finite_error(0);
  if (!d.overflow) {
    if (Status s = m.staging_writable(); !s.ok()) return s;
    if (Status s = m.step_all(d.grad_scale, 0, m.groups); !s.ok()) return s;
    if (Status s = m.send_all_weights(); !s.ok()) return m.weights_not_sent(d, 0, s);
  }
  m.record_outcome(d, 0);
  m.visible_scale = m.scaler.scale();
  return Status::success();
}

namespace {

class SyncSchedule final : public StepSchedule {
 public:
  explicit SyncSchedule(Impl& m) : m_(m) {}
  // Every gradient is taken at step(), but a tiered one's, which leaves the device when reported.
  Status grad_ready(std::size_t i) override { return m_.take_reported_grad(i, 0); }
  Status step() override {
    Result<int> taken = take_grads();
    taken_ = false;
    if (!taken.ok()) return taken.status();
    return finish_sync_step(m_);
  }
  Result<int> take_grads() override {
    if (!taken_) {
      if (Status s = take_all_grads(m_); !s.ok()) return s;
      taken_ = true;
    }
    return 0;
  }
  void retake() override { taken_ = false; }
  Status abandon() override {
    taken_ = false;
    return Status::success();
  }

 private:
  Impl& m_;
  bool taken_ = false;  // this iteration's gradients are down, with their statistics (grad_norm())
};

}  // namespace

std::unique_ptr<StepSchedule> make_sync_schedule(Impl& m) { return std::make_unique<SyncSchedule>(m); }

}  // namespace zoe
