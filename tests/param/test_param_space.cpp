// The parameter tier's room and files (issue 51): the footprint it checks before allocating is what it takes
// (RAM on the host devices, the files under each path); a tier that does not fit what is free (the test
// hook) is refused with both figures and a `zoe plan` command, having created nothing; a crashed run's file
// it replaces counts as free; remove_files() takes the names at once and leaves a later tier of the same name
// alone; keep_files keeps the file.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tests/param/param_test_device.h"
#include "zoe/aligned_buffer.h"
#include "zoe/param_tier.h"
#include "zoe/space.h"
#ifdef ZOE_HAVE_AIO
#include "tests/aio/aio_test_util.h"
#endif

namespace zoe {
namespace {

namespace fs = std::filesystem;

class ParamSpace : public OnTestDevice {
 protected:
  void TearDown() override { set_free_space_override(std::nullopt); }
};

std::vector<ParamBlockSpec> blocks(std::size_t layers) {
  std::vector<ParamBlockSpec> out;
  for (std::size_t b = 0; b < layers; ++b) out.push_back({"layer." + std::to_string(b), {70000 + 2 * b, 130, 6}});
  return out;
}

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 131 + seed);
  return v;
}

Status write_all(ParamTier& tier, const std::vector<ParamBlockSpec>& specs) {
  std::vector<ParamBlockWrite> writes;
  std::vector<std::vector<std::vector<unsigned char>>> data(specs.size());
  for (std::size_t b = 0; b < specs.size(); ++b) {
    ParamBlockWrite w{b, {}};
    for (std::size_t e = 0; e < specs[b].entry_bytes.size(); ++e) {
      data[b].push_back(pattern(specs[b].entry_bytes[e], static_cast<unsigned>(b + e)));
      w.src.push_back(data[b].back().data());
    }
    writes.push_back(std::move(w));
  }
  return tier.write_blocks(writes);  // the NVMe home's block bounces are allocated here: counted too
}

std::size_t files_in(const std::string& d) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(d)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

// What the tier takes, through AlignedBuffer (the host devices' memory; on CUDA the pinned memory is the
// driver's, so only the figures are compared there): its footprint, plus on the host stand-in its pool,
// which is the stand-in's device memory although the process's RAM.
void expect_footprint_is_taken(Device& device, const std::vector<ParamBlockSpec>& specs, const ParamTierOptions& o) {
  Result<SpaceNeed> need = ParamTier::footprint(device, specs, o);
  ASSERT_TRUE(need.ok()) << need.status().to_string();
  const std::size_t before = AlignedBuffer::live_bytes();
  AlignedBuffer::reset_peak();
  {
    Result<ParamTier> tier = ParamTier::create(device, specs, o);
    ASSERT_TRUE(tier.ok()) << tier.status().to_string();
    ASSERT_TRUE(write_all(tier.value(), specs).ok());
    for (std::size_t b = 0; b < specs.size(); ++b) {
      ASSERT_TRUE(tier->fetch(b).ok());
      ASSERT_TRUE(tier->release(b).ok());
    }
    ASSERT_TRUE(tier->synchronize().ok());
    const std::size_t taken = AlignedBuffer::peak_bytes() - before;
    const std::size_t pool = device.host_memory() ? 0 : AlignedBuffer::io_size(tier->stats().budget_bytes);
    if (!test_device_is_cuda()) {
      EXPECT_EQ(need->ram + pool, taken) << "footprint " << need->ram;
    }
    for (const SpaceNeed::Disk& d : need->disk) {
      const fs::path file = fs::path(d.dir) / (o.name + ".zoe-params");
      EXPECT_EQ(fs::file_size(file), d.bytes) << file;
    }
  }
}

TEST_F(ParamSpace, RamHomeFootprintIsWhatItTakes) {
  std::unique_ptr<Device> device = make_test_device();
  ParamTierOptions o;
  expect_footprint_is_taken(*device, blocks(6), o);
  o.budget_bytes = 3 << 20;
  expect_footprint_is_taken(*device, blocks(6), o);
}

TEST_F(ParamSpace, RamHomeThatRamCannotHoldIsRefused) {
  std::unique_ptr<Device> device = make_test_device();
  set_free_space_override(FreeSpaceOverride{100000, std::nullopt});
  AlignedBuffer::reset_peak();
  const std::size_t before = AlignedBuffer::live_bytes();
  Result<ParamTier> tier = ParamTier::create(*device, blocks(6), ParamTierOptions{});
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(AlignedBuffer::peak_bytes(), before) << "something was allocated before the refusal";
  EXPECT_EQ(tier.status().code(), StatusCode::out_of_memory);
  const std::string m = tier.status().message();
  EXPECT_NE(m.find("the parameter tier (6 blocks, "), std::string::npos) << m;
  EXPECT_NE(m.find("of host RAM (pinned home of the weights "), std::string::npos) << m;
  EXPECT_NE(m.find("and 97.7 KiB (100000 bytes) are free (set by a test)"), std::string::npos) << m;
  EXPECT_NE(m.find("zoe plan --params 210423 --stage 3 --offload-param cpu --prefetch 2"), std::string::npos) << m;
}

#ifdef ZOE_HAVE_AIO
using testing::TempDir;

