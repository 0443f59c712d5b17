// OffloadOptimizer on the host stand-in device: the schedules against each other and against a reference,
// clipping, fp16 overflow, loss scaling, and refusals.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/offload/loss_scaler.h"
#include "tests/offload/trainer.h"
#include "tests/reference.h"
#include "zoe/offload.h"

namespace zoe {
namespace {

using namespace test;  // NOLINT: the trainer, its results and gradient makers

TEST(OffloadOptimizer, OverlapEqualsSyncBitwise) {
  const RunResult sync = train(Schedule::sync, DType::bf16, {}, 20, random_grads(1e-2));
  const RunResult overlap = train(Schedule::overlap, DType::bf16, {}, 20, random_grads(1e-2));
  expect_bitwise_equal(sync, overlap);
  EXPECT_EQ(overlap.stats.redone, 0);
  EXPECT_EQ(sync.steps, 20);
}

// The CPU as the device: gradients read and weights written in place, f32 masters kept on the device —
// the same bits as going through staging, for every schedule, with clipping and an fp16 overflow.
TEST(OffloadOptimizer, CpuDeviceInPlaceEqualsStagedCopies) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  o.max_grad_norm = 0.1f;
  const GradFn grads = random_grads(1e-2, {6});
  for (DType dtype : {DType::f32, DType::f16}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::string(schedule_name(schedule)));
      Trainer staged(schedule, dtype, o, 2);
      staged.run(1, 12, grads);
      Trainer in_place(schedule, dtype, o, 2, {1000, 37, 4096, 1}, nullptr, 0, true);
      in_place.run(1, 12, grads);
      const RunResult a = staged.result(), b = in_place.result();
      expect_bitwise_equal(a, b);
      if (schedule != Schedule::delayed) {
        EXPECT_EQ(b.stats.d2h_bytes, 0u) << "in place: nothing is copied";
      }
    }
  }
  // Without clipping or loss scaling no statistics are needed, and the results are the same.
  const RunResult staged = train(Schedule::sync, DType::f32, {}, 8, random_grads(1e-2));
  Trainer in_place(Schedule::sync, DType::f32, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, true);
  in_place.run(1, 8, random_grads(1e-2));
  expect_bitwise_equal(staged, in_place.result());
}

TEST(OffloadOptimizer, CpuDeviceSaveLoadContinues) {
  const std::string path = ::testing::TempDir() + "zoe_cpu_" + std::to_string(::getpid()) + ".ckpt";
  const GradFn grads = random_grads(1e-2);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Trainer whole(Schedule::sync, dtype, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, true);
    whole.run(1, 10, grads);
    {
      Trainer first(Schedule::sync, dtype, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, true);
      first.run(1, 5, grads);
      ASSERT_TRUE(first.opt().save(path).ok());
    }
    Trainer second(Schedule::sync, dtype, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, true);
    const Status loaded = second.opt().load(path);
    ASSERT_TRUE(loaded.ok()) << loaded.to_string();
    second.run(6, 10, grads);
    const RunResult a = whole.result(), b = second.result();
    EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0);
    EXPECT_EQ(a.device_weights, b.device_weights);
    EXPECT_EQ(a.steps, b.steps);
  }
  std::remove(path.c_str());
}

TEST(OffloadOptimizer, OverlapEqualsSyncWithClipping) {
  OffloadOptions o;
  o.max_grad_norm = 0.1f;  // the gradients' norm is about 0.3: clipping at most steps
  const RunResult sync = train(Schedule::sync, DType::bf16, o, 20, random_grads(1e-2));
  const RunResult overlap = train(Schedule::overlap, DType::bf16, o, 20, random_grads(1e-2));
  expect_bitwise_equal(sync, overlap);
  EXPECT_GT(overlap.stats.redone, 0) << "clipping never changed a speculative step: the test does not clip";
  EXPECT_LT(overlap.stats.last_grad_norm, 1.0);
  EXPECT_GT(overlap.stats.last_grad_norm, 0.1);
}

TEST(OffloadOptimizer, OverlapEqualsSyncWithFp16Overflow) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  o.loss_scale.growth_interval = 5;
  o.max_grad_norm = 1.0f;
  const GradFn grads = random_grads(1e-2, {7, 13});
  const RunResult sync = train(Schedule::sync, DType::f16, o, 20, grads);
  const RunResult overlap = train(Schedule::overlap, DType::f16, o, 20, grads);
  expect_bitwise_equal(sync, overlap);
  EXPECT_EQ(sync.stats.skipped, 2);
  EXPECT_EQ(sync.steps, 18);
  // Iterations 1-6 at 1024 (growth after 5 clean steps: 2048 from iteration 6), overflow at 7 halves it.
  EXPECT_EQ(sync.scales[5], 2048.0f);
  EXPECT_EQ(sync.scales[7], 1024.0f);
}

