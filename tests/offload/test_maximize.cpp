// AdamHyper::maximize through the offloaded step: every path that calls the Adam kernel (sync, overlap's
// speculative steps and redo, delayed, tier nvme's streamed step and speculation, partitioned) ascends with
// gradient g exactly as the plain optimizer descends with -g; the gradient's norm, clipping and overflow are
// those of g (the same decisions); and checkpoints carry the flag.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "src/offload/checkpoint.h"
#include "tests/offload/trainer.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

using test::cat;

// Iteration t's gradients negated: exact in every dtype (an fp16 overflow's Inf becomes -Inf).
test::GradFn negated(const test::GradFn& grads) {
  return [grads](test::DeviceParams& model, int t, float scale) {
    grads(model, t, scale);
    for (const ParamSpec& p : model.specs) {
      for (std::size_t k = 0; k < p.n; ++k) {
        model.set(const_cast<void*>(p.device_grads), k, -model.get(p.device_grads, k));
      }
    }
  };
}

class Maximize : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / cat("zoe_maximize_", std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  OffloadOptions tier(OffloadOptions o, bool nvme) const {
    if (!nvme) return o;
    o.tier = Tier::nvme;
    o.nvme.paths = {dir_.string()};
    o.nvme.buffer_count = 3;
    return o;
  }

  // Steps `steps` iterations with group 0 (AdamW) and group 1 (Adam with L2) both maximizing (`maximize`) or
  // not; the trainer's groups and parameters otherwise.
  test::RunResult run(Schedule schedule, DType dtype, const OffloadOptions& o, bool maximize, const test::GradFn& grads,
                      int steps = 8) {
    const int warmup = schedule == Schedule::delayed ? 3 : 0;
    test::Trainer t(schedule, dtype, o, warmup);
    EXPECT_TRUE(t.created());
    for (std::size_t g = 0; g < 2; ++g) t.opt().group_hyper(g).maximize = maximize;
    t.run(1, steps, grads);
    return t.result();
  }

  fs::path dir_;
};

TEST_F(Maximize, EveryScheduleAndTierAscendsAsTheNegatedGradientDescends) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (bool nvme : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      for (DType state : {DType::f32, DType::i8}) {
        SCOPED_TRACE(cat(nvme ? "nvme, " : "ram, ", schedule_name(schedule), ", ", state_dtype_name(state)));
        OffloadOptions o;
        o.state_dtype = state;
        const test::RunResult up = run(schedule, DType::bf16, tier(o, nvme), true, grads);
        const test::RunResult down = run(schedule, DType::bf16, tier(o, nvme), false, negated(grads));
        test::expect_bitwise_equal(up, down);
        EXPECT_EQ(up.stats.redone, down.stats.redone);
        const test::RunResult plain = run(schedule, DType::bf16, tier(o, nvme), false, grads);
        EXPECT_NE(up.device_weights, plain.device_weights) << "maximize is really in effect";
      }
    }
  }
}

// fp16 loss scaling with an overflow at step 5 and clipping that bites: the norm and the overflow are
// those of g, so the skip, the backoff and the clip coefficient are the negated run's; overlap redoes its
// speculation (clipping) and still gives the same bits. fp32 parameters on the CPU device too, where tier
// ram steps them in place.
TEST_F(Maximize, NormOverflowAndClippingAreThoseOfTheGradient) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  o.max_grad_norm = 0.1f;
  const test::GradFn grads = test::random_grads(1e-2, {5});
  for (bool nvme : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
      SCOPED_TRACE(cat(nvme ? "nvme, " : "ram, ", schedule_name(schedule)));
      const test::RunResult up = run(schedule, DType::f16, tier(o, nvme), true, grads, 10);
      const test::RunResult down = run(schedule, DType::f16, tier(o, nvme), false, negated(grads), 10);
      test::expect_bitwise_equal(up, down);
      EXPECT_EQ(up.stats.skipped, 1);
      EXPECT_EQ(up.stats.skipped, down.stats.skipped);
      EXPECT_GT(up.stats.redone, schedule == Schedule::overlap ? 0 : -1);
    }
  }
  OffloadOptions clipped;
  clipped.max_grad_norm = 0.1f;
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(cat("fp32 parameters on the CPU device, ", schedule_name(schedule)));
    auto cpu_run = [&](bool maximize, const test::GradFn& g) {
      test::Trainer t(schedule, DType::f32, clipped, 0, {1000, 37, 4096, 1}, nullptr, 0, true);
      for (std::size_t k = 0; k < 2; ++k) t.opt().group_hyper(k).maximize = maximize;
      t.run(1, 6, g);
      return t.result();
    };
    test::expect_bitwise_equal(cpu_run(true, test::random_grads(1e-2)), cpu_run(false, negated(test::random_grads(1e-2))));
  }
}

