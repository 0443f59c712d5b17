// Room before allocation (zoe/space.h) for OffloadOptimizer: the footprint it checks is what its allocations
// take, for every tier, schedule, state dtype, accumulation and parameter dtype; one that does not fit the
// free RAM or disk (set by the test hook) is refused with both figures and a `zoe plan` command that runs,
// having allocated and created nothing; one that fits exactly is not refused; files it replaces count as free.
#include <gtest/gtest.h>

#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "src/offload/footprint.h"
#include "tests/offload/trainer.h"
#include "tests/tools/cli_runner.h"
#include "zoe/aligned_buffer.h"
#include "zoe/space.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

// The free figures of the machine again after each test, whatever it set.
class Space : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("zoe_space_" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "a");
    fs::create_directories(dir_ / "b");
  }
  void TearDown() override {
    set_free_space_override(std::nullopt);
    fs::remove_all(dir_);
  }
  OffloadOptions nvme(OffloadOptions o) const {
    o.tier = Tier::nvme;
    o.nvme.paths = {(dir_ / "a").string(), (dir_ / "b").string()};
    o.nvme.buffer_count = 3;
    return o;
  }
  std::size_t files_in(const fs::path& d) const {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(d)) n += e.is_regular_file() ? 1 : 0;
    return n;
  }
  fs::path dir_;
};

OffloadOptions small(OffloadOptions o) {
  o.cpu.threads = 2;
  o.tile = 4096;
  return o;
}

struct Case {
  Tier tier;
  Schedule schedule;
  DType state;
  int accumulation;
  DType weights;
  bool cpu;  // the CPU itself as the device (in place), else the host stand-in (staged)
  OptimizerHyper hyper{};  // the groups' rule: AdamW, or Lion's one state array, or AMSGrad's three
};

std::string label(const Case& c) {
  return test::cat(tier_name(c.tier), " ", schedule_name(c.schedule), " ", state_dtype_name(c.state), " k=",
                   std::to_string(c.accumulation), " ", dtype_name(c.weights), c.cpu ? " cpu " : " stand-in ",
                   optimizer_rule(c.hyper.rule).name, c.hyper.amsgrad ? " amsgrad" : "");
}

