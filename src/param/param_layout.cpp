// A parameter tier's layout (param_home.h): its blocks' entries aligned, the device pool's budget, and what
// ParamTier::create will hold with them (zoe/space.h), checked before it allocates or creates anything.
#include <algorithm>
#include <string>
#include <utility>

#include "src/param/param_home.h"
#include "zoe/aligned_buffer.h"

namespace zoe {

Result<ParamTierLayout> lay_out_param_tier(std::vector<ParamBlockSpec> specs, const ParamTierOptions& options) {
  if (options.prefetch < 0) return invalid_argument("parameter tier: prefetch = " + std::to_string(options.prefetch) + " must be >= 0");
  ParamTierLayout out;
  const std::size_t alignment = options.home == ParamHome::nvme ? (options.alignment != 0 ? options.alignment : 4096)
                                                                : kDeviceAlignment;
  if ((alignment & (alignment - 1)) != 0 || alignment < kDeviceAlignment) {
    return invalid_argument("parameter tier: alignment = " + std::to_string(alignment) +
                            " must be a power of two of at least " + std::to_string(kDeviceAlignment));
  }
  out.alignment = alignment;
  for (ParamBlockSpec& spec : specs) {
    ParamBlockLayout l;
    l.name = spec.name.empty() ? "block " + std::to_string(out.blocks.size()) : std::move(spec.name);
    l.entry_bytes = std::move(spec.entry_bytes);
    for (std::size_t n : l.entry_bytes) {
      l.offsets.push_back(l.bytes);
      l.bytes += (n + alignment - 1) / alignment * alignment;
    }
    out.largest = std::max(out.largest, l.bytes);
    out.blocks.push_back(std::move(l));
  }
  out.budget = options.budget_bytes != 0 ? options.budget_bytes : out.largest * (options.prefetch + 2);
  out.budget = out.budget / kDeviceAlignment * kDeviceAlignment;
  for (const ParamBlockLayout& l : out.blocks) {
    if (l.bytes > out.budget) {
      return invalid_argument("parameter tier: block '" + l.name + "' needs " + std::to_string(l.bytes) +
                              " bytes on the device, more than the pool's budget of " + std::to_string(out.budget) +
                              " bytes; raise budget_bytes to at least " + std::to_string(l.bytes) +
                              " (better: a few times it, so that blocks can be prefetched)");
    }
  }
  return out;
}

bool reads_into_pool(const Device& device, const ParamTierLayout& layout, const ParamTierOptions& options) {
  // The host devices' allocations are 4 KiB-aligned at least (AlignedBuffer::allocate_for_io); create()
  // checks the pool's address itself.
  return options.home == ParamHome::nvme && device.host_memory() && layout.alignment <= 4096;
}

Result<SpaceNeed> param_tier_footprint(const Device& device, const ParamTierLayout& layout,
                                       const ParamTierOptions& options) {
  Result<SpaceNeed> need = options.home == ParamHome::nvme
                               ? nvme_param_home_footprint(layout.blocks, options, layout.alignment)
                               : Result<SpaceNeed>(ram_param_home_footprint(layout.blocks));
  if (!need.ok()) return need;
  // Where device memory is host memory (the CPU as the device), the pool is RAM too.
  if (device.host_memory()) need->add_ram("device pool", AlignedBuffer::io_size(layout.budget));
  if (options.home == ParamHome::nvme && !reads_into_pool(device, layout, options)) {
    need->add_ram("pinned bounce buffers",
                  kParamBounces * AlignedBuffer::io_size(std::max(layout.largest, layout.alignment)));
  }
  return need;
}

Status check_param_tier_space(const Device& device, const ParamTierLayout& layout, const ParamTierOptions& options) {
  Result<SpaceNeed> need = param_tier_footprint(device, layout, options);
  if (!need.ok()) return need.status();
  std::uint64_t bytes = 0;
  for (const ParamBlockLayout& b : layout.blocks) {
    for (std::size_t n : b.entry_bytes) bytes += n;
  }
  const bool nvme = options.home == ParamHome::nvme;
  // `zoe plan` places parameter offload at stage 3; it counts 16-bit weights, 2 bytes per parameter.
  const std::string plan = "zoe plan --params " + plan_count(bytes / 2) + " --stage 3 --offload-param " +
                           (nvme ? "nvme" : "cpu") + " --prefetch " + std::to_string(options.prefetch) +
                           (nvme ? plan_nvme_paths(options.nvme_paths) : std::string());
  const std::string what = "the parameter tier (" + std::to_string(layout.blocks.size()) + " blocks, " +
                           std::to_string(bytes) + " bytes of weights, home " + std::string(param_home_name(options.home)) +
                           ")";
  return check_space(need.value(), what, plan);
}

}  // namespace zoe
