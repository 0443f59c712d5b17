// overlap on tier ram: each reported parameter comes down piece by piece, and each piece is stepped
// speculatively and sent up as soon as it is down, while backward goes on; pieces keep the work left after
// the last gradient short. A speculative step reads the piece's current state set and writes the other one
// (ping-pong, Impl::current_set), so the current set is the state before the step until step() keeps the
// speculation (Impl::keep_aside makes the other set current). step() validates: an overflow (or a refused
// NaN/Inf) drops every speculative step and resends the current weights; a clip coefficient below 1 drops
// them and steps the current set again with it. Gradients the trainer changed after reporting them
// (retake()) drop every speculative step too, and the step is then sync's, over the gradients taken again.
#include <algorithm>
#include <utility>
#include <vector>

#include "src/arena.h"
#include "src/offload/schedule_overlap.h"

namespace zoe {
namespace {

class RamOverlap final : public OverlapSchedule {
 public:
  explicit RamOverlap(Impl& m) : OverlapSchedule(m) {}
  ~RamOverlap() override { worker_.reset(); }  // its closures use stepped_

  // Speculation fails when clipping, an fp16 overflow or a refused NaN/Inf changes the step, and when the
  // trainer changes gradients after reporting them (grads_changed(), clip_grad_norm_ by the trainer,
  // set_max_grad_norm() between steps): the speculative steps write a second state set.
  Status allocate() {
    reported_.assign(m_.params.size(), 0);
    stepped_.assign(m_.pieces.size(), 0);
    return m_.allocate_second_set();
  }

  Status step() override;

  // A piece's step reads whether its parameter is absent (then whether to write it aside and mark the piece
  // stepped) and where its gradient is (the micro-batches' sum or the copy): what set_grads_absent() and
  // grads_changed() change must not change under it.
  void wait_for_speculative_steps() override { worker_->drain(); }

 private:
  Status report(std::size_t i) override {
    Status s = m_.enqueue_d2h(i, 0, [this](std::size_t k, EventId copied) { return step_piece_when_down(k, copied); });
    if (!s.ok() || !m_.grad_leaves_when_reported(i)) return s;
    return m_.grad_left_device(i);
  }
  // Waits for the speculative steps and drops what they wrote aside, resending the current weights; no
  // piece is then stepped, and step() steps them all.
  Status drop() override;
  void forget_iteration() override {
    std::fill(stepped_.begin(), stepped_.end(), 0);
    OverlapSchedule::forget_iteration();
  }
  Status step_piece_when_down(std::size_t k, EventId copied);

  std::vector<char> stepped_;  // this iteration: the pieces stepped speculatively
};

Status RamOverlap::step_piece_when_down(std::size_t k, EventId copied) {
  worker_->enqueue([this, k, copied, speculative_scale = speculation_scale()] {
    keep_core_binding_on_this_thread();  // it enters the engine's arena once per piece (src/arena.h)
    if (!worker_status_.ok()) return;
    if (Status s = m_.device.synchronize(copied); !s.ok()) {
      worker_status_ = s;
      return;
    }
    const OffloadOptions& o = m_.options;
    if ((o.loss_scale.enabled || o.refuse_non_finite) && m_.stats[0][k].non_finite > 0) overflow_seen_ = true;
    if (overflow_seen_) return;  // this step will be skipped: stepping more would only be dropped
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

Status RamOverlap::drop() {
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

Status RamOverlap::step() {
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

}  // namespace

Result<std::unique_ptr<StepSchedule>> make_ram_overlap(Impl& m) {
  auto schedule = std::make_unique<RamOverlap>(m);
  if (Status s = schedule->allocate(); !s.ok()) return s;
  return std::unique_ptr<StepSchedule>(std::move(schedule));
}

}  // namespace zoe