// The optimizer created, stepped twice (what a schedule allocates at its first step counts too), against the
// footprint: every AlignedBuffer the library allocates is counted (aligned_buffer.h), which the host devices'
// allocate_host uses too.
TEST_F(Space, FootprintIsWhatTheAllocationsTake) {
  std::vector<Case> cases;
#ifdef ZOE_HAVE_AIO
  const std::vector<Tier> tiers = {Tier::ram, Tier::nvme};
#else
  const std::vector<Tier> tiers = {Tier::ram};
#endif
  for (Tier tier : tiers) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      for (DType state : {DType::f32, DType::i8}) {
        for (bool cpu : {false, true}) cases.push_back({tier, schedule, state, 1, DType::bf16, cpu});
      }
      cases.push_back({tier, schedule, DType::bf16, 2, DType::bf16, false});
      cases.push_back({tier, schedule, DType::f32, 1, DType::f32, false});
      cases.push_back({tier, schedule, DType::f32, 1, DType::f32, true});
      OptimizerHyper amsgrad;
      amsgrad.amsgrad = true;
      for (const OptimizerHyper& h : {hyper_defaults(Rule::lion), amsgrad}) {
        cases.push_back({tier, schedule, DType::bf16, 1, DType::bf16, false, h});
      }
      cases.push_back({tier, schedule, DType::i8, 1, DType::bf16, false, hyper_defaults(Rule::lion)});
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(label(c));
    std::unique_ptr<Device> device = c.cpu ? make_cpu_device() : make_host_device();
    test::DeviceParams model(*device, c.weights, {100000, 37, 70001, 1}, 7);
    for (const ParamSpec& p : model.specs) {  // the host devices' memory is the process's
      for (std::size_t k = 0; k < p.n; ++k) model.set(const_cast<void*>(p.device_grads), k, 1e-3f * static_cast<float>(k % 7));
    }
    OffloadOptions o = small(c.tier == Tier::nvme ? nvme({}) : OffloadOptions{});
    o.schedule = c.schedule;
    o.state_dtype = c.state;
    o.gradient_accumulation_steps = c.accumulation;
    o.delayed_warmup_steps = 0;
    Result<SpaceNeed> need = optimizer_footprint(*device, model.specs, o, "zoe-optimizer", c.hyper);
    ASSERT_TRUE(need.ok()) << need.status().to_string();
    const std::size_t before = AlignedBuffer::live_bytes();
    AlignedBuffer::reset_peak();
    {
      Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{c.hyper}}, model.specs, o);
      ASSERT_TRUE(made.ok()) << made.status().to_string();
      for (int t = 0; t < 2; ++t) {
        for (int k = 0; k < c.accumulation; ++k) {
          for (std::size_t i = model.specs.size(); i-- > 0;) ASSERT_TRUE(made->grad_ready(i).ok());
        }
        const Status s = made->step();
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
      ASSERT_TRUE(made->wait().ok());
    }
    const std::size_t taken = AlignedBuffer::peak_bytes() - before;
    // In place, an f32 parameter's part of tier ram's master is allocated and never touched: not counted.
    std::size_t untouched = 0;
    if (c.tier == Tier::ram && c.weights == DType::f32 && steps_in_place(*device, model.specs, o)) {
      untouched = AlignedBuffer::size_for((100000 + 37 + 70001 + 1) * 4);
    }
    EXPECT_EQ(need->ram + untouched, taken) << "footprint " << need->ram << ", allocated at most " << taken;
    // And each path's files are as large as counted.
    if (c.tier == Tier::nvme) {
      for (const SpaceNeed::Disk& d : need->disk) {
        std::uintmax_t on_disk = 0;
        for (const auto& e : fs::directory_iterator(d.dir)) {
          const std::string name = e.path().filename().string();
          if (name.ends_with(".zoe-swap") || name.ends_with(".zoe-swap.table")) on_disk += e.file_size();
        }
        EXPECT_EQ(d.bytes, on_disk) << d.dir;
      }
    }
  }
}

// RAM that is not free: refused before anything is allocated, naming both figures and a plan that runs.
TEST_F(Space, RefusesWhatRamCannotHold) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {100000, 37}, 7);
  OffloadOptions o = small({});
  o.state_dtype = DType::i8;
  o.gradient_accumulation_steps = 4;
  set_free_space_override(FreeSpaceOverride{123456, std::nullopt});
  AlignedBuffer::reset_peak();
  const std::size_t before = AlignedBuffer::live_bytes();
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(AlignedBuffer::peak_bytes(), before) << "something was allocated before the refusal";
  const Status& s = made.status();
  EXPECT_EQ(s.code(), StatusCode::out_of_memory);
  const std::string m = s.message();
  EXPECT_NE(m.find("the optimizer (100037 parameters, tier ram"), std::string::npos) << m;
  EXPECT_NE(m.find("of host RAM (fp32 master weights"), std::string::npos) << m;
  EXPECT_NE(m.find("and 120.6 KiB (123456 bytes) are free (set by a test)"), std::string::npos) << m;
  const std::size_t at = m.find("zoe plan --params 100037 --offload-optimizer cpu --state-dtype int8 --grad-accum 4");
  ASSERT_NE(at, std::string::npos) << m;
  // The command runs (the measurement it would make given, to keep the test short).
  std::vector<std::string> args;
  std::istringstream words(m.substr(at + 4));
  for (std::string w; words >> w;) args.push_back(w);
  args.insert(args.end(), {"--adam-rate", "1B"});
  const test::Ran plan = test::run_zoe(args, 120);
  EXPECT_TRUE(!plan.signaled && plan.code == 0) << plan.how() << "\n" << plan.output;
}