TEST(OffloadOptimizer, OverflowStepChangesNoState) {
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    OffloadOptions o;
    o.loss_scale.enabled = true;
    o.loss_scale.initial_scale = 256;
    const RunResult before = train(schedule, DType::f16, o, 4, random_grads(1e-2));
    const RunResult after = train(schedule, DType::f16, o, 5, random_grads(1e-2, {5}));
    EXPECT_EQ(std::memcmp(before.state.data(), after.state.data(), before.state.size() * 4), 0);
    EXPECT_EQ(before.device_weights, after.device_weights);
    EXPECT_EQ(after.steps, 4);
    EXPECT_EQ(after.stats.skipped, 1);
  }
}

// Gradients that depend on the weights the device holds: g = w - 0.25, so a stale weight shows.
GradFn weight_dependent_grads() {
  return [](DeviceParams& model, int, float scale) {
    for (const ParamSpec& p : model.specs) {
      for (std::size_t i = 0; i < p.n; ++i) {
        model.set(const_cast<void*>(p.device_grads), i, (model.get(p.device_weights, i) - 0.25f) * scale);
      }
    }
  };
}

TEST(OffloadOptimizer, DelayedMatchesReferenceDelayedUpdate) {
  constexpr int kWarmup = 3, kSteps = 12;
  const RunResult delayed = train(Schedule::delayed, DType::bf16, {}, kSteps, weight_dependent_grads(), kWarmup);

  // The reference: CpuAdam on the same data. Warm-up steps update the device at once; afterwards step t's
  // weights reach the device only when step t+1 is taken (the device computes iteration t+1 on step t-1's).
  std::unique_ptr<Device> device = make_host_device();
  DeviceParams model(*device, DType::bf16, {1000, 37, 4096, 1}, 42);
  CpuAdamOptions co;
  co.threads = 1;
  CpuAdam adam = CpuAdam::create(co).value();
  const std::size_t count = model.specs.size();
  std::vector<std::vector<float>> p(count), m(count), v(count);
  std::vector<std::vector<std::uint16_t>> w(count), g(count), pending(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t n = model.specs[i].n;
    w[i].assign(static_cast<const std::uint16_t*>(model.specs[i].device_weights),
                static_cast<const std::uint16_t*>(model.specs[i].device_weights) + n);
    for (std::uint16_t x : w[i]) p[i].push_back(bf16_to_float(x));
    m[i].assign(n, 0.0f);
    v[i].assign(n, 0.0f);
    g[i].resize(n);
    pending[i].resize(n);
  }
  AdamHyper h0, h1;
  h0.lr = 1e-2f;
  h0.weight_decay = 0.01f;
  h1.lr = 5e-3f;
  h1.adamw = false;
  h1.weight_decay = 0.1f;
  bool has_pending = false;
  for (int t = 1; t <= kSteps; ++t) {
    for (std::size_t i = 0; i < count; ++i) {
      for (std::size_t k = 0; k < g[i].size(); ++k) g[i][k] = float_to_bf16(bf16_to_float(w[i][k]) - 0.25f);
    }
    if (t > kWarmup && has_pending) w = pending;
    for (std::size_t i = 0; i < count; ++i) {
      AdamTensor tensor{p[i].data(), m[i].data(), v[i].data(), DType::f32, g[i].data(), DType::bf16,
                        t > kWarmup ? pending[i].data() : w[i].data(), DType::bf16, p[i].size()};
      StepOptions so;
      so.step = t;
      ASSERT_TRUE(adam.step(i == 2 ? h1 : h0, so, tensor).ok());
    }
    has_pending = t > kWarmup;
  }
  if (has_pending) w = pending;
  std::vector<float> state;
  std::vector<unsigned char> weights;
  for (std::size_t i = 0; i < count; ++i) {
    state.insert(state.end(), p[i].begin(), p[i].end());
    state.insert(state.end(), m[i].begin(), m[i].end());
    state.insert(state.end(), v[i].begin(), v[i].end());
    const auto* b = reinterpret_cast<const unsigned char*>(w[i].data());
    weights.insert(weights.end(), b, b + w[i].size() * 2);
  }
  ASSERT_EQ(state.size(), delayed.state.size());
  EXPECT_EQ(std::memcmp(state.data(), delayed.state.data(), state.size() * 4), 0);
  EXPECT_EQ(weights, delayed.device_weights);
  EXPECT_EQ(delayed.steps, kSteps);

  // And the staleness is real: the sync schedule on the same gradients ends elsewhere.
  const RunResult sync = train(Schedule::sync, DType::bf16, {}, kSteps, weight_dependent_grads());
  EXPECT_NE(std::memcmp(sync.state.data(), delayed.state.data(), state.size() * 4), 0);
}

