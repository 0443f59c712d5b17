// Tier nvme's streamed step (sync schedule; src/offload/step_windows.h): the store is stepped window by
// window with no staging the size of the model. Windows far smaller than the model — parameters that
// straddle windows, windows that end inside a tile's parameter, i8 blocks — must give tier ram's bits, on a
// device with memory of its own (each window's gradients copied down) and on the CPU (read in place); and
// what needs the weights outside a step (a checkpoint, load, write_state) must see the weights the step sent.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/offload/trainer.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

using test::cat;

// Sizes that put parameter boundaries inside tiles (the store's tile is 1024 elements here) and one
// parameter larger than two tiles, so that the window holds it whole and others straddle.
const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1, 3001, 2500, 700};

class StreamedStep : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / cat("zoe_streamed_", std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Tier nvme with the smallest window the sizes allow: the largest parameter and two tiles.
  OffloadOptions nvme(OffloadOptions o) const {
    o.tier = Tier::nvme;
    o.nvme.paths = {dir_.string()};
    o.nvme.buffer_count = 3;
    o.step_window = 1;
    return o;
  }

  fs::path dir_;
};

TEST_F(StreamedStep, SmallWindowsEqualRamBitwise) {
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
          test::Trainer disk(Schedule::sync, weights, nvme(o), 0, kSizes, nullptr, 0, cpu);
          ASSERT_TRUE(disk.created());
          disk.run(1, 4, grads);
          const test::RunResult a = ram.result(), b = disk.result();
          test::expect_bitwise_equal(a, b);
          std::size_t elements = 0;
          for (std::size_t n : kSizes) elements += n;
          // Each gradient comes down once, into its window; nothing on the CPU, where they are read in place.
          EXPECT_EQ(b.stats.d2h_bytes, cpu ? 0u : 4u * elements * 2);
        }
      }
    }
  }
}

// A checkpoint of a streamed optimizer holds the weights the step sent (its "weights16" from the masters),
// loads into a tier ram optimizer and back, and the runs go on as the uninterrupted one.
TEST_F(StreamedStep, CheckpointsCarryTheSentWeights) {
  const test::GradFn grads = test::random_grads(1e-2);
  OffloadOptions o;
  o.state_dtype = DType::i8;
  test::Trainer whole(Schedule::sync, DType::bf16, o, 0, kSizes);
  whole.run(1, 6, grads);
  const std::string saved = (dir_ / "ckpt").string();
  test::Trainer first(Schedule::sync, DType::bf16, nvme(o), 0, kSizes);
  ASSERT_TRUE(first.created());
  first.run(1, 3, grads);
  ASSERT_TRUE(first.opt().save(saved).ok());
  // Into tier ram: its staging takes the blob's weights, which must be the ones the device holds.
  test::Trainer ram(Schedule::sync, DType::bf16, o, 0, kSizes);
  ASSERT_TRUE(ram.opt().load(saved).ok());
  EXPECT_EQ(ram.device_weights(), first.device_weights());
  // Into another streamed optimizer (its own store folder): the weights are sent from the loaded masters.
  fs::create_directories(dir_ / "second");
  OffloadOptions second_o = nvme(o);
  second_o.nvme.paths = {(dir_ / "second").string()};
  test::Trainer second(Schedule::sync, DType::bf16, second_o, 0, kSizes);
  ASSERT_TRUE(second.created());
  const Status loaded = second.opt().load(saved);
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  EXPECT_EQ(second.device_weights(), first.device_weights());
  second.run(4, 6, grads);
  const test::RunResult a = whole.result(), b = second.result();
  EXPECT_EQ(a.state, b.state);
  EXPECT_EQ(a.device_weights, b.device_weights);
  EXPECT_EQ(a.steps, b.steps);
}

// write_state() on a streamed optimizer sends the new master, rounded, to the device.
TEST_F(StreamedStep, WriteStateSendsTheRoundedMaster) {
  test::Trainer disk(Schedule::sync, DType::bf16, nvme(OffloadOptions{}), 0, kSizes);
  ASSERT_TRUE(disk.created());
  disk.run(1, 2, test::random_grads(1e-2));
  const std::size_t param = 4;  // 3001 elements, across tiles
  std::vector<float> master(kSizes[param]);
  for (std::size_t j = 0; j < master.size(); ++j) master[j] = 0.001f * static_cast<float>(j) - 1.0f;
  const Status s = disk.opt().write_state(param, master.data(), nullptr, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(disk.opt().wait().ok());
  for (std::size_t j = 0; j < master.size(); ++j) {
    ASSERT_EQ(disk.model().get(disk.model().specs[param].device_weights, j), bf16_to_float(float_to_bf16(master[j])))
        << "element " << j;
  }
}

}  // namespace
}  // namespace zoe