TEST_F(ParamSpace, NvmeHomeFootprintIsWhatItTakes) {
  std::unique_ptr<Device> device = make_test_device();
  TempDir dir("zoe-param-space");
  expect_footprint_is_taken(*device, blocks(7), nvme_home({dir.sub("a"), dir.sub("b")}));
}

TEST_F(ParamSpace, NvmeHomeThatTheDiskCannotHoldIsRefusedCreatingNothing) {
  std::unique_ptr<Device> device = make_test_device();
  TempDir dir("zoe-param-space");
  const ParamTierOptions o = nvme_home({dir.sub("a"), dir.sub("b")});
  set_free_space_override(FreeSpaceOverride{std::nullopt, 8192});
  Result<ParamTier> tier = ParamTier::create(*device, blocks(7), o);
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), StatusCode::io_error);
  EXPECT_EQ(tier.status().sys_errno(), ENOSPC);
  const std::string m = tier.status().message();
  EXPECT_NE(m.find("of disk for its files under " + dir.path() + "/a, " + dir.path() + "/b, and "), std::string::npos) << m;
  EXPECT_NE(m.find("8.0 KiB (8192 bytes) are free on that filesystem: refused before creating any file"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("--offload-param nvme --prefetch 2 --nvme '" + dir.path() + "/a' '" + dir.path() + "/b'"),
            std::string::npos)
      << m;
  EXPECT_EQ(files_in(dir.path() + "/a") + files_in(dir.path() + "/b"), 0u);
  // Exactly the room it needs is enough.
  Result<SpaceNeed> need = ParamTier::footprint(*device, blocks(7), o);
  ASSERT_TRUE(need.ok());
  set_free_space_override(FreeSpaceOverride{need->ram, need->disk[0].bytes + need->disk[1].bytes});
  EXPECT_TRUE(ParamTier::create(*device, blocks(7), o).ok());
  set_free_space_override(FreeSpaceOverride{need->ram - 1, std::nullopt});
  EXPECT_EQ(ParamTier::create(*device, blocks(7), o).status().code(), StatusCode::out_of_memory);
}

// A crashed run's file, which create() replaces: its room counts as free.
TEST_F(ParamSpace, AFileItReplacesCountsAsFree) {
  std::unique_ptr<Device> device = make_test_device();
  TempDir dir("zoe-param-space");
  const ParamTierOptions o = nvme_home({dir.path()});
  Result<SpaceNeed> need = ParamTier::footprint(*device, blocks(3), o);
  ASSERT_TRUE(need.ok());
  const std::string left = dir.path() + "/zoe-params.zoe-params";
  const int fd = ::open(left.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(need->disk[0].bytes)), 0);
  ::close(fd);
  set_free_space_override(FreeSpaceOverride{std::nullopt, 0});
  Result<ParamTier> tier = ParamTier::create(*device, blocks(3), o);
  EXPECT_TRUE(tier.ok()) << tier.status().to_string();
}

// remove_files(): the file and its lock go at once; the tier reads and writes on; its end then leaves a
// later tier of the same name (possible once the names are gone) its own file.
TEST_F(ParamSpace, RemoveFilesTakesTheNamesNowAndNothingLater) {
  std::unique_ptr<Device> device = make_test_device();
  TempDir dir("zoe-param-space");
  const ParamTierOptions o = nvme_home({dir.path()});
  const std::vector<ParamBlockSpec> specs = blocks(3);
  Result<ParamTier> first = ParamTier::create(*device, specs, o);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(write_all(first.value(), specs).ok());
  EXPECT_EQ(files_in(dir.path()), 2u);  // the file and its owner lock
  ASSERT_TRUE(first->remove_files().ok());
  EXPECT_EQ(files_in(dir.path()), 0u);
  std::vector<unsigned char> back(specs[1].entry_bytes[0]);
  ASSERT_TRUE(first->read(1, 0, back.data(), 0, back.size()).ok());
  EXPECT_EQ(back, pattern(back.size(), 1));
  const std::vector<unsigned char> other = pattern(back.size(), 99);
  ASSERT_TRUE(first->write(1, 0, other.data(), 0, other.size()).ok());
  ASSERT_TRUE(first->read(1, 0, back.data(), 0, back.size()).ok());
  EXPECT_EQ(back, other);
  Result<ParamTier> second = ParamTier::create(*device, specs, o);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  first = Status(StatusCode::internal, "destroyed");
  EXPECT_EQ(files_in(dir.path()), 2u) << "the first tier's end took the second's files";
  second = Status(StatusCode::internal, "destroyed");
  EXPECT_EQ(files_in(dir.path()), 0u);
}

TEST_F(ParamSpace, KeepFilesKeepsTheFile) {
  std::unique_ptr<Device> device = make_test_device();
  TempDir dir("zoe-param-space");
  ParamTierOptions o = nvme_home({dir.path()});
  o.keep_files = true;
  const std::vector<ParamBlockSpec> specs = blocks(3);
  Result<ParamTier> tier = ParamTier::create(*device, specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(write_all(tier.value(), specs).ok());
  tier = Status(StatusCode::internal, "destroyed");
  EXPECT_TRUE(fs::exists(dir.path() + "/zoe-params.zoe-params"));
  EXPECT_EQ(files_in(dir.path()), 1u);  // its owner lock went
}
#endif

}  // namespace
}  // namespace zoe
