// abandon_iteration(): a trainer whose backward ended in an exception after reporting some parameters gives
// the iteration up and runs it again. The device weights must be back at once (the overlap schedule stepped
// the reported parameters speculatively; the delayed schedule sent them the previous step's weights), and
// the run must end with the bits of one never interrupted.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/offload/trainer.h"
#include "zoe/offload.h"

namespace zoe {
namespace {

using namespace test;  // NOLINT: the trainer, its results and gradient makers

const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1};
constexpr int kWarmup = 2;  // the delayed schedule's sync steps: iterations 3 and 4 step in the background

struct Case {
  Schedule schedule;
  DType dtype;
  bool cpu_device;
  int micro_batches;
  std::string name() const {
    return std::string(schedule_name(schedule)) + " " + std::string(dtype_name(dtype)) +
           (cpu_device ? " in place" : " staged") + ", " + std::to_string(micro_batches) + " micro-batch(es)";
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Schedule s : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    for (DType d : {DType::f32, DType::bf16}) {
      for (bool cpu : {false, true}) {
        for (int k : {1, 2}) out.push_back({s, d, cpu, k});
      }
    }
  }
  return out;
}

OffloadOptions options(const Case& c) {
  OffloadOptions o;
  o.gradient_accumulation_steps = c.micro_batches;
  return o;
}

void train(Trainer& t, const Case& c, int first, int last) {
  if (c.micro_batches == 1) {
    t.run(first, last, random_grads(1e-2));
  } else {
    t.run_accumulating(first, last, c.micro_batches, random_grads(1e-2));
  }
}

TEST(AbandonedIteration, PutsTheWeightsBackAndTheRetryEqualsAnUninterruptedRun) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name());
    Trainer reference(c.schedule, c.dtype, options(c), kWarmup, kSizes, nullptr, 0, c.cpu_device);
    train(reference, c, 1, 8);

    Trainer t(c.schedule, c.dtype, options(c), kWarmup, kSizes, nullptr, 0, c.cpu_device);
    train(t, c, 1, 4);
    ASSERT_TRUE(t.device_synchronize().ok());
    const std::vector<unsigned char> before = t.model().weights();
    // Iteration 5, given up in its last micro-batch after backward reported the last two parameters.
    const GradFn grads = random_grads(1e-2);
    for (int j = 1; j <= c.micro_batches; ++j) {
      ASSERT_TRUE(t.device_synchronize().ok());
      grads(t.model(), c.micro_batches == 1 ? 5 : 500 + j, t.opt().loss_scale());
      const std::size_t stop = j == c.micro_batches ? 2 : 0;
      for (std::size_t b = kSizes.size(); b-- > stop;) {
        const Status s = t.opt().grad_ready(b);
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
    }
    ASSERT_TRUE(t.device_synchronize().ok());  // the stand-in's copies up, before the weights are read
    const Status abandoned = t.opt().abandon_iteration();
    ASSERT_TRUE(abandoned.ok()) << abandoned.to_string();
    ASSERT_TRUE(t.device_synchronize().ok());
    EXPECT_EQ(t.model().weights(), before) << "device weights after the abandon";
    train(t, c, 5, 8);
    expect_bitwise_equal(reference.result(), t.result());
  }
}

}  // namespace
}  // namespace zoe
