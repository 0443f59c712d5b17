// The overlap schedule's shared part (schedule_overlap.h): reports, the keep check, and which tier's part
// runs. Speculative steps use the hyper-parameters set when the iteration's first gradient was reported; a
// trainer that sets others before step() (a learning-rate schedule stepped late) has them dropped and redone.
#include "src/offload/schedule_overlap.h"

#include <algorithm>
#include <string>

#include "src/offload/footprint.h"

namespace zoe {

Status OverlapSchedule::grad_ready(std::size_t i) {
  if (reported_[i]) return invalid_argument("parameter " + std::to_string(i) + " was reported ready twice in one iteration");
  reported_[i] = 1;
  if (!speculating_) {
    // Copied for the worker: the trainer may set the groups' hyper-parameters while it steps.
    speculated_with_ = m_.groups;
    speculating_ = true;
    start();
  }
  return report(i);
}

Result<int> OverlapSchedule::take_grads() {
  if (Status s = report_the_rest(); !s.ok()) return s;
  if (retake_) {
    if (Status s = drop(); !s.ok()) return s;
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

Status OverlapSchedule::abandon() {
  Status s = drop();
  worker_->drain();
  forget_iteration();
  return s;
}

void OverlapSchedule::forget_iteration() {
  std::fill(reported_.begin(), reported_.end(), 0);
  overflow_seen_ = false;
  retake_ = taken_again_ = false;
  speculating_ = false;
}

Status OverlapSchedule::report_the_rest() {
  for (std::size_t i = 0; i < m_.params.size(); ++i) {
    if (!reported_[i] && !m_.is_absent(i, 0)) {
      if (Status s = grad_ready(i); !s.ok()) return s;
    }
  }
  all_reported();
  return Status::success();
}

namespace {

bool same_hyper(const std::vector<ParamGroup>& a, const std::vector<ParamGroup>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const ParamGroup& x, const ParamGroup& y) { return x.hyper == y.hyper; });
}

}  // namespace

bool OverlapSchedule::steps_as_sync(const Impl::Decision& d) const {
  return !retake_ && !taken_again_ && d.error.ok() && !d.overflow && !d.refused &&
         d.grad_scale == speculation_scale() && same_hyper(speculated_with_, m_.groups);
}

// RamOverlap::allocate's second state set (Impl::allocate_second_set), where the tier steps in RAM
// (tier ram): the tier's arrays once more, the master whole (in place, an f32 parameter's speculative master
// is written there), and the 16-bit weights from device.allocate_host, as the weight staging.
SpaceNeed overlap_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t states) {
  SpaceNeed need;
  if (options.tier != Tier::ram) return need;
  std::size_t total = 0, weights = 0, blocks = 0;
  for (const ParamSpec& p : params) {
    total += p.n;
    weights += p.dtype == DType::f32 ? 0 : p.n * 2;
    blocks += moment_blocks(p.n);
  }
  const std::size_t moments = states * AlignedBuffer::size_for(total * dtype_size(options.state_dtype));
  need.add_ram("overlap's second state set", AlignedBuffer::size_for(total * 4) + moments +
                                                 AlignedBuffer::io_size(std::max<std::size_t>(weights, 1)));
  if (options.state_dtype == DType::i8) {  // a scale per block and moment: Adam's two, Lion's one
    need.add_ram("overlap's second state set", states * AlignedBuffer::size_for(blocks * 4));
  }
  return need;
}

// Tier ram speculates piece by piece into its second state set; tier nvme in the swap store.
Result<std::unique_ptr<StepSchedule>> make_overlap_schedule(Impl& m) {
  if (m.tier->speculates()) return make_store_overlap(m);
  if (m.tier->in_ram()) return make_ram_overlap(m);
  return invalid_argument("the overlap schedule needs a tier that steps pieces in RAM or speculates (tier ram or nvme)");
}

}  // namespace zoe