TEST(OffloadOptimizer, RefusesBadInput) {
  std::unique_ptr<Device> device = make_host_device();
  DeviceParams model(*device, DType::bf16, {10, 20}, 1);
  auto specs = model.specs;
  specs[1].group = 3;
  Result<OffloadOptimizer> bad_group = OffloadOptimizer::create(*device, {ParamGroup{}}, specs, {});
  ASSERT_FALSE(bad_group.ok());
  EXPECT_NE(bad_group.status().message().find("parameter 1: group 3"), std::string::npos);

  specs = model.specs;
  specs[0].device_grads = nullptr;
  EXPECT_FALSE(OffloadOptimizer::create(*device, {ParamGroup{}}, specs, {}).ok());

  ParamGroup negative;
  negative.hyper.lr = -1;
  EXPECT_EQ(OffloadOptimizer::create(*device, {negative}, model.specs, {}).status().code(), StatusCode::invalid_argument);

  // AMSGrad adds a state array the tiers were allocated without: turning it on after creation is refused by
  // name at the step (test_optimizer_rules.cpp runs it from creation).
  Result<OffloadOptimizer> running = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, {});
  ASSERT_TRUE(running.ok()) << running.status().to_string();
  running->group_hyper(0).amsgrad = true;
  const Status refused = running->step();
  EXPECT_EQ(refused.code(), StatusCode::invalid_argument);
  EXPECT_NE(refused.message().find("amsgrad = true"), std::string::npos) << refused.to_string();
  running->group_hyper(0).amsgrad = false;

  OffloadOptions clip;
  clip.max_grad_norm = -1;
  EXPECT_FALSE(OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, clip).ok());

  // An infinite loss scale would skip every step (every scaled gradient overflows).
  for (float LossScaleOptions::*field : {&LossScaleOptions::initial_scale, &LossScaleOptions::static_scale,
                                         &LossScaleOptions::min_scale}) {
    OffloadOptions scaled;
    scaled.loss_scale.enabled = true;
    scaled.loss_scale.*field = INFINITY;
    const Status s = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, scaled).status();
    EXPECT_EQ(s.code(), StatusCode::invalid_argument);
    EXPECT_NE(s.message().find("inf"), std::string::npos) << s.to_string();
  }

  OffloadOptions overlap;
  overlap.schedule = Schedule::overlap;
  random_grads(1e-2)(model, 1, 1.0f);  // the gradient memory is not initialised: a NaN there is refused
  Result<OffloadOptimizer> opt = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, overlap);
  ASSERT_TRUE(opt.ok());
  EXPECT_FALSE(opt->grad_ready(2).ok());
  EXPECT_TRUE(opt->grad_ready(1).ok());
  const Status twice = opt->grad_ready(1);
  EXPECT_NE(twice.message().find("reported ready twice"), std::string::npos) << twice.to_string();
  EXPECT_TRUE(opt->step().ok());
}

// In place the gradient statistics (the NaN/Inf refusal, the norm) run on the engine's threads rather than
// on the device's copy stream: the same norm to the bit as the host stand-in's, for any thread count and
// with parameters cut into many pieces, and a NaN in any piece is still refused.
TEST(OffloadOptimizer, CpuDeviceGradStatsOnEngineThreadsEqualTheDevices) {
  OffloadOptions o;
  o.tile = 300;  // several pieces per parameter, some of one element
  o.max_grad_norm = 0.05f;
  const std::vector<std::size_t> sizes = {1000, 37, 4096, 1, 2049};
  const GradFn grads = random_grads(1e-2);
  Trainer staged(Schedule::sync, DType::f32, o, 0, sizes);
  staged.run(1, 6, grads);
  const RunResult reference = staged.result();
  ASSERT_GT(reference.stats.last_grad_norm, 0.0);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    OffloadOptions t = o;
    t.cpu.threads = threads;
    Trainer in_place(Schedule::sync, DType::f32, t, 0, sizes, nullptr, 0, true);
    in_place.run(1, 6, grads);
    const RunResult r = in_place.result();
    expect_bitwise_equal(reference, r);
    EXPECT_EQ(std::memcmp(&reference.stats.last_grad_norm, &r.stats.last_grad_norm, sizeof(double)), 0);
    auto poisoned = [&grads](DeviceParams& model, int step, float scale) {
      grads(model, step, scale);
      model.set(const_cast<void*>(model.specs[4].device_grads), 2048, INFINITY);  // the last piece's last element
    };
    const Status s = in_place.iteration(7, poisoned);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("parameter(s) 4 (1)"), std::string::npos) << s.to_string();
    EXPECT_EQ(in_place.result().steps, r.steps);
  }
}

