// OffloadOptimizer called from several threads at once: its calls are serialised (offload.h), so steps
// made by two threads equal the same number made by one, and a save() taken beside step() holds one whole
// step. Both tiers. The gradients are the same at every step, so the order the threads' steps take does not
// change the result: only an interleaving would.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/offload/trainer.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

// Large enough that a step takes a while (several Adam tiles and, on tier nvme, several swap tiles), so
// that unserialised calls would overlap.
const std::vector<std::size_t> kSizes = {300000, 4096, 77};

class Threads : public ::testing::TestWithParam<Tier> {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("zoe_threads_" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "swap");
  }
  void TearDown() override { fs::remove_all(dir_); }

  OffloadOptions options() const {
    OffloadOptions o;
    o.tier = GetParam();
    if (o.tier == Tier::nvme) {
      o.nvme.paths = {(dir_ / "swap").string()};
      o.nvme.buffer_count = 2;
      o.nvme.keep_resident = false;  // every step streams its tiles through the files
      o.nvme.durability = Durability::checkpoint;  // no fdatasync per step: the test is about RAM state
    }
    return o;
  }

  // One trainer's optimizer stepped `steps` times with iteration 1's gradients, from `threads` threads.
  test::RunResult stepped(int steps, int threads) {
    test::Trainer trainer(Schedule::sync, DType::bf16, options(), 0, kSizes);
    EXPECT_TRUE(trainer.created());
    if (!trainer.created()) return {};
    test::random_grads(1e-2)(trainer.model(), 1, 1.0f);
    std::vector<std::thread> workers;
    for (int k = 0; k < threads; ++k) {
      workers.emplace_back([&trainer, steps, threads] {
        for (int i = 0; i < steps / threads; ++i) {
          const Status s = trainer.opt().step();
          EXPECT_TRUE(s.ok()) << s.to_string();
        }
      });
    }
    for (std::thread& w : workers) w.join();
    return trainer.result();
  }

  // Steps with `schedule` (overlap: every gradient reported first) while a second thread saves 8 times;
  // each checkpoint must hold the state of sync's run after the step count it records.
  void save_beside_steps(Schedule schedule) {
    constexpr int kSteps = 6;
    std::vector<test::RunResult> after(kSteps + 1);  // after[k]: the state after k steps
    for (int k = 0; k <= kSteps; ++k) after[k] = stepped(k, 1);

    test::Trainer trainer(schedule, DType::bf16, options(), 0, kSizes);
    ASSERT_TRUE(trainer.created());
    test::random_grads(1e-2)(trainer.model(), 1, 1.0f);
    std::vector<std::string> saved;
    std::thread saver([&] {
      for (int i = 0; i < 8; ++i) {
        const std::string path = (dir_ / ("ckpt" + std::to_string(i) + ".zoe")).string();
        const Status s = trainer.opt().save(path);
        EXPECT_TRUE(s.ok()) << s.to_string();
        if (s.ok()) saved.push_back(path);
      }
    });
    for (int i = 0; i < kSteps; ++i) {
      if (schedule == Schedule::overlap) {
        ASSERT_TRUE(trainer.device_synchronize().ok());
        for (std::size_t b = kSizes.size(); b-- > 0;) ASSERT_TRUE(trainer.opt().grad_ready(b).ok());
      }
      const Status s = trainer.opt().step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    saver.join();
    ASSERT_EQ(saved.size(), 8u);
    test::expect_bitwise_equal(after[kSteps], trainer.result());

    OffloadOptions ram;  // the checkpoints load into tier ram, a store of their own
    for (const std::string& path : saved) {
      SCOPED_TRACE(path);
      test::Trainer reader(Schedule::sync, DType::bf16, ram, 0, kSizes);
      ASSERT_TRUE(reader.created());
      const Status s = reader.opt().load(path);
      ASSERT_TRUE(s.ok()) << s.to_string();
      const test::RunResult got = reader.result();
      ASSERT_GE(got.steps, 0);
      ASSERT_LE(got.steps, kSteps);
      const test::RunResult& want = after[static_cast<std::size_t>(got.steps)];
      ASSERT_EQ(got.state.size(), want.state.size());
      EXPECT_EQ(std::memcmp(got.state.data(), want.state.data(), got.state.size() * 4), 0)
          << "a checkpoint labelled step " << got.steps << " holds another state";
    }
  }

  fs::path dir_;
};

TEST_P(Threads, StepsFromTwoThreadsEqualTheSameStepsFromOne) {
  const test::RunResult one = stepped(10, 1);
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    const test::RunResult two = stepped(10, 2);
    EXPECT_EQ(two.steps, 10);
    test::expect_bitwise_equal(one, two);
  }
}

// A background checkpoint: save() on a second thread while the first steps. Every file it wrote loads, and
// holds exactly the state one thread's run had after the step count it records.
TEST_P(Threads, SaveBesideStepHoldsOneWholeStep) { save_beside_steps(Schedule::sync); }

// The same, with the overlap schedule stepping during backward: a save() between the reports and step()
// takes the state before that iteration's step (the speculative steps undone, step() takes them again), never
// one half-stepped; and the run still ends as sync's.
TEST_P(Threads, SaveDuringOverlapsBackwardHoldsOneWholeStep) { save_beside_steps(Schedule::overlap); }

#ifdef ZOE_HAVE_AIO
const auto kTiers = ::testing::Values(Tier::ram, Tier::nvme);
#else
const auto kTiers = ::testing::Values(Tier::ram);
#endif
std::string tier_label(const ::testing::TestParamInfo<Tier>& tier) { return std::string(tier_name(tier.param)); }
INSTANTIATE_TEST_SUITE_P(Tiers, Threads, kTiers, tier_label);

}  // namespace
}  // namespace zoe