#ifdef ZOE_HAVE_AIO
// A path's filesystem without room: refused before any file (not even the owner lock) is created.
TEST_F(Space, RefusesWhatTheDiskCannotHold) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {100000, 37}, 7);
  const OffloadOptions o = small(nvme({}));
  set_free_space_override(FreeSpaceOverride{std::nullopt, 4096});
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  ASSERT_FALSE(made.ok());
  const Status& s = made.status();
  EXPECT_EQ(s.code(), StatusCode::io_error);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  const std::string m = s.message();
  EXPECT_NE(m.find(" of disk for its files under " + (dir_ / "a").string()), std::string::npos) << m;
  EXPECT_NE(m.find("and 4.0 KiB (4096 bytes) are free on that filesystem"), std::string::npos) << m;
  EXPECT_NE(m.find("refused before creating any file"), std::string::npos) << m;
  EXPECT_NE(m.find("zoe plan --params 100037 --offload-optimizer nvme --state-dtype fp32 --nvme '" + (dir_ / "a").string() +
                   "' '" + (dir_ / "b").string() + "'"),
            std::string::npos)
      << m;
  EXPECT_EQ(files_in(dir_ / "a"), 0u);
  EXPECT_EQ(files_in(dir_ / "b"), 0u);
}

// Refused only when the need is more than what is free: exactly the footprint fits.
TEST_F(Space, ExactlyEnoughFits) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {100000, 37}, 7);
  const OffloadOptions o = small(nvme({}));
  Result<SpaceNeed> need = optimizer_footprint(*device, model.specs, o, "zoe-optimizer", OptimizerHyper{});
  ASSERT_TRUE(need.ok());
  std::uint64_t disk = 0;  // both paths are on one filesystem, which they share
  for (const SpaceNeed::Disk& d : need->disk) disk += d.bytes;
  set_free_space_override(FreeSpaceOverride{need->ram - 1, disk});
  EXPECT_EQ(OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o).status().code(), StatusCode::out_of_memory);
  set_free_space_override(FreeSpaceOverride{need->ram, disk - 1});
  EXPECT_EQ(OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o).status().code(), StatusCode::io_error);
  set_free_space_override(FreeSpaceOverride{need->ram, disk});
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  EXPECT_TRUE(made.ok()) << made.status().to_string();
}

// The swap files an earlier optimizer left (kept, docs/nvme.md) are replaced: their room counts as free.
TEST_F(Space, FilesItReplacesCountAsFree) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {100000, 37}, 7);
  const OffloadOptions o = small(nvme({}));
  {
    Result<OffloadOptimizer> first = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
    ASSERT_TRUE(first.ok()) << first.status().to_string();
  }
  ASSERT_GT(files_in(dir_ / "a"), 0u);
  set_free_space_override(FreeSpaceOverride{std::nullopt, 0});
  Result<OffloadOptimizer> again = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

#endif

// The machine's own figures: RAM within what it has, the disk's as statvfs says.
TEST_F(Space, MachineFigures) {
  const FreeRam ram = free_ram();
  EXPECT_GT(ram.bytes, 0u);
  EXPECT_LE(ram.bytes, static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE));
  EXPECT_FALSE(ram.source.empty());
  Result<std::uint64_t> disk = free_disk(dir_.string());
  ASSERT_TRUE(disk.ok());
  struct statvfs v{};
  ASSERT_EQ(::statvfs(dir_.c_str(), &v), 0);
  const std::uint64_t now = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
  EXPECT_LE(disk.value() > now ? disk.value() - now : now - disk.value(), std::uint64_t(64) << 20);
  EXPECT_FALSE(free_disk((dir_ / "missing").string()).ok());
}

TEST(PlanArguments, CountsAndPaths) {
  EXPECT_EQ(plan_count(1800000000), "1.80B");
  EXPECT_EQ(plan_count(350000000), "350.00M");
  EXPECT_EQ(plan_count(12345), "12345");
  EXPECT_EQ(plan_count(0), "1");
  EXPECT_EQ(plan_nvme_paths({}), "");
  EXPECT_EQ(plan_nvme_paths({"/a b", "/it's"}), " --nvme '/a b' '/it'\\''s'");
}

}  // namespace
}  // namespace zoe