// With neither clipping nor loss scaling, in place, the refusal reads only the count of NaN/Inf values (one
// pass, no norm): a non-finite value in any piece is still found, on any number of threads.
TEST(OffloadOptimizer, CpuDeviceRefusalAloneCountsWithoutTheNorm) {
  OffloadOptions o;
  o.tile = 300;
  const std::vector<std::size_t> sizes = {1000, 37, 4096, 1, 2049};
  const GradFn grads = random_grads(1e-2);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    o.cpu.threads = threads;
    Trainer in_place(Schedule::sync, DType::f32, o, 0, sizes, nullptr, 0, true);
    in_place.run(1, 3, grads);
    EXPECT_EQ(in_place.result().stats.last_grad_norm, 0.0);  // nothing asked for the norm
    auto poisoned = [&grads](DeviceParams& model, int step, float scale) {
      grads(model, step, scale);
      model.set(const_cast<void*>(model.specs[4].device_grads), 2048, NAN);  // the last piece's last element
    };
    const Status s = in_place.iteration(4, poisoned);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("parameter(s) 4 (1)"), std::string::npos) << s.to_string();
    EXPECT_EQ(in_place.result().steps, 3);
  }
}

// Without fp16 loss scaling a NaN/Inf gradient is bad input: the step is refused with an error naming the
// parameter, and nothing changes — master weights, moments, device weights, step count. With
// refuse_non_finite = false it propagates, as in torch.
TEST(OffloadOptimizer, NonFiniteGradientIsRefusedAndChangesNothing) {
  const GradFn clean = random_grads(1e-2);
  auto poisoned = [&clean](DeviceParams& model, int t, float scale) {
    clean(model, t, scale);
    model.set(const_cast<void*>(model.specs[2].device_grads), 100, NAN);
  };
  for (bool cpu : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + (cpu ? " cpu device" : " host stand-in"));
      OffloadOptions o;
      o.max_grad_norm = schedule == Schedule::sync ? 1.0f : 0.0f;
      Trainer t(schedule, DType::bf16, o, 2, {1000, 37, 4096, 1}, nullptr, 0, cpu);
      t.run(1, 4, clean);
      const RunResult before = t.result();
      ASSERT_TRUE(t.device_synchronize().ok());
      Status s = t.iteration(5, poisoned);
      // delayed: the step runs in the background and its refusal comes with the next call.
      if (schedule == Schedule::delayed) {
        EXPECT_TRUE(s.ok()) << s.to_string();
        s = t.opt().wait();
      }
      ASSERT_FALSE(s.ok());
      EXPECT_NE(s.message().find("parameter(s) 2 (1)"), std::string::npos) << s.to_string();
      const RunResult after = t.result();
      EXPECT_EQ(std::memcmp(before.state.data(), after.state.data(), before.state.size() * 4), 0);
      EXPECT_EQ(before.device_weights, after.device_weights);
      EXPECT_EQ(before.steps, after.steps);
      // The next clean iteration steps normally.
      t.run(6, 6, clean);
      EXPECT_EQ(t.result().steps, before.steps + 1);
    }
  }
  OffloadOptions propagate;
  propagate.refuse_non_finite = false;
  Trainer t(Schedule::sync, DType::f32, propagate);
  t.run(1, 1, poisoned);
  std::vector<float> p(4096);
  ASSERT_TRUE(t.opt().read_state(2, p.data(), nullptr, nullptr).ok());
  EXPECT_TRUE(std::isnan(p[100]));
  EXPECT_FALSE(std::isnan(p[99]));
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "zoe_" + name + "_" + std::to_string(::getpid()) + ".ckpt";
}

TEST(OffloadOptimizer, SaveLoadContinueEqualsUninterruptedRun) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 512;
  o.loss_scale.growth_interval = 4;
  o.max_grad_norm = 0.5f;
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    const GradFn grads = random_grads(1e-2, {6});
    const RunResult whole = train(schedule, DType::f16, o, 16, grads, 2);
    const std::string path = temp_path("continue");
    {
      Trainer first(schedule, DType::f16, o, 2);
      first.run(1, 8, grads);
      const Status saved = first.opt().save(path);
      ASSERT_TRUE(saved.ok()) << saved.to_string();
    }
    // A fresh trainer — its device starts from the initial weights — resumes from the checkpoint. It is
    // already past the delayed warm-up: warmup 0.
    Trainer second(schedule, DType::f16, o, schedule == Schedule::delayed ? 0 : 2);
    const Status loaded = second.opt().load(path);
    ASSERT_TRUE(loaded.ok()) << loaded.to_string();
    EXPECT_EQ(second.opt().step_count(), 7);  // 8 iterations, one overflow skipped
    second.run(9, 16, grads);
    RunResult resumed = second.result();
    EXPECT_EQ(std::memcmp(whole.state.data(), resumed.state.data(), whole.state.size() * 4), 0);
    EXPECT_EQ(whole.device_weights, resumed.device_weights);
    EXPECT_EQ(whole.steps, resumed.steps);
    std::remove(path.c_str());
  }
}

