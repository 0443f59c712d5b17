// ZeRO partitioning on in-process ranks (host stand-in devices, in-process collectives): W ranks with the same
// gradients must train exactly as one process does, an overflow on one rank must skip the step on all of
// them, and what partitioning cannot do is refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "tests/offload/trainer.h"
#include "zoe/partition.h"

namespace zoe {
namespace {

using namespace test;  // NOLINT: the trainer and gradient makers

struct RankRun {
  std::vector<unsigned char> weights;
  std::int64_t steps = 0;
  double last_grad_norm = 0;
};

// Runs `world` ranks, one thread each, through `iterations` sync steps; rank r's gradients from grads(r).
std::vector<RankRun> run_ranks(int world, DType dtype, const OffloadOptions& o, int iterations,
                               const std::function<GradFn(int)>& grads) {
  std::shared_ptr<HostGroup> group = make_host_group(world);
  std::vector<RankRun> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Trainer t(Schedule::sync, dtype, o, 0, {1000, 37, 4096, 1}, group, r);
      if (!t.created()) return;
      t.run(1, iterations, grads(r));
      out[r].weights = t.device_weights();
      out[r].steps = t.opt().step_count();
      out[r].last_grad_norm = t.opt().stats().last_grad_norm;
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(Partition, RanksWithTheSameGradientsTrainAsOneProcessBitwise) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  // One process with gradients g; each of W ranks with g too: their sum W g, averaged, is g exactly.
  const RunResult whole = train(Schedule::sync, DType::f16, o, 10, random_grads(1e-2, {4}));
  EXPECT_EQ(whole.steps, 9);
  for (int world : {2, 4}) {  // powers of two: W g and 1/W are exact
    SCOPED_TRACE("world " + std::to_string(world));
    // The overflow happens on the last rank only: every rank must skip that step.
    const std::vector<RankRun> ranks = run_ranks(world, DType::f16, o, 10, [world](int r) {
      return r == world - 1 ? random_grads(1e-2, {4}) : random_grads(1e-2);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(ranks[r].steps, 9) << "rank " << r;
      EXPECT_EQ(ranks[r].weights, whole.device_weights) << "rank " << r;
    }
  }
}

// The global norm summed in another order (per rank, then across ranks) in double: a few ulps of a double.
constexpr double kNormSumOrderRelTol = 1e-9;
// A clip coefficient that differs in its last float bit moves a master by an ulp or so, which can flip its
// bf16 rounding: one bf16 ulp (2^-8 relative, at most 2^-7) plus an absolute floor for values near zero.
constexpr double kBf16FlipRelTol = 1e-2;
constexpr double kBf16FlipAbsTol = 1e-6;

TEST(Partition, ClippingUsesTheGlobalNorm) {
  OffloadOptions o;
  o.max_grad_norm = 0.1f;  // about a third of the norm: every step clips
  const RunResult whole = train(Schedule::sync, DType::bf16, o, 8, random_grads(1e-2));
  const std::vector<RankRun> ranks = run_ranks(2, DType::bf16, o, 8, [](int) { return random_grads(1e-2); });
  // The norm is summed in another order across ranks, so the clip coefficient may differ in its last bit:
  // the weights agree to bf16's rounding, and every rank sees the global norm, not its shard's.
  for (const RankRun& r : ranks) {
    EXPECT_NEAR(r.last_grad_norm, whole.stats.last_grad_norm, kNormSumOrderRelTol * whole.stats.last_grad_norm);
    ASSERT_EQ(r.weights.size(), whole.device_weights.size());
    for (std::size_t i = 0; i + 1 < r.weights.size(); i += 2) {
      const float a = bf16_to_float(static_cast<std::uint16_t>(r.weights[i] | (r.weights[i + 1] << 8)));
      const float b = bf16_to_float(static_cast<std::uint16_t>(whole.device_weights[i] | (whole.device_weights[i + 1] << 8)));
      ASSERT_NEAR(a, b, kBf16FlipRelTol * std::fabs(b) + kBf16FlipAbsTol) << "element " << i / 2;
    }
  }
}

TEST(Partition, RefusesWhatItCannotDo) {
  std::shared_ptr<HostGroup> group = make_host_group(2);
  std::unique_ptr<Device> device = make_host_device();
  std::unique_ptr<Collectives> comm = make_host_collectives(group, *device, 0).value();
  DeviceParams model(*device, DType::bf16, {100, 10}, 1);

  OffloadOptions overlap;
  overlap.schedule = Schedule::overlap;
  Result<OffloadOptimizer> r = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, overlap, comm.get());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("sync"), std::string::npos) << r.status().to_string();

  std::vector<ParamSpec> mixed = model.specs;
  mixed[1].dtype = DType::f16;
  r = OffloadOptimizer::create(*device, {ParamGroup{}}, mixed, {}, comm.get());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("one dtype"), std::string::npos) << r.status().to_string();

  EXPECT_FALSE(make_host_collectives(group, *device, 2).ok()) << "rank 2 of 2";
}

TEST(Partition, CheckpointOfAnotherPartitioningIsRefused) {
  const std::string path = ::testing::TempDir() + "zoe_partition_" + std::to_string(::getpid()) + ".ckpt";
  {
    Trainer rank0(Schedule::sync, DType::bf16, {}, 0, {1000, 37, 4096, 1}, make_host_group(2), 0);
    ASSERT_TRUE(rank0.created());
    ASSERT_TRUE(rank0.opt().save(path).ok());
  }
  Trainer single(Schedule::sync, DType::bf16, {});
  const Status s = single.opt().load(path);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find("rank 0 of 2"), std::string::npos) << s.to_string();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace zoe