// Partitioned over two ranks (reduce-scatter, each rank steps its shard, all-gather): the same weights on
// every rank.
TEST_F(Maximize, PartitionedRanksAscendAsTheNegatedGradientDescends) {
  auto partitioned = [&](bool maximize, const test::GradFn& grads) {
    std::shared_ptr<HostGroup> group = make_host_group(2);
    std::vector<test::RunResult> out(2);
    std::vector<char> created(2, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        test::Trainer t(Schedule::sync, DType::bf16, OffloadOptions{}, 0, {1000, 37, 4096, 1}, group, r);
        created[r] = t.created();
        if (!t.created()) return;
        for (std::size_t k = 0; k < 2; ++k) t.opt().group_hyper(k).maximize = maximize;
        t.run(1, 5, grads);
        out[r].device_weights = t.device_weights();  // read_state's indices are the rank's pieces: weights only
        out[r].steps = t.opt().step_count();
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_TRUE(created[0] && created[1]) << "a rank's optimizer was not created";
    return out;
  };
  const std::vector<test::RunResult> up = partitioned(true, test::random_grads(1e-2));
  const std::vector<test::RunResult> down = partitioned(false, negated(test::random_grads(1e-2)));
  ASSERT_EQ(up.size(), down.size());
  for (std::size_t r = 0; r < up.size(); ++r) {
    SCOPED_TRACE(cat("rank ", std::to_string(r)));
    EXPECT_FALSE(up[r].device_weights.empty());
    test::expect_bitwise_equal(up[r], down[r]);
  }
}

// A checkpoint keeps each group's maximize: a run resumed from it continues as the uninterrupted one, and a
// checkpoint of a run without it has no such key (manifests of other runs are unchanged).
TEST_F(Maximize, CheckpointsCarryTheFlag) {
  const test::GradFn grads = test::random_grads(1e-2);
  const test::RunResult whole = run(Schedule::sync, DType::bf16, OffloadOptions{}, true, grads, 8);
  const std::string path = (dir_ / "max.zoeckpt").string();
  {
    test::Trainer first(Schedule::sync, DType::bf16, OffloadOptions{});
    for (std::size_t g = 0; g < 2; ++g) first.opt().group_hyper(g).maximize = true;
    first.run(1, 4, grads);
    ASSERT_TRUE(first.opt().save(path).ok());
  }
  Result<CheckpointReader> saved = CheckpointReader::open(path);
  ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  EXPECT_NE(saved->manifest().find("\"maximize\":true"), std::string::npos) << saved->manifest();
  test::Trainer second(Schedule::sync, DType::bf16, OffloadOptions{});
  ASSERT_FALSE(second.opt().group_hyper(0).maximize);
  const std::string plain_path = (dir_ / "plain.zoeckpt").string();
  ASSERT_TRUE(second.opt().save(plain_path).ok());
  Result<CheckpointReader> plain = CheckpointReader::open(plain_path);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_EQ(plain->manifest().find("maximize"), std::string::npos) << plain->manifest();
  ASSERT_TRUE(second.opt().load(path).ok());
  EXPECT_TRUE(second.opt().group_hyper(0).maximize);
  EXPECT_TRUE(second.opt().group_hyper(1).maximize);
  second.run(5, 8, grads);
  test::expect_bitwise_equal(whole, [&] {
    test::RunResult r = second.result();
    r.scales.insert(r.scales.begin(), whole.scales.begin(), whole.scales.begin() + 4);  // the first run's
    return r;
  }());
}

}  // namespace
}  // namespace zoe