TEST(OffloadOptimizer, CorruptOrMismatchedCheckpointIsRefusedAndChangesNothing) {
  const std::string path = temp_path("corrupt");
  {
    Trainer t(Schedule::sync, DType::bf16, {});
    t.run(1, 3, random_grads(1e-2));
    ASSERT_TRUE(t.opt().save(path).ok());
  }
  Trainer target(Schedule::sync, DType::bf16, {});
  target.run(1, 1, random_grads(1e-2));
  const RunResult before = target.result();

  // A byte flipped inside the master weights.
  std::FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, 4096 + 100, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, 4096 + 100, SEEK_SET);
  std::fputc(c ^ 0x40, f);
  std::fclose(f);
  const Status corrupt = target.opt().load(path);
  EXPECT_EQ(corrupt.code(), StatusCode::corrupt) << corrupt.to_string();
  RunResult after = target.result();
  EXPECT_EQ(std::memcmp(before.state.data(), after.state.data(), before.state.size() * 4), 0);
  EXPECT_EQ(before.device_weights, after.device_weights);
  EXPECT_EQ(target.opt().step_count(), 1);

  // A checkpoint of another model.
  {
    Trainer other(Schedule::sync, DType::bf16, {}, 0, {1000, 38, 4096, 1});
    ASSERT_TRUE(other.opt().save(path).ok());
  }
  const Status mismatch = target.opt().load(path);
  EXPECT_EQ(mismatch.code(), StatusCode::invalid_argument);
  EXPECT_NE(mismatch.message().find("parameter 1 is n=38 bf16"), std::string::npos) << mismatch.message();
  {
    Trainer other(Schedule::sync, DType::f16, {});
    ASSERT_TRUE(other.opt().save(path).ok());
  }
  EXPECT_NE(target.opt().load(path).message().find("f16"), std::string::npos);
  EXPECT_FALSE(target.opt().load(path + ".missing").ok());
  std::remove(path.c_str());
}

TEST(LossScaler, FollowsDeepSpeedHysteresisAndGrowth) {
  LossScaleOptions o;
  o.enabled = true;
  o.initial_scale = 1024;
  o.hysteresis = 2;
  o.growth_interval = 3;
  o.min_scale = 256;
  LossScaler s(o);
  s.update(true);  // first overflow spends the hysteresis budget
  EXPECT_EQ(s.scale(), 1024.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 512.0f);
  s.update(true);  // budget stays spent until a growth
  EXPECT_EQ(s.scale(), 256.0f);
  s.update(true);  // never below min_scale
  EXPECT_EQ(s.scale(), 256.0f);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 512.0f);
  s.update(true);  // the growth refilled the budget
  EXPECT_EQ(s.scale(), 512.0f);

  LossScaleOptions fixed = o;
  fixed.dynamic = false;
  fixed.static_scale = 128;
  LossScaler st(fixed);
  st.update(true);
  st.update(false);
  EXPECT_EQ(st.scale(), 128.0f);
  EXPECT_EQ(LossScaler(LossScaleOptions{}).scale(), 1.0f);
}

// Issue 32: a scale grown to inf skipped every step from then on (inf backs off to inf).
TEST(LossScaler, GrowthStopsAtTheLargestFiniteScale) {
  LossScaleOptions o;
  o.enabled = true;
  o.initial_scale = 0x1p127f;  // DeepSpeed's initial_scale_power 127, the largest the config reader takes
  o.growth_interval = 1;
  o.hysteresis = 1;
  LossScaler s(o);
  s.update(false);
  EXPECT_EQ(s.scale(), 0x1p127f) << "2^128 is inf in float";
  s.update(true);
  EXPECT_EQ(s.scale(), 0x1p126f) << "an overflow still backs off";
}

