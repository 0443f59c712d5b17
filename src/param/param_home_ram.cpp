// The parameter tier's RAM home (param_home.h): every block's entries in one pinned host allocation, which
// the device copies from asynchronously; and the names and descriptions shared by both homes (the NVMe one
// is in param_home_nvme.cpp, or refused below in a build without libaio).
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "src/param/param_home.h"
#include "zoe/aligned_buffer.h"
#include "zoe/param_tier.h"

namespace zoe {

std::string_view param_home_name(ParamHome home) { return home == ParamHome::nvme ? "nvme" : "cpu"; }

Result<ParamHome> parse_param_home(std::string_view name) {
  if (name == "cpu" || name == "ram") return ParamHome::ram;
  if (name == "nvme") return ParamHome::nvme;
  return invalid_argument("parameter tier device '" + std::string(name) + "' is unknown: cpu or nvme");
}

std::string describe_entry(const ParamBlockLayout& block, std::size_t b, std::size_t entry) {
  return "block '" + block.name + "' (" + std::to_string(b) + ") entry " + std::to_string(entry);
}

namespace {

class RamParamHome final : public ParamHomeStore {
 public:
  RamParamHome(Device& device, const std::vector<ParamBlockLayout>& blocks) : device_(device), blocks_(blocks) {}
  ~RamParamHome() override {
    if (memory_ != nullptr) device_.free_host(memory_);
  }
  Status allocate() {
    std::size_t total = 0;
    for (const ParamBlockLayout& b : blocks_) {
      starts_.push_back(total);
      total += b.bytes;
    }
    if (total == 0) return Status::success();
    Result<void*> m = device_.allocate_host(total);
    if (!m.ok()) return m.status();
    memory_ = static_cast<unsigned char*>(m.value());
    return Status::success();
  }
  Status write(std::size_t block, std::size_t entry, const void* src, std::size_t offset, std::size_t bytes) override {
    std::memcpy(at(block, entry) + offset, src, bytes);
    return Status::success();
  }
  Status read(std::size_t block, std::size_t entry, void* dst, std::size_t offset, std::size_t bytes) override {
    std::memcpy(dst, at(block, entry) + offset, bytes);
    return Status::success();
  }
  std::size_t entry_bytes(std::size_t block, std::size_t entry) const override {
    return blocks_[block].entry_bytes[entry];
  }
  const void* block_memory(std::size_t block) override { return memory_ + starts_[block]; }
  Status read_block(std::size_t block, void* dst) override {
    std::memcpy(dst, memory_ + starts_[block], blocks_[block].bytes);
    return Status::success();
  }

 private:
  unsigned char* at(std::size_t block, std::size_t entry) { return memory_ + starts_[block] + blocks_[block].offsets[entry]; }
  Device& device_;
  std::vector<ParamBlockLayout> blocks_;
  std::vector<std::size_t> starts_;
  unsigned char* memory_ = nullptr;  // pinned: the device copies from it asynchronously
};

}  // namespace

// RamParamHome::allocate's one pinned allocation (device.allocate_host: the host devices' allocate_for_io).
SpaceNeed ram_param_home_footprint(const std::vector<ParamBlockLayout>& blocks) {
  std::size_t total = 0;
  for (const ParamBlockLayout& b : blocks) total += b.bytes;
  SpaceNeed need;
  if (total > 0) need.add_ram("pinned home of the weights", AlignedBuffer::io_size(total));
  return need;
}

Result<std::unique_ptr<ParamHomeStore>> make_ram_param_home(Device& device, const std::vector<ParamBlockLayout>& blocks) {
  auto home = std::make_unique<RamParamHome>(device, blocks);
  if (Status s = home->allocate(); !s.ok()) return s;
  return std::unique_ptr<ParamHomeStore>(std::move(home));
}

#ifndef ZOE_HAVE_AIO
Result<SpaceNeed> nvme_param_home_footprint(const std::vector<ParamBlockLayout>&, const ParamTierOptions&, std::size_t) {
  return Status(StatusCode::unsupported, "parameter tier nvme: this build of zoe has no libaio NVMe tier");
}
Result<std::unique_ptr<ParamHomeStore>> make_nvme_param_home(const std::vector<ParamBlockLayout>&,
                                                             const ParamTierOptions&, std::size_t) {
  return Status(StatusCode::unsupported, "parameter tier nvme: this build of zoe has no libaio NVMe tier");
}
#endif

}  // namespace zoe
