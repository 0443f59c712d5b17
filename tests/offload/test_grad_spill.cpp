// Tier nvme's gradient spill (OffloadOptions::spill_grads; src/offload/grad_spill.h): each gradient goes to a
// file when it is reported and the streamed step reads it back, so the trainer may reuse the gradient's memory
// at once. The steps must be tier ram's bits whatever the trainer does with its buffers after a report; bad
// uses are refused by name, a failed write stops the step with nothing changed, and the file goes with the
// optimizer.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/offload/trainer.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

using test::cat;

// Parameter boundaries inside tiles (1024 elements here) and one parameter over two tiles, as in
// test_streamed_step.cpp: the spill's reads cross its 4096-byte boundaries at every offset.
const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1, 3001, 2500, 700};

std::size_t total_elements() {
  std::size_t n = 0;
  for (std::size_t s : kSizes) n += s;
  return n;
}

class GradSpillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / cat("zoe_spill_", std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  OffloadOptions spilled(OffloadOptions o) const {
    o.tier = Tier::nvme;
    o.nvme.paths = {dir_.string()};
    o.nvme.buffer_count = 3;
    o.step_window = 1;  // the smallest windows: the largest parameter and two tiles
    o.spill_grads = true;
    return o;
  }
  fs::path spill_file() const { return dir_ / "zoe-optimizer.grads"; }

  fs::path dir_;
};

// What the trainer writes into its gradient buffers once they are reported: the spill holds the gradients,
// so none of this may reach the step.
void scribble(test::DeviceParams& model, OffloadOptimizer&) {
  for (const ParamSpec& p : model.specs) {
    for (std::size_t j = 0; j < p.n; ++j) model.set(const_cast<void*>(p.device_grads), j, NAN);
  }
}

TEST_F(GradSpillTest, EqualsTierRamBitwiseWhateverTheBuffersHoldAfterTheReport) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (bool cpu : {false, true}) {
    for (DType weights : {DType::bf16, DType::f16}) {
      for (DType state : {DType::f32, DType::i8}) {
        for (bool clipped : {false, true}) {
          SCOPED_TRACE(cat(cpu ? "cpu device" : "device with its own memory", ", ", dtype_name(weights), " weights, ",
                           state_dtype_name(state), " moments", clipped ? ", clipped" : ""));
          OffloadOptions o;
          o.state_dtype = state;
          if (clipped) o.max_grad_norm = 0.05f;
          test::Trainer ram(Schedule::sync, weights, o, 0, kSizes, nullptr, 0, cpu);
          ram.run(1, 4, grads);
          test::Trainer disk(Schedule::sync, weights, spilled(o), 0, kSizes, nullptr, 0, cpu);
          ASSERT_TRUE(disk.created());
          EXPECT_TRUE(fs::exists(spill_file()));
          disk.run(1, 4, grads, scribble);
          const test::RunResult a = ram.result(), b = disk.result();
          test::expect_bitwise_equal(a, b);
          // Each gradient leaves the device once, at its report (nothing crosses where the CPU is the device).
          EXPECT_EQ(b.stats.d2h_bytes, cpu ? 0u : 4u * total_elements() * 2);
          EXPECT_FALSE(disk.opt().reads_grads_in_place());
        }
      }
    }
  }
  EXPECT_FALSE(fs::exists(spill_file())) << "the spill file goes with its optimizer";
}

// Reported or not: a gradient not reported before step() is spilled then, from ParamSpec::device_grads.
TEST_F(GradSpillTest, UnreportedGradientsAreTakenAtStep) {
  const test::GradFn grads = test::random_grads(1e-2);
  test::Trainer ram(Schedule::sync, DType::bf16, OffloadOptions{}, 0, kSizes);
  ram.run(1, 2, grads);
  test::Trainer disk(Schedule::sync, DType::bf16, spilled(OffloadOptions{}), 0, kSizes);
  ASSERT_TRUE(disk.created());
  for (int t = 1; t <= 2; ++t) {
    grads(disk.model(), t, 1.0f);
    ASSERT_TRUE(disk.device_synchronize().ok());
    const Status s = disk.opt().step();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  EXPECT_EQ(ram.device_weights(), disk.device_weights());
}

TEST_F(GradSpillTest, RefusedWhereTheStepIsNotStreamed) {
  for (int which = 0; which < 3; ++which) {
    OffloadOptions o = spilled(OffloadOptions{});
    if (which == 0) o.tier = Tier::ram;
    if (which == 1) o.gradient_accumulation_steps = 2;
    const Schedule schedule = which == 2 ? Schedule::overlap : Schedule::sync;
    auto device = make_host_device();
    test::DeviceParams model(*device, DType::bf16, kSizes, 1);
    Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, test::two_groups(), model.specs, [&] {
      OffloadOptions c = o;
      c.schedule = schedule;
      return c;
    }());
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), StatusCode::invalid_argument);
    EXPECT_NE(made.status().message().find("spill_grads is for tier nvme's streamed step"), std::string::npos)
        << made.status().to_string();
  }
}

