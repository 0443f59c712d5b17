// The overlap schedule (docs/architecture.md, "Schedules"): each reported parameter's gradient comes down
// during backward and is stepped speculatively — as if no clipping and no overflow — while backward goes
// on; step() keeps what sync would have stepped and steps the rest as sync. What both tiers share is here:
// the iteration's reports, the worker, and the one check of whether a speculation may be kept
// (steps_as_sync). Tier ram speculates piece by piece into its second state set (schedule_overlap_ram.cpp);
// tier nvme in one call of the swap store (schedule_overlap_store.cpp).
#pragma once

#include "src/private.h"

#include <atomic>
#include <memory>
#include <vector>

#include "base/work_queue.h"
#include "src/offload/optimizer_impl.h"

namespace zoe {

class OverlapSchedule : public StepSchedule {
 public:
  explicit OverlapSchedule(Impl& m) : m_(m) {}

  // Marks parameter i reported (once per iteration); the first report fixes the hyper-parameters the
  // speculation uses and starts it (start()); then the tier's part takes the report (report()).
  Status grad_ready(std::size_t i) final;
  Result<int> take_grads() final;
  void retake() final { retake_ = true; }
  // What reads or writes the state (save, load, read_state, write_state, the step counts) must not run beside
  // the speculation, and sees the state before this iteration's step: the speculation is dropped, and
  // step() steps again.
  Status wait() final { return drop(); }
  Status discard_speculative_steps() final { return drop(); }
  // Nothing of the iteration is kept: no speculative step, no report, and nothing learnt from its partial
  // order of reports (the next speculation uses the last whole iteration's).
  Status abandon() final;

 protected:
  // The tier's part: what the first report starts, what each report does, what the end of backward tells,
  // and how a speculation is dropped (waiting for it; the state then is the last step's).
  virtual void start() {}
  virtual Status report(std::size_t i) = 0;
  virtual void all_reported() {}
  virtual Status drop() = 0;
  // Forgets the iteration; end_iteration() first learns from it where the tier does.
  virtual void forget_iteration();
  virtual void end_iteration() { forget_iteration(); }

  // The one check of both tiers' speculation: it stepped what sync steps now, given decision d — gradients
  // as reported (not taken again), no skip, no clipping (the scale it used), the same hyper-parameters.
  // Which parameters it stepped is each tier's own question.
  bool steps_as_sync(const Impl::Decision& d) const;
  // Every parameter the trainer did not report is reported now: its gradient is final at the end of backward.
  // Those still unreported then have none this iteration.
  Status report_the_rest();
  float speculation_scale() const { return static_cast<float>(1.0 / m_.visible_scale); }

  Impl& m_;
  // This iteration: which parameters were reported.
  std::vector<char> reported_;
  std::atomic<bool> overflow_seen_{false};
  // The gradients changed after they were reported (retake()); they were taken again, synchronously, after
  // the speculation was dropped (taken_again_): step() then steps every piece.
  bool retake_ = false, taken_again_ = false;
  // The groups' hyper-parameters the speculative steps of this iteration use (speculating_: set).
  std::vector<ParamGroup> speculated_with_;
  bool speculating_ = false;
  Status worker_status_;  // the first failure inside the worker
  // The speculation's thread. Each tier's destructor stops and resets it first: its closures use the tier's
  // members.
  std::unique_ptr<WorkQueue> worker_ = std::make_unique<WorkQueue>();
};

Result<std::unique_ptr<StepSchedule>> make_ram_overlap(Impl& m);
Result<std::unique_ptr<StepSchedule>> make_store_overlap(Impl& m);

}  // namespace zoe