// State taken over from elsewhere (torch's optimizer, another partitioning): written where each tier keeps
// it, the device weights follow the master, bad values change nothing.
TEST(OffloadOptimizer, WriteStateReplacesTheStateAndTheDeviceWeightsFollow) {
  for (bool in_place : {false, true}) {
    for (DType dtype : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(std::string(in_place ? "in place" : "staged") + ", " + std::string(dtype_name(dtype)));
      Trainer t(Schedule::sync, dtype, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, in_place);
      ASSERT_TRUE(t.created());
      t.run(1, 2, random_grads(1e-2));
      const std::vector<std::size_t> sizes = t.opt().state_sizes();
      ASSERT_EQ(sizes, (std::vector<std::size_t>{1000, 37, 4096, 1}));
      const std::size_t n = sizes[2];
      std::vector<float> p(n), m(n), v(n);
      for (std::size_t j = 0; j < n; ++j) {
        p[j] = 0.25f + 1e-3f * static_cast<float>(j);  // not representable in bf16: the device rounds it
        m[j] = -1e-4f * static_cast<float>(j);
        v[j] = 1e-6f * static_cast<float>(j);
      }
      ASSERT_TRUE(t.opt().write_state(2, p.data(), m.data(), v.data()).ok());
      std::vector<float> p2(n), m2(n), v2(n);
      ASSERT_TRUE(t.opt().read_state(2, p2.data(), m2.data(), v2.data()).ok());
      EXPECT_EQ(p2, p);
      EXPECT_EQ(m2, m);
      EXPECT_EQ(v2, v);
      ASSERT_TRUE(t.device_synchronize().ok());
      for (std::size_t j = 0; j < n; ++j) {
        const float expected = dtype == DType::f32 ? p[j] : bf16_to_float(float_to_bf16(p[j]));
        ASSERT_EQ(t.model().get(t.model().specs[2].device_weights, j), expected) << "element " << j;
      }
      // A negative second moment is refused and nothing changes.
      std::vector<float> bad = v;
      bad[7] = -1.0f;
      const Status s = t.opt().write_state(2, p.data(), m.data(), bad.data());
      EXPECT_EQ(s.code(), StatusCode::invalid_argument);
      EXPECT_NE(s.message().find("exp_avg_sq[7]"), std::string::npos) << s.to_string();
      ASSERT_TRUE(t.opt().read_state(2, nullptr, nullptr, v2.data()).ok());
      EXPECT_EQ(v2, v);
      EXPECT_EQ(t.opt().write_state(9, p.data(), nullptr, nullptr).code(), StatusCode::invalid_argument);
      // The step count continues Adam's bias correction from where the state came from.
      ASSERT_TRUE(t.opt().set_step_count(40).ok());
      t.run(3, 3, random_grads(1e-2));
      EXPECT_EQ(t.opt().step_count(), 41);
      EXPECT_EQ(t.opt().set_step_count(-1).code(), StatusCode::invalid_argument);
    }
  }
}

// The loss scaler's state, as another front-end's checkpoint carries it: read, replaced, and the scale
// the trainer multiplies its loss by follows; bad values change nothing.
// torch's rule for a None gradient: set_grads_absent() leaves the parameter exactly as it is (master,
// moments, device weights, its own step count), in every schedule, staged or in place; the others step on,
// and a checkpoint keeps each parameter's count, so a resumed run equals the uninterrupted one.
TEST(OffloadOptimizer, AbsentGradientsLeaveTheirParameterAndItsStepCount) {
  const GradFn grads = random_grads(1e-2);
  constexpr std::size_t kAbsent = 1;
  auto run = [&](Trainer& trainer, int first, int last) {
    for (int t = first; t <= last; ++t) {
      ASSERT_TRUE(trainer.device_synchronize().ok());
      grads(trainer.model(), t, trainer.opt().loss_scale());
      const bool absent = t >= 3 && t <= 5;
      for (std::size_t b = trainer.model().specs.size(); b-- > 0;) {
        if (absent && b == kAbsent) continue;  // no backward reached it
        ASSERT_TRUE(trainer.opt().grad_ready(b).ok());
      }
      std::vector<std::size_t> none;
      if (absent) none.push_back(kAbsent);
      ASSERT_TRUE(trainer.opt().set_grads_absent(none).ok());
      const Status s = trainer.opt().step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  };
  auto state_of = [](OffloadOptimizer& opt, std::size_t i, std::size_t n) {
    EXPECT_TRUE(opt.wait().ok());
    std::vector<float> st(3 * n);
    EXPECT_TRUE(opt.read_state(i, st.data(), st.data() + n, st.data() + 2 * n).ok());
    return st;
  };
  for (const bool in_place : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + (in_place ? " in place" : " staged"));
      const bool delayed = schedule == Schedule::delayed;
      if (in_place && delayed) continue;  // the CPU device does not run the delayed schedule in place
      Trainer whole(schedule, DType::bf16, {}, 1, {1000, 37, 4096, 1}, nullptr, 0, in_place);
      ASSERT_TRUE(whole.created());
      const std::size_t n = whole.model().specs[kAbsent].n;
      run(whole, 1, 2);
      const std::vector<float> before = state_of(whole.opt(), kAbsent, n);
      run(whole, 3, 5);
      EXPECT_EQ(state_of(whole.opt(), kAbsent, n), before) << "a parameter without a gradient changed";
      EXPECT_EQ(whole.opt().param_step_count(kAbsent), 2);
      EXPECT_EQ(whole.opt().param_step_count(0), 5);
      EXPECT_EQ(whole.opt().step_count(), 5);
      const std::string path = temp_path("absent");
      ASSERT_TRUE(whole.opt().save(path).ok());
      run(whole, 6, 8);
      EXPECT_NE(state_of(whole.opt(), kAbsent, n), before) << "stepped again once it has a gradient";
      EXPECT_EQ(whole.opt().param_step_count(kAbsent), 5);

      Trainer resumed(schedule, DType::bf16, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, in_place);
      ASSERT_TRUE(resumed.opt().load(path).ok());
      EXPECT_EQ(resumed.opt().param_step_count(kAbsent), 2);
      EXPECT_EQ(resumed.opt().param_step_count(0), 5);
      run(resumed, 6, 8);
      const RunResult a = whole.result(), b = resumed.result();
      EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0);
      EXPECT_EQ(a.device_weights, b.device_weights);
      std::remove(path.c_str());
    }
  }
  Trainer trainer(Schedule::sync, DType::bf16, {});
  EXPECT_EQ(trainer.opt().set_grads_absent({99}).code(), StatusCode::invalid_argument);
  EXPECT_EQ(trainer.opt().set_param_step_count(0, -1).code(), StatusCode::invalid_argument);
}

