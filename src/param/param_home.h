// Where a parameter tier's blocks live between uses (zoe/param_tier.h): pinned host RAM (param_home_ram.cpp) or
// an NVMe file (param_home_nvme.cpp). A block is kept in the layout it has on the device — its entries
// at `offsets`, each aligned — so that bringing it to the device is one copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zoe/device.h"
#include "zoe/param_tier.h"
#include "zoe/status.h"

namespace zoe {

struct ParamBlockLayout {
  std::string name;
  std::vector<std::size_t> entry_bytes;
  std::vector<std::size_t> offsets;  // of each entry from the block's start, multiples of the layout's alignment
  std::size_t bytes = 0;             // the block, rounded up to the alignment
};

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
  virtual bool direct_io() const { return false; }
};

Result<std::unique_ptr<ParamHomeStore>> make_ram_param_home(Device& device, const std::vector<ParamBlockLayout>& blocks);
// Refuses (unsupported) in a build without libaio.
Result<std::unique_ptr<ParamHomeStore>> make_nvme_param_home(const std::vector<ParamBlockLayout>& blocks,
                                                             const ParamTierOptions& options, std::size_t alignment);

}  // namespace zoe
