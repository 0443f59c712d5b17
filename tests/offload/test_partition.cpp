// ZeRO partitioning on in-process ranks (host stand-in devices, in-process collectives): W ranks with the same
// gradients must train exactly as one process does, an overflow on one rank must skip the step on all of
// them, and what partitioning cannot do is refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/offload/trainer.h"
#include "zoe/checkpoint.h"
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
      OffloadOptions mine = o;
      for (std::string& path : mine.nvme.paths) {  // tier nvme: one swap folder per rank, as the Python front makes
        path += "/rank" + std::to_string(r);
        std::filesystem::create_directories(path);
      }
      Trainer t(Schedule::sync, dtype, mine, 0, {1000, 37, 4096, 1}, group, r);
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

TEST(Partition, Bf16MomentsTrainAsOneProcessBitwise) {
  OffloadOptions o;
  o.state_dtype = DType::bf16;
  const RunResult whole = train(Schedule::sync, DType::bf16, o, 8, random_grads(1e-2));
  const std::vector<RankRun> ranks = run_ranks(2, DType::bf16, o, 8, [](int) { return random_grads(1e-2); });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(ranks[r].weights, whole.device_weights) << "rank " << r;
  const RunResult fp32 = train(Schedule::sync, DType::bf16, {}, 8, random_grads(1e-2));
  EXPECT_NE(fp32.device_weights, whole.device_weights);  // the moments' dtype is in effect
}

// 8-bit moments: each rank's pieces have blocks of their own (counted from the piece's first element), so
// the run is not one process's bit for bit; every rank holds the same gathered weights, and the moments'
// dtype is in effect.
TEST(Partition, Int8MomentsGiveEveryRankTheSameWeights) {
  OffloadOptions o;
  o.state_dtype = DType::i8;
  const std::vector<RankRun> ranks = run_ranks(2, DType::bf16, o, 8, [](int) { return random_grads(1e-2); });
  EXPECT_EQ(ranks[0].weights, ranks[1].weights);
  EXPECT_EQ(ranks[0].steps, 8);
  OffloadOptions fp32;
  const std::vector<RankRun> reference = run_ranks(2, DType::bf16, fp32, 8, [](int) { return random_grads(1e-2); });
  EXPECT_NE(ranks[0].weights, reference[0].weights);
}

#ifdef ZOE_HAVE_AIO
// Each rank's pieces on tier nvme: every piece starts a block of that rank's swap range, so the ranks step
// the bits they step on tier ram.
TEST(Partition, Int8MomentsOnNvmeEqualRamBitwise) {
  testing::TempDir dir("zoe-partition");
  OffloadOptions ram;
  ram.state_dtype = DType::i8;
  OffloadOptions nvme = ram;
  nvme.tier = Tier::nvme;
  nvme.nvme.paths = {dir.path()};
  const auto grads = [](int) { return random_grads(1e-2); };
  const std::vector<RankRun> on_ram = run_ranks(2, DType::bf16, ram, 6, grads);
  const std::vector<RankRun> on_nvme = run_ranks(2, DType::bf16, nvme, 6, grads);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(on_nvme[r].steps, 6) << "rank " << r;
    EXPECT_EQ(on_nvme[r].weights, on_ram[r].weights) << "rank " << r;
  }
}
#endif

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

  // Separate allocations are not flat buffers: refused, naming the parameter.
  OffloadOptions flat;
  flat.partition.flat_buffers = true;
  r = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, flat, comm.get());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("parameter 1 (bf16) does not follow parameter 0"), std::string::npos)
      << r.status().to_string();

  EXPECT_FALSE(make_host_collectives(group, *device, 2).ok()) << "rank 2 of 2";
}