// A parameter still named absent (set_grads_absent before backward, as after a step that failed) that is
// reported anyway: overlap's speculative step leaves it out and takes no undo copy of it, so when the
// speculation is wrong (clipping) nothing is put back into it either — it stays exactly as it was.
TEST(OffloadOptimizer, AnAbsentParameterReportedDuringBackwardStaysAsItWasWhenSpeculationFails) {
  OffloadOptions o;
  o.max_grad_norm = 1e-3f;  // clipping bites every step: every speculative step is undone and redone
  Trainer trainer(Schedule::overlap, DType::bf16, o, 1);
  ASSERT_TRUE(trainer.created());
  const GradFn grads = random_grads(1e-2);
  constexpr std::size_t kAbsent = 1;
  const std::size_t n = trainer.model().specs[kAbsent].n;
  auto state = [&] {
    EXPECT_TRUE(trainer.opt().wait().ok());
    std::vector<float> st(3 * n);
    EXPECT_TRUE(trainer.opt().read_state(kAbsent, st.data(), st.data() + n, st.data() + 2 * n).ok());
    return st;
  };
  for (int t = 1; t <= 3; ++t) {
    ASSERT_TRUE(trainer.device_synchronize().ok());
    grads(trainer.model(), t, trainer.opt().loss_scale());
    if (t == 3) {
      ASSERT_TRUE(trainer.opt().set_grads_absent({kAbsent}).ok());
    }
    const std::vector<float> before = state();
    for (std::size_t b = trainer.model().specs.size(); b-- > 0;) ASSERT_TRUE(trainer.opt().grad_ready(b).ok());
    const Status s = trainer.opt().step();
    ASSERT_TRUE(s.ok()) << s.to_string();
    if (t < 3) {
      EXPECT_NE(state(), before);
    } else {
      EXPECT_EQ(state(), before) << "the absent parameter changed";
    }
  }
  EXPECT_GT(trainer.opt().stats().redone, 0);
  EXPECT_EQ(trainer.opt().param_step_count(kAbsent), 2);
}

// A parameter reported during backward, then named absent before step() (torch: p.grad = None after
// backward), told through grads_changed() or not: the run equals the one where it was never reported (overlap:
// sync's). Overlap's speculative step of it is put back; named absent at once after the reports, while the
// worker may still be stepping it: the step reads the absent set, which must not change under it.
TEST(OffloadOptimizer, AParameterReportedThenNamedAbsentIsPutBack) {
  const GradFn grads = random_grads(1e-2);
  constexpr std::size_t kAbsent = 0;  // the largest: its step is the longest
  const std::vector<std::size_t> sizes = {1 << 20, 37, 4096, 1};
  auto run = [&](Trainer& trainer, bool report_absent, bool told) {
    for (int t = 1; t <= 8; ++t) {
      ASSERT_TRUE(trainer.device_synchronize().ok());
      grads(trainer.model(), t, trainer.opt().loss_scale());
      const bool absent = t >= 3 && t % 2 == 1;
      for (std::size_t b = sizes.size(); b-- > 0;) {
        if (absent && b == kAbsent && !report_absent) continue;
        ASSERT_TRUE(trainer.opt().grad_ready(b).ok());
      }
      if (absent && told) {
        ASSERT_TRUE(trainer.opt().grads_changed().ok());
      }
      ASSERT_TRUE(trainer.opt().set_grads_absent(absent ? std::vector<std::size_t>{kAbsent} : std::vector<std::size_t>{}).ok());
      const Status s = trainer.opt().step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  };
  for (const bool in_place : {false, true}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (Schedule schedule : {Schedule::overlap, Schedule::delayed}) {
        if (in_place && schedule == Schedule::delayed) continue;  // the CPU device does not run it in place
        Trainer never(schedule, dtype, {}, 1, sizes, nullptr, 0, in_place);
        ASSERT_TRUE(never.created());
        run(never, false, false);
        for (const bool told : {true, false}) {
          SCOPED_TRACE(std::string(schedule_name(schedule)) + " " + std::string(dtype_name(dtype)) +
                       (in_place ? " in place" : " staged") + (told ? ", told" : ""));
          Trainer trainer(schedule, dtype, {}, 1, sizes, nullptr, 0, in_place);
          ASSERT_TRUE(trainer.created());
          run(trainer, true, told);
          expect_bitwise_equal(never.result(), trainer.result());
          EXPECT_EQ(trainer.opt().param_step_count(kAbsent), 5);
        }
      }
    }
  }
}

