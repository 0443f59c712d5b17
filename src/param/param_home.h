// Where a parameter tier's blocks live between uses (zoe/param_tier.h): pinned host RAM (param_home_ram.cpp) or
// an NVMe file (param_home_nvme.cpp). A block is kept in the layout it has on the device — its entries
// at `offsets`, each aligned — so that bringing it to the device is one copy.
#pragma once

#include "src/private.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zoe/device.h"
#include "zoe/param_tier.h"
#include "zoe/space.h"
#include "zoe/status.h"

namespace zoe {

struct ParamBlockLayout {
  std::string name;
  std::vector<std::size_t> entry_bytes;
  std::vector<std::size_t> offsets;  // of each entry from the block's start, multiples of the layout's alignment
  std::size_t bytes = 0;             // the block, rounded up to the alignment
};

// A tier's blocks as ParamTier::create lays them out (param_layout.cpp): entries aligned (the device's 256
// bytes, or the NVMe home's O_DIRECT block), the device pool's budget, the largest block.
inline constexpr std::size_t kDeviceAlignment = 256;
inline constexpr int kParamBounces = 4;  // NVMe through bounces: two per loader thread (param_tier.cpp)
struct ParamTierLayout {
  std::vector<ParamBlockLayout> blocks;
  std::size_t alignment = 0, largest = 0, budget = 0;
};
// Checks the options against the blocks: the prefetch, the alignment, every block within the budget.
Result<ParamTierLayout> lay_out_param_tier(std::vector<ParamBlockSpec> specs, const ParamTierOptions& options);
// NVMe loads land in the pool itself (the device's memory is host memory), with no bounce.
bool reads_into_pool(const Device& device, const ParamTierLayout& layout, const ParamTierOptions& options);
// What create() holds with this layout (zoe/space.h), and the check it makes before allocating anything.
Result<SpaceNeed> param_tier_footprint(const Device& device, const ParamTierLayout& layout,
                                       const ParamTierOptions& options);
Status check_param_tier_space(const Device& device, const ParamTierLayout& layout, const ParamTierOptions& options);

// "block 'h.3.attn' (3) entry 1" — how every message names what it is about.
std::string describe_entry(const ParamBlockLayout& block, std::size_t b, std::size_t entry);

class ParamHomeStore {
 public:
  virtual ~ParamHomeStore() = default;
  // Bytes [offset, offset + bytes) of an entry, from and to host memory. A failed write leaves the entry's
  // previous contents valid.
  virtual Status write(std::size_t block, std::size_t entry, const void* src, std::size_t offset, std::size_t bytes) = 0;
  virtual Status read(std::size_t block, std::size_t entry, void* dst, std::size_t offset, std::size_t bytes) = 0;
  // Whole entries (ParamTier::write_blocks, checked there). Each entry is replaced or keeps its previous
  // contents; on failure the first error is returned.
  virtual Status write_blocks(const std::vector<ParamBlockWrite>& writes) {
    for (const ParamBlockWrite& w : writes) {
      for (std::size_t e = 0; e < w.src.size(); ++e) {
        if (w.src[e] == nullptr) continue;
        if (Status s = write(w.block, e, w.src[e], 0, entry_bytes(w.block, e)); !s.ok()) return s;
      }
    }
    return Status::success();
  }
  virtual std::size_t entry_bytes(std::size_t block, std::size_t entry) const = 0;
  // RAM: the block in device layout, in memory the device copies from. Null where the block must be read.
  virtual const void* block_memory(std::size_t block) = 0;
  // The whole block, in device layout, into `dst` (block bytes, aligned to the home's alignment), checked.
  virtual Status read_block(std::size_t block, void* dst) = 0;
  virtual void add_stats(ParamTierStats&) const {}
  virtual std::vector<std::string> files() const { return {}; }
  // ParamTier::remove_files(): the files' names go now, their room when the home is destroyed.
  virtual Status remove_files() { return Status::success(); }
  virtual bool direct_io() const { return false; }
};

Result<std::unique_ptr<ParamHomeStore>> make_ram_param_home(Device& device, const std::vector<ParamBlockLayout>& blocks);
// What each home takes (zoe/space.h), beside its allocation: the RAM home's pinned copy; the NVMe home's
// bounces in RAM and its files (two slots per entry) under each path.
SpaceNeed ram_param_home_footprint(const std::vector<ParamBlockLayout>& blocks);
Result<SpaceNeed> nvme_param_home_footprint(const std::vector<ParamBlockLayout>& blocks, const ParamTierOptions& options,
                                            std::size_t alignment);
// Refuses (unsupported) in a build without libaio.
Result<std::unique_ptr<ParamHomeStore>> make_nvme_param_home(const std::vector<ParamBlockLayout>& blocks,
                                                             const ParamTierOptions& options, std::size_t alignment);

}  // namespace zoe