// bf16 and f32 parameters, interleaved, as a trainer's model holds them: in separate allocations, or (flat)
// back to back per dtype in buffers padded to a multiple of `world` elements.
class MixedModel {
 public:
  MixedModel(Device& device, bool flat, std::size_t world) : device_(device) {
    const std::vector<std::size_t> sizes = {1000, 4096, 37, 1, 513};
    const std::vector<DType> dtypes = {DType::bf16, DType::f32, DType::bf16, DType::f32, DType::bf16};
    std::size_t used[2] = {0, 0};  // elements per flat buffer so far: bf16, f32
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ParamSpec p;
      p.n = sizes[i];
      p.dtype = dtypes[i];
      p.group = static_cast<int>(i % 2);
      specs.push_back(p);
      used[p.dtype == DType::f32] += p.n;
    }
    if (flat) {
      for (int k = 0; k < 2; ++k) {
        const std::size_t padded = (used[k] + world - 1) / world * world, bytes = padded * (k == 1 ? 4 : 2);
        for (void** buffer : {&weights_[k], &grads_[k]}) {
          *buffer = device.allocate(bytes).value();
          std::memset(*buffer, 0, bytes);
        }
      }
    }
    std::size_t at[2] = {0, 0};
    Random rng(7);
    for (ParamSpec& p : specs) {
      const int k = p.dtype == DType::f32;
      const std::size_t bytes = p.n * dtype_size(p.dtype);
      if (flat) {
        p.device_weights = static_cast<unsigned char*>(weights_[k]) + at[k] * dtype_size(p.dtype);
        p.device_grads = static_cast<unsigned char*>(grads_[k]) + at[k] * dtype_size(p.dtype);
        at[k] += p.n;
      } else {
        p.device_weights = device.allocate(bytes).value();
        p.device_grads = device.allocate(bytes).value();
        owned_.push_back(p.device_weights);
        owned_.push_back(const_cast<void*>(p.device_grads));
      }
      for (std::size_t i = 0; i < p.n; ++i) set(p, p.device_weights, i, static_cast<float>(rng.uniform(-1, 1)));
    }
  }
  ~MixedModel() {
    for (void* b : owned_) device_.free(b);
    for (void* b : {weights_[0], weights_[1], grads_[0], grads_[1]}) device_.free(b);
  }
  // Iteration t's gradients, the same on every rank.
  void write_grads(int t) {
    Random rng(1000 + t);
    for (const ParamSpec& p : specs) {
      for (std::size_t i = 0; i < p.n; ++i) set(p, const_cast<void*>(p.device_grads), i, static_cast<float>(rng.uniform(-1e-2, 1e-2)));
    }
  }
  std::vector<unsigned char> weights() const {
    std::vector<unsigned char> out;
    for (const ParamSpec& p : specs) {
      const auto* b = static_cast<const unsigned char*>(p.device_weights);
      out.insert(out.end(), b, b + p.n * dtype_size(p.dtype));
    }
    return out;
  }

  std::vector<ParamSpec> specs;

 private:
  static void set(const ParamSpec& p, void* base, std::size_t i, float x) {
    if (p.dtype == DType::f32) {
      static_cast<float*>(base)[i] = x;
    } else {
      static_cast<std::uint16_t*>(base)[i] = float_to_bf16(x);
    }
  }
  Device& device_;
  void* weights_[2] = {nullptr, nullptr};
  void* grads_[2] = {nullptr, nullptr};
  std::vector<void*> owned_;
};