// A gradient handed over where the framework allocated it (set_grad_source) is stepped as if it had been
// written into device_grads: staged and in place, every schedule; refused where the gradient's place is not
// the parameter's own.
TEST(OffloadOptimizer, GradientReadFromAnotherSourceEqualsItsCopy) {
  const GradFn grads = random_grads(1e-2);
  for (const bool in_place : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + (in_place ? " in place" : " staged"));
      Trainer copied(schedule, DType::bf16, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, in_place);
      Trainer moved(schedule, DType::bf16, {}, 0, {1000, 37, 4096, 1}, nullptr, 0, in_place);
      ASSERT_TRUE(copied.created() && moved.created());
      copied.run(1, 3, grads);
      // `moved` gets the same gradients in buffers of its own device, switched every iteration.
      const ParamSpec& p = moved.model().specs[2];
      const std::size_t bytes = p.n * 2;
      std::vector<void*> sources = {moved.device().allocate(bytes).value(), moved.device().allocate(bytes).value()};
      for (int t = 1; t <= 3; ++t) {
        ASSERT_TRUE(moved.device_synchronize().ok());
        grads(moved.model(), t, moved.opt().loss_scale());
        void* source = sources[t % 2];
        std::memcpy(source, p.device_grads, bytes);
        std::memset(const_cast<void*>(p.device_grads), 0x7f, bytes);  // huge values: the old place must not be read
        ASSERT_TRUE(moved.opt().set_grad_source(2, source).ok());
        for (std::size_t b = moved.model().specs.size(); b-- > 0;) ASSERT_TRUE(moved.opt().grad_ready(b).ok());
        const Status s = moved.opt().step();
        ASSERT_TRUE(s.ok()) << s.to_string();
        ASSERT_TRUE(moved.opt().set_grad_source(2, p.device_grads).ok());
      }
      const RunResult a = copied.result(), b = moved.result();
      EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0);
      EXPECT_EQ(a.device_weights, b.device_weights);
      for (void* source : sources) moved.device().free(source);
    }
  }
  Trainer trainer(Schedule::sync, DType::bf16, {});
  EXPECT_EQ(trainer.opt().set_grad_source(99, trainer.model().specs[0].device_grads).code(), StatusCode::invalid_argument);
  EXPECT_EQ(trainer.opt().set_grad_source(0, nullptr).code(), StatusCode::invalid_argument);
}

TEST(OffloadOptimizer, LossScaleStateIsReadAndReplaced) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.growth_interval = 3;
  Trainer t(Schedule::sync, DType::f16, o, 0, {64, 5});
  ASSERT_TRUE(t.created());
  t.run(1, 4, random_grads(1e-2));
  const LossScaleState grown = t.opt().loss_scale_state();
  EXPECT_EQ(grown.scale, 2048.0f);  // grown after 3 clean steps
  EXPECT_EQ(grown.clean_steps, 1);
  ASSERT_TRUE(t.opt().set_loss_scale_state({64.0f, 2, 1}).ok());
  EXPECT_EQ(t.opt().loss_scale(), 64.0f);
  const LossScaleState set = t.opt().loss_scale_state();
  EXPECT_EQ(set.scale, 64.0f);
  EXPECT_EQ(set.clean_steps, 2);
  EXPECT_EQ(set.hysteresis_left, 1);
  for (const LossScaleState& bad : {LossScaleState{NAN, 0, 1}, LossScaleState{0.0f, 0, 1},
                                    LossScaleState{8.0f, -1, 1}, LossScaleState{8.0f, 0, -2}}) {
    EXPECT_EQ(t.opt().set_loss_scale_state(bad).code(), StatusCode::invalid_argument);
  }
  EXPECT_EQ(t.opt().loss_scale_state().scale, 64.0f);
  t.run(5, 5, random_grads(1e-2));
  EXPECT_EQ(t.opt().loss_scale(), 128.0f);  // the third clean step since the set state grows it
  Trainer unscaled(Schedule::sync, DType::bf16, {}, 0, {64});
  ASSERT_TRUE(unscaled.created());
  EXPECT_EQ(unscaled.opt().set_loss_scale_state({8.0f, 0, 1}).code(), StatusCode::invalid_argument);
  EXPECT_EQ(unscaled.opt().loss_scale(), 1.0f);
}

}  // namespace
}  // namespace zoe
