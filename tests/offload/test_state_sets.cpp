// The overlap schedule on tier ram steps speculatively into a second state set and keeps a step by making
// that set current (docs/architecture.md, "What issue 52 moved"). Steps kept one after another leave the
// parameters' state in either set: what reads the state as a whole (read_state, save, moments_of) finds each
// parameter's in its own, and a checkpoint taken then resumes bit for bit as sync — for every moment dtype,
// staged and in place (the CPU as the device), 16-bit and fp32 weights.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tests/offload/trainer.h"
#include "zoe/offload.h"

namespace zoe {
namespace {

using namespace test;  // NOLINT: the trainer, its results and gradient makers

const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1};

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "zoe_state_sets_" + name + "_" + std::to_string(::getpid()) + ".ckpt";
}

// No clipping, no loss scaling: every speculative step is kept, so each step switches every parameter's set.
TEST(StateSets, CheckpointAfterKeptStepsResumesAsSync) {
  const GradFn grads = random_grads(1e-2);
  for (DType state : {DType::f32, DType::bf16, DType::i8}) {
    for (DType weights : {DType::bf16, DType::f32}) {
      for (bool cpu : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(state)) + " moments, " + std::string(dtype_name(weights)) + " weights" +
                     (cpu ? ", cpu" : ", stand-in"));
        OffloadOptions o;
        o.state_dtype = state;
        Trainer whole(Schedule::sync, weights, o, 0, kSizes, nullptr, 0, cpu);
        whole.run(1, 10, grads);
        const std::string path = temp_path(std::string(dtype_name(state)) + "_" + std::string(dtype_name(weights)));
        {
          Trainer first(Schedule::overlap, weights, o, 0, kSizes, nullptr, 0, cpu);
          first.run(1, 5, grads);  // five switches: every parameter's state is in the second set
          const RunResult r = first.result();
          EXPECT_EQ(r.stats.redone, 0) << "a speculation was redone: the test does not keep its steps";
          const Status saved = first.opt().save(path);
          ASSERT_TRUE(saved.ok()) << saved.to_string();
        }
        Trainer second(Schedule::overlap, weights, o, 0, kSizes, nullptr, 0, cpu);
        const Status loaded = second.opt().load(path);
        ASSERT_TRUE(loaded.ok()) << loaded.to_string();
        second.run(6, 10, grads);
        const RunResult a = whole.result(), b = second.result();  // (b's loss scales: iterations 6-10 only)
        ASSERT_EQ(a.state.size(), b.state.size());
        EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0) << "master/moments differ";
        EXPECT_EQ(a.device_weights, b.device_weights);
        EXPECT_EQ(a.steps, b.steps);
        std::remove(path.c_str());
      }
    }
  }
}

// moments_of (opt.state[p]'s views) gives the parameter's current set: after a kept step the other array,
// equal to what read_state reads, while the address taken before the step still shows the state before it.
TEST(StateSets, MomentsOfFollowsTheCurrentSet) {
  Trainer t(Schedule::overlap, DType::bf16, {}, 0, kSizes);
  const GradFn grads = random_grads(1e-2);
  t.run(1, 1, grads);
  ASSERT_TRUE(t.opt().wait().ok());
  const std::size_t n = kSizes[0];
  const float* before = t.opt().moments_of(0, 1);
  ASSERT_NE(before, nullptr);
  std::vector<float> m1(n);
  ASSERT_TRUE(t.opt().read_state(0, nullptr, m1.data(), nullptr).ok());
  EXPECT_EQ(std::memcmp(before, m1.data(), n * 4), 0);
  t.run(2, 2, grads);
  ASSERT_TRUE(t.opt().wait().ok());
  const float* after = t.opt().moments_of(0, 1);
  EXPECT_NE(after, before) << "the kept step did not switch sets";
  std::vector<float> m2(n);
  ASSERT_TRUE(t.opt().read_state(0, nullptr, m2.data(), nullptr).ok());
  EXPECT_EQ(std::memcmp(after, m2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(before, m1.data(), n * 4), 0) << "the set read by the step was written";
  EXPECT_NE(m1, m2);
  EXPECT_EQ(t.result().stats.redone, 0);
}

// A write through a view of the current set (what writing into opt.state[p] does) is what the next
// speculative step reads: the run equals sync with the same write through write_state.
TEST(StateSets, AWriteIntoTheCurrentSetIsStepped) {
  const GradFn grads = random_grads(1e-2);
  auto halve_m = [](OffloadOptimizer& opt) {
    float* m = opt.moments_of(2, 1);
    ASSERT_NE(m, nullptr);
    for (std::size_t k = 0; k < kSizes[2]; ++k) m[k] *= 0.5f;
  };
  Trainer sync(Schedule::sync, DType::bf16, {}, 0, kSizes), overlap(Schedule::overlap, DType::bf16, {}, 0, kSizes);
  for (Trainer* t : {&sync, &overlap}) {
    t->run(1, 3, grads);
    ASSERT_TRUE(t->opt().wait().ok());
    halve_m(t->opt());
    t->run(4, 6, grads);
  }
  expect_bitwise_equal(sync.result(), overlap.result());
}

}  // namespace
}  // namespace zoe