// The device weights of each of `world` ranks (world 1: one process, unpartitioned) after `steps` sync steps
// on the mixed model, every rank with the same gradients.
std::vector<std::vector<unsigned char>> run_mixed(int world, PartitionOptions partition, int steps) {
  std::shared_ptr<HostGroup> group = make_host_group(world);
  std::vector<std::vector<unsigned char>> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Device> device = make_host_device();
      MixedModel model(*device, partition.flat_buffers, static_cast<std::size_t>(world));
      std::unique_ptr<Collectives> comm;
      if (world > 1) comm = make_host_collectives(group, *device, r).value();
      OffloadOptions o;
      o.partition = partition;
      o.cpu.threads = 1;
      std::vector<ParamGroup> groups(2);
      groups[1].hyper.lr = 5e-3f;
      groups[1].hyper.weight_decay = 0.1f;
      Result<OffloadOptimizer> opt = OffloadOptimizer::create(*device, groups, model.specs, o, comm.get());
      ASSERT_TRUE(opt.ok()) << opt.status().to_string();
      for (int t = 1; t <= steps; ++t) {
        model.write_grads(t);
        const Status s = opt->step();
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
      ASSERT_TRUE(opt->wait().ok());
      out[r] = model.weights();
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(Partition, MixedDtypesInFlatOrCopiedBuffersTrainAsOneProcessBitwise) {
  const std::vector<unsigned char> whole = run_mixed(1, {}, 6)[0];
  for (bool flat : {false, true}) {
    for (bool averaged : {false, true}) {
      SCOPED_TRACE(std::string(flat ? "flat buffers" : "copied buffers") + (averaged ? ", averaged" : ", summed"));
      // Summed: each of the 2 ranks gives g, their sum 2g halved is g exactly. Averaged: g is the average.
      PartitionOptions po;
      po.flat_buffers = flat;
      po.grads_averaged = averaged;
      const std::vector<std::vector<unsigned char>> ranks = run_mixed(2, po, 6);
      for (int r = 0; r < 2; ++r) EXPECT_EQ(ranks[r], whole) << "rank " << r;
    }
  }
}

// Each rank's checkpoint holds its pieces; joined (PartitionedCheckpoint: zoe export, Python's
// consolidate_state_dicts) they are the state of one process that took the same steps, bit for bit.
TEST(Partition, RanksCheckpointsJoinIntoOneProcesssState) {
  const std::string dir = ::testing::TempDir() + "zoe_partition_join_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  const std::vector<std::size_t> sizes = {1000, 37, 4096, 1};
  const std::string whole_path = dir + "/whole.zoe";
  {
    Trainer whole(Schedule::sync, DType::f16, o, 0, sizes);
    whole.run(1, 5, random_grads(1e-2));
    ASSERT_TRUE(whole.opt().save(whole_path).ok());
  }
  std::shared_ptr<HostGroup> group = make_host_group(2);
  std::vector<std::string> rank_paths = {dir + "/rank0.zoe", dir + "/rank1.zoe"};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Trainer t(Schedule::sync, DType::f16, o, 0, sizes, group, r);
      if (!t.created()) return;
      t.run(1, 5, random_grads(1e-2));
      const Status s = t.opt().save(rank_paths[r]);
      EXPECT_TRUE(s.ok()) << s.to_string();
    });
  }
  for (std::thread& t : threads) t.join();

  Result<PartitionedCheckpoint> one = PartitionedCheckpoint::open({whole_path});
  Result<PartitionedCheckpoint> two = PartitionedCheckpoint::open({rank_paths[1], rank_paths[0]});  // any order
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->files(), 2u);
  EXPECT_EQ(two->step(), one->step());
  EXPECT_EQ(two->loss_scale().scale, one->loss_scale().scale);
  ASSERT_EQ(two->params().size(), sizes.size());
  std::size_t held = 0;
  for (std::size_t f = 0; f < 2; ++f) {
    for (const CheckpointPiece& k : two->pieces(f)) held += k.n;
  }
  EXPECT_EQ(held, 1000u + 37 + 4096 + 1) << "each element in exactly one rank's pieces";
  for (const char* blob : {"master", "exp_avg", "exp_avg_sq"}) {
    SCOPED_TRACE(blob);
    Result<std::vector<std::vector<float>>> a = one->join(blob), b = two->join(blob);
    ASSERT_TRUE(a.ok() && b.ok());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_EQ(b.value()[i].size(), sizes[i]);
      EXPECT_EQ(std::memcmp(a.value()[i].data(), b.value()[i].data(), sizes[i] * 4), 0) << "parameter " << i;
    }
  }
  // One rank's file alone is not a run's state.
  Result<PartitionedCheckpoint> half = PartitionedCheckpoint::open({rank_paths[0]});
  ASSERT_FALSE(half.ok());
  EXPECT_NE(half.status().message().find("rank 1 of 2 is missing"), std::string::npos) << half.status().to_string();
  std::filesystem::remove_all(dir);
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