// A second report of one parameter in an iteration would replace its first gradient in the file: refused,
// naming the parameter; the step then takes the first.
TEST_F(GradSpillTest, ASecondReportIsRefused) {
  const test::GradFn grads = test::random_grads(1e-2);
  test::Trainer ram(Schedule::sync, DType::bf16, OffloadOptions{}, 0, kSizes);
  ram.run(1, 1, grads);
  test::Trainer disk(Schedule::sync, DType::bf16, spilled(OffloadOptions{}), 0, kSizes);
  ASSERT_TRUE(disk.created());
  grads(disk.model(), 1, 1.0f);
  for (std::size_t b = 0; b < kSizes.size(); ++b) ASSERT_TRUE(disk.opt().grad_ready(b).ok());
  const Status again = disk.opt().grad_ready(2);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.message().find("parameter 2"), std::string::npos) << again.to_string();
  EXPECT_NE(again.message().find("reported twice"), std::string::npos) << again.to_string();
  ASSERT_TRUE(disk.opt().step().ok());
  EXPECT_EQ(ram.device_weights(), disk.device_weights());
}

// A write that fails loses a gradient the trainer may have freed: the step refuses, naming the spill file,
// and changes nothing; the iteration given up and run again gives tier ram's result.
TEST_F(GradSpillTest, AFailedWriteStopsTheStepUntilTheIterationRunsAgain) {
  const test::GradFn grads = test::random_grads(1e-2);
  test::Trainer ram(Schedule::sync, DType::bf16, OffloadOptions{}, 0, kSizes);
  ram.run(1, 2, grads);
  bool fail = false;
  OffloadOptions o = spilled(OffloadOptions{});
  o.nvme.fault_hook = [&](const IoSite& site) {
    const bool spill = site.path.find(".grads") != std::string_view::npos;
    return IoFault{fail && spill && site.op == IoOp::write ? EIO : 0, -1};
  };
  test::Trainer disk(Schedule::sync, DType::bf16, o, 0, kSizes);
  ASSERT_TRUE(disk.created());
  disk.run(1, 1, grads);
  const std::vector<float> before = disk.result().state;
  const auto weights_before = disk.device_weights();
  fail = true;
  grads(disk.model(), 2, 1.0f);
  Status reported;
  for (std::size_t b = kSizes.size(); b-- > 0 && reported.ok();) reported = disk.opt().grad_ready(b);
  Status stepped = reported.ok() ? disk.opt().step() : reported;
  ASSERT_FALSE(stepped.ok());
  if (reported.ok()) {
    EXPECT_NE(stepped.message().find(spill_file().string()), std::string::npos) << stepped.to_string();
    EXPECT_NE(stepped.message().find("nothing was stepped"), std::string::npos) << stepped.to_string();
  }
  EXPECT_EQ(disk.result().state, before);
  EXPECT_EQ(disk.device_weights(), weights_before);
  // Still refused while the iteration stands; given up, it runs again.
  fail = false;
  EXPECT_FALSE(disk.opt().step().ok());
  ASSERT_TRUE(disk.opt().abandon_iteration().ok());
  disk.run(2, 2, grads);
  EXPECT_EQ(ram.device_weights(), disk.device_weights());
  EXPECT_EQ(ram.result().state, disk.result().state);
}

// NaN/Inf in a spilled gradient: the statistics taken at its report refuse the step by name, nothing changed.
TEST_F(GradSpillTest, NonFiniteGradientsAreRefusedBeforeTheStep) {
  test::Trainer disk(Schedule::sync, DType::bf16, spilled(OffloadOptions{}), 0, kSizes);
  ASSERT_TRUE(disk.created());
  disk.run(1, 1, test::random_grads(1e-2));
  const std::vector<float> before = disk.result().state;
  const Status s = disk.iteration(2, [](test::DeviceParams& model, int t, float scale) {
    test::random_grads(1e-2)(model, t, scale);
    model.set(const_cast<void*>(model.specs[4].device_grads), 1234, INFINITY);
  });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("parameter(s) 4"), std::string::npos) << s.to_string();
  EXPECT_EQ(disk.result().state, before);
}

}  // namespace
}  // namespace zoe
