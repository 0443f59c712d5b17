// What an OffloadOptimizer will hold, computed before it allocates anything (zoe/space.h): the host RAM of
// its tier, staging, accumulation sums and schedule, and the swap files of tier nvme. Each part's bytes come
// from a function next to the allocation it stands for (tier_ram.cpp, tier_nvme.cpp, accumulation.cpp,
// schedule_overlap.cpp, schedule_delayed.cpp; the staging here, beside Impl::allocate's rule for reading in
// place), and tests/offload/test_space.cpp compares the sum with what the allocations take.
#pragma once

#include "src/private.h"

#include <cstddef>
#include <vector>

#include "zoe/device.h"
#include "zoe/offload.h"
#include "zoe/space.h"
#include "zoe/swap.h"

namespace zoe {

// OK when the optimizer fits what is free; else the refusal (zoe/space.h: check_space) with a `zoe plan`
// command for these parameters and options. Impl::allocate calls it before its first allocation. `hyper`:
// a group's (zoe/optimizers.h), whose rule and amsgrad say which state arrays the tiers hold.
Status check_optimizer_space(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options,
                             const char* store_name, const OptimizerHyper& hyper);
Result<SpaceNeed> optimizer_footprint(const Device& device, const std::vector<ParamSpec>& params,
                                      const OffloadOptions& options, const char* store_name,
                                      const OptimizerHyper& hyper);

// Impl::allocate's rule for where the step reads gradients and writes weights (optimizer_impl.h: in_place,
// streamed, grads_in_place), the one the footprint counts staging by.
struct StagingRule {
  bool in_place = false;        // gradients and weights where the device keeps them
  bool streamed = false;        // tier nvme's sync step through windows (step_windows.h): no whole staging
  bool grads_in_place = false;  // in_place, or streamed on a device whose memory is host memory
};
StagingRule staging_rule(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options);
bool steps_in_place(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options);

// The parts, each beside its allocation.
// `states`: state arrays per element beside the master (zoe/optimizers.h, state_arrays()).
SpaceNeed ram_tier_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, bool in_place,
                             std::size_t states);
SpaceNeed accumulation_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options);
SpaceNeed overlap_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t states);
SpaceNeed delayed_footprint(const std::vector<ParamSpec>& params);
Result<SpaceNeed> nvme_tier_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options,
                                      const char* name, std::size_t states);
SpaceNeed step_windows_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t tile,
                                 bool grads_in_place);

// Tier nvme's swap store: its options, where each parameter starts in it (at.back(): its size) and its tile.
struct NvmeStoreShape {
  SwapOptions options;
  std::vector<std::size_t> at;
  std::size_t tile = 0;
};
NvmeStoreShape nvme_store_shape(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t states);

}  // namespace zoe
