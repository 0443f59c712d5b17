// What an OffloadOptimizer will hold (footprint.h), summed from its parts, and the check Impl::allocate makes
// with it before its first allocation.
#include "src/offload/footprint.h"

#include <algorithm>
#include <string>

#include "src/offload/grad_spill.h"
#include "zoe/aligned_buffer.h"
#include "zoe/param_tier.h"

namespace zoe {

StagingRule staging_rule(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options) {
  // Weights in a parameter tier are written there from the staging or a window, never in place.
  const bool tiered = std::any_of(params.begin(), params.end(), [](const ParamSpec& p) { return p.tier != nullptr; });
  // Tier nvme steps in place too when every parameter is 16-bit and the schedule is sync. An f32 parameter's
  // master lives in the store, so its device weights are a staged copy the step writes (tier_nvme.cpp).
  const bool all_16bit = std::none_of(params.begin(), params.end(), [](const ParamSpec& p) { return p.dtype == DType::f32; });
  const bool tier_in_place =
      options.tier == Tier::ram ? options.schedule != Schedule::delayed : options.schedule == Schedule::sync && all_16bit;
  StagingRule r;
  r.in_place = device.host_memory() && tier_in_place && !tiered;
  // Streamed needs every gradient on the device until step(): a tiered parameter's on a device with memory of
  // its own leaves when reported (grad_leaves_when_reported), into staging.
  // Spilled, every gradient leaves when reported — into the spill file, which the window reads back.
  const bool reported_down = tiered && !device.host_memory() && !options.grads_stay_on_device && !options.spill_grads;
  r.streamed = options.tier == Tier::nvme && options.schedule == Schedule::sync &&
               options.gradient_accumulation_steps <= 1 && (options.spill_grads || (!r.in_place && !reported_down));
  if (options.spill_grads) r.in_place = false;
  r.grads_in_place = r.in_place || (r.streamed && device.host_memory() && !options.spill_grads);
  return r;
}

bool steps_in_place(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options) {
  return staging_rule(device, params, options).in_place;
}

Result<SpaceNeed> optimizer_footprint(const Device& device, const std::vector<ParamSpec>& params,
                                      const OffloadOptions& options, const char* store_name, const OptimizerHyper& hyper) {
  const StagingRule rule = staging_rule(device, params, options);
  const bool in_place = rule.in_place;
  const std::size_t states = state_arrays(hyper);
  SpaceNeed need;
  if (options.tier == Tier::ram) need += ram_tier_footprint(params, options, in_place, states);
  // Impl::allocate's staging, from device.allocate_host (the host devices' allocate_for_io): gradients (two
  // sets for delayed) and the 16-bit weights; one byte each in place.
  std::size_t grad_bytes = 0, weight_bytes = 0;
  for (const ParamSpec& p : params) {
    grad_bytes += p.n * dtype_size(p.dtype);
    weight_bytes += p.dtype == DType::f32 ? 0 : p.n * 2;
  }
  const std::size_t grad_sets = options.schedule == Schedule::delayed ? 2 : 1;
  const bool no_grads = rule.grads_in_place || rule.streamed, no_weights = in_place || rule.streamed;
  need.add_ram("gradient staging", grad_sets * AlignedBuffer::io_size(no_grads ? 1 : std::max<std::size_t>(grad_bytes, 1)));
  need.add_ram("weight staging", AlignedBuffer::io_size(no_weights ? 1 : std::max<std::size_t>(weight_bytes, 1)));
  need += accumulation_footprint(params, options);
  if (options.tier == Tier::nvme) {
    Result<SpaceNeed> store = nvme_tier_footprint(params, options, store_name, states);
    if (!store.ok()) return store.status();
    need += store.value();
#ifdef ZOE_HAVE_AIO  // a build without libaio has no tier nvme: nvme_tier_footprint refused it above
    if (rule.streamed) need += step_windows_footprint(params, options, nvme_store_shape(params, options, states).tile, rule.grads_in_place);
#endif
    if (options.spill_grads) need += GradSpill::footprint(params, options, store_name);
  }
  if (options.schedule == Schedule::overlap) need += overlap_footprint(params, options, states);
  if (options.schedule == Schedule::delayed) need += delayed_footprint(params);
  return need;
}

namespace {

// The `zoe plan` command that sizes this optimizer: its parameters, tier, state dtype, micro-batches, paths
// and, for parameters in a parameter tier, that placement (stage 3 is where plan puts parameter offload).
std::string plan_command(const std::vector<ParamSpec>& params, const OffloadOptions& options, Rule rule) {
  std::size_t n = 0;
  const ParamTier* tier = nullptr;
  for (const ParamSpec& p : params) {
    n += p.n;
    if (p.tier != nullptr) tier = p.tier;
  }
  std::string plan = "zoe plan --params " + plan_count(n) + " --offload-optimizer " +
                     (options.tier == Tier::nvme ? "nvme" : "cpu") + " --state-dtype " +
                     std::string(state_dtype_name(options.state_dtype));
  if (rule != Rule::adam) plan += " --optimizer " + std::string(optimizer_rule(rule).name);
  if (options.gradient_accumulation_steps > 1) plan += " --grad-accum " + std::to_string(options.gradient_accumulation_steps);
  if (tier != nullptr) plan += std::string(" --stage 3 --offload-param ") + (tier->files().empty() ? "cpu" : "nvme");
  if (options.tier == Tier::nvme) plan += plan_nvme_paths(options.nvme.paths);
  return plan;
}

}  // namespace

Status check_optimizer_space(const Device& device, const std::vector<ParamSpec>& params, const OffloadOptions& options,
                             const char* store_name, const OptimizerHyper& hyper) {
  const Rule rule = hyper.rule;
  Result<SpaceNeed> need = optimizer_footprint(device, params, options, store_name, hyper);
  if (!need.ok()) return need.status();
  std::size_t n = 0;
  for (const ParamSpec& p : params) n += p.n;
  const std::string what = "the optimizer (" + std::to_string(n) + " parameters, tier " +
                           std::string(tier_name(options.tier)) + ", " + std::string(schedule_name(options.schedule)) +
                           " schedule, " + std::string(state_dtype_name(options.state_dtype)) + " state, " +
                           std::string(optimizer_rule(rule).name) + ")";
  return check_space(need.value(), what, plan_command(params, options, rule));
}

}  // namespace zoe
