// Gradient accumulation on the host (OffloadOptions::gradient_accumulation_steps): every schedule and
// device steps the fp32 sum of the micro-batches, leaves the rounded sum in the device's buffer for the
// trainer, zeroes the buffer between micro-batches, and refuses what cannot be right.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/offload/trainer.h"
#include "tests/reference.h"
#include "zoe/offload.h"
#include "zoe/partition.h"

namespace zoe {
namespace {

using namespace test;  // NOLINT: the trainer, its results and gradient makers

const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1};
constexpr int kMicroBatches = 3;

// Micro-batch gradients, drawn as random_grads draws them, as floats (exact in bf16 only when rounded there).
std::vector<std::vector<float>> draw(const std::vector<std::size_t>& sizes, int tj, double magnitude = 1e-2) {
  Random rng(1000 + tj);
  std::vector<std::vector<float>> out;
  for (std::size_t n : sizes) {
    std::vector<float> g(n);
    for (float& x : g) x = static_cast<float>(rng.uniform(-magnitude, magnitude));
    out.push_back(g);
  }
  return out;
}

// The device's value of a drawn gradient (rounded to its dtype by DeviceParams::set).
float stored(const DeviceParams& model, float x) {
  std::vector<unsigned char> b(4);
  model.set(b.data(), 0, x);
  return model.get(b.data(), 0);
}

// One step's gradient as the engine must sum it: the micro-batches as the device stores them, added in fp32
// in micro-batch order (acc = g1; acc += g2; ...: one IEEE rounding per addition).
GradFn summed(int k) {
  return [k](DeviceParams& model, int t, float scale) {
    for (int j = 1; j <= k; ++j) {
      const auto g = draw(kSizes, t * 100 + j);
      for (std::size_t p = 0; p < model.specs.size(); ++p) {
        void* grads = const_cast<void*>(model.specs[p].device_grads);
        for (std::size_t i = 0; i < g[p].size(); ++i) {
          const float x = stored(model, g[p][i] * scale);
          model.set(grads, i, j == 1 ? x : model.get(grads, i) + x);
        }
      }
    }
  };
}

RunResult accumulate(Schedule s, bool cpu, OffloadOptions o, int k = kMicroBatches,
                     const Trainer::AfterBackward& after = nullptr) {
  o.gradient_accumulation_steps = k;
  Trainer trainer(s, DType::f32, o, 2, kSizes, nullptr, 0, cpu);
  trainer.run_accumulating(1, 6, k, random_grads(1e-2), after);
  return trainer.result();
}

RunResult on_the_sum(Schedule s, bool cpu, const OffloadOptions& o, int k = kMicroBatches) {
  Trainer trainer(s, DType::f32, o, 2, kSizes, nullptr, 0, cpu);
  trainer.run(1, 6, summed(k));
  return trainer.result();
}

// f32 parameters: the sum the engine keeps is bit for bit the one computed here, so every schedule, on the
// host stand-in and in place on the CPU, gives the state of stepping that sum without accumulation.
TEST(Accumulation, EveryScheduleStepsTheFp32SumOfTheMicroBatches) {
  OffloadOptions o;
  o.max_grad_norm = 0.05f;  // clipping of the summed gradient: the norm is taken over the sum
  for (Schedule s : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    for (bool cpu : {false, true}) {
      SCOPED_TRACE(std::string(schedule_name(s)) + (cpu ? " in place" : " staged"));
      const RunResult got = accumulate(s, cpu, o);
      expect_bitwise_equal(on_the_sum(s, cpu, o), got);
      EXPECT_EQ(got.steps, 6);
    }
  }
}

// bf16: the sum is fp32, not bf16. After one step Adam's first moment is (1 - beta1) g exactly rounded, so
// the gradient the engine stepped is exp_avg / (1 - beta1) to within one float rounding (2^-24 relative).
// Against the float64 sum of the same bf16 micro-batches: k - 1 additions of 2^-24 relative each, of the
// running sum's size (bounded by the sum of magnitudes), and the moment's own rounding.
TEST(Accumulation, Bf16MicroBatchesAreSummedInFp32) {
  constexpr int k = 8;
  OffloadOptions o;
  o.gradient_accumulation_steps = k;
  Trainer trainer(Schedule::sync, DType::bf16, o, 0, kSizes);
  double worst = 0, worst_bf16 = 0;
  trainer.run_accumulating(1, 1, k, random_grads(1e-2), [&](DeviceParams& model, OffloadOptimizer&) {
    // The trainer sees the whole step's gradient in the device's buffer, rounded once to bf16.
    for (std::size_t p = 0; p < model.specs.size(); ++p) {
      for (std::size_t i = 0; i < model.specs[p].n; ++i) {
        double exact = 0;
        float in_fp32 = 0;
        for (int j = 1; j <= k; ++j) {
          const float x = stored(model, draw(kSizes, 100 + j)[p][i]);
          exact += x;
          in_fp32 = j == 1 ? x : in_fp32 + x;
        }
        ASSERT_EQ(model.get(model.specs[p].device_grads, i), stored(model, in_fp32)) << p << " " << i;
      }
    }
  });
  const float beta1 = AdamHyper{}.beta1;
  for (std::size_t p = 0; p < kSizes.size(); ++p) {
    if (p == 2) continue;  // the trainer's group 1 is Adam with L2 decay: its moment holds g + decay * p
    std::vector<float> m(kSizes[p]);
    ASSERT_TRUE(trainer.opt().read_state(p, nullptr, m.data(), nullptr).ok());
    for (std::size_t i = 0; i < kSizes[p]; ++i) {
      double exact = 0, magnitude = 0;
      float bf16_sum = 0;  // what accumulating in the device's dtype gives
      for (int j = 1; j <= k; ++j) {
        const float x = stored(trainer.model(), draw(kSizes, 100 + j)[p][i]);
        exact += x;
        magnitude += std::fabs(x);
        bf16_sum = stored(trainer.model(), bf16_sum + x);
      }
      const double stepped = m[i] / (1.0 - beta1);
      const double bound = (k - 1) * std::ldexp(magnitude, -24) + std::ldexp(std::fabs(exact), -22);
      ASSERT_LE(std::fabs(stepped - exact), bound) << p << " " << i;
      if (magnitude > 0) {
        worst = std::max(worst, std::fabs(stepped - exact) / magnitude);
        worst_bf16 = std::max(worst_bf16, std::fabs(bf16_sum - exact) / magnitude);
      }
    }
  }
  std::printf("8 bf16 micro-batches: error of the summed gradient relative to the sum of magnitudes: zoe fp32 %.2e, "
              "accumulating in bf16 %.2e\n", worst, worst_bf16);
  EXPECT_LT(worst, 1e-6);
}

// A trainer that clips the (rounded) sum it sees and tells zoe: that edited gradient is the step's.
TEST(Accumulation, ChangedGradsReplaceTheSum) {
  for (Schedule s : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(std::string(schedule_name(s)));
    const GradFn halved_sum = [](DeviceParams& model, int t, float scale) { summed(kMicroBatches)(model, t, scale * 0.5f); };
    Trainer reference(s, DType::f32, {}, 2, kSizes);
    reference.run(1, 6, halved_sum);
    const RunResult edited = accumulate(s, false, {}, kMicroBatches, [](DeviceParams& model, OffloadOptimizer& opt) {
      for (const ParamSpec& p : model.specs) {
        for (std::size_t i = 0; i < p.n; ++i) model.set(const_cast<void*>(p.device_grads), i, model.get(p.device_grads, i) * 0.5f);
      }
      ASSERT_TRUE(opt.grads_changed().ok());
    });
    expect_bitwise_equal(reference.result(), edited);
  }
}

// A parameter unused in the last micro-batches (reported fewer than k times) has its last gradient taken at
// step(): here parameter 1 reports only in micro-batch 1, parameter 3 never.
TEST(Accumulation, ParametersReportedFewerTimesAreTakenAtStep) {
  OffloadOptions o;
  o.gradient_accumulation_steps = kMicroBatches;
  for (Schedule s : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(s)));
    Trainer trainer(s, DType::f32, o, 0, kSizes);
    // What the device holds for them at step(): parameter 1 the zeros left after micro-batch 1 plus the
    // unreported writes of micro-batches 2 and 3, parameter 3 whatever micro-batch 3 wrote.
    trainer.run_accumulating(1, 4, kMicroBatches, random_grads(1e-2), nullptr,
                             [](std::size_t param, int j) { return param != 3 && (param != 1 || j == 1); });
    const RunResult got = trainer.result();
    EXPECT_EQ(got.steps, 4);
    for (float x : got.state) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(Accumulation, RefusesWhatCannotBeRight) {
  OffloadOptions o;
  o.gradient_accumulation_steps = 2;
  Trainer trainer(Schedule::overlap, DType::bf16, o, 0, kSizes);
  random_grads(1e-2)(trainer.model(), 1, 1.0f);
  for (int j = 0; j < 2; ++j) ASSERT_TRUE(trainer.opt().grad_ready(0).ok());
  const Status third = trainer.opt().grad_ready(0);
  EXPECT_EQ(third.code(), StatusCode::invalid_argument);
  EXPECT_NE(third.message().find("gradient_accumulation_steps = 2"), std::string::npos) << third.message();
  const Status step = trainer.opt().step();
  EXPECT_TRUE(step.ok()) << step.to_string();

  std::unique_ptr<Device> device = make_host_device();
  DeviceParams model(*device, DType::bf16, kSizes, 1);
  o.gradient_accumulation_steps = 0;
  EXPECT_FALSE(OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o).ok());
  o.gradient_accumulation_steps = 2;
  std::shared_ptr<HostGroup> group = make_host_group(2);
  Result<std::unique_ptr<Collectives>> rank0 = make_host_collectives(group, *device, 0);
  ASSERT_TRUE(rank0.ok());
  const Result<OffloadOptimizer> partitioned = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o, rank0.value().get());
  EXPECT_EQ(partitioned.status().code(), StatusCode::unsupported) << partitioned.status().to_string();
}

}  // namespace
}  // namespace zoe
