// DeepSpeed's learning-rate schedules (zoe/lr_schedule.h) against tables computed by hand from DeepSpeed's
// formulas, read from a DeepSpeed config, and applied to an OffloadOptimizer step by step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/offload/trainer.h"
#include "zoe/config.h"
#include "zoe/lr_schedule.h"

namespace zoe {
namespace {

// The tables are written to 7 significant digits; the schedule computes in double.
constexpr double kTableTol = 5e-7;

struct Row {
  std::int64_t i;  // the scheduler's last_batch_iteration
  double lr;
};

void expect_table(const LrSchedule& s, const std::vector<Row>& rows, double group_lr = 1.0, std::size_t group = 0) {
  for (const Row& r : rows) {
    EXPECT_NEAR(s.at(r.i, group, group_lr).lr, r.lr, kTableTol * std::max(1.0, std::fabs(r.lr)))
        << lr_schedule_name(s.type) << " at i = " << r.i;
  }
}

LrSchedule parse_schedule(const std::string& json) {
  Result<LoadedConfig> c = parse_config(json, "<test>");
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c.ok() && c->has_scheduler);
  return c.ok() ? c->scheduler : LrSchedule{};
}

TEST(LrSchedule, WarmupLRLogAndLinear) {
  // log: min + (max - min) * ln(i + 1) / ln(4); ln 2 / ln 4 = 0.5, ln 3 / ln 4 = 0.7924813.
  LrSchedule s = parse_schedule(R"({"scheduler": {"type": "WarmupLR", "params":
      {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 4}}})");
  expect_table(s, {{-1, 0.001}, {0, 0.001}, {1, 0.006}, {2, 0.008924813}, {3, 0.011}, {4, 0.011}, {1000, 0.011}});
  s = parse_schedule(R"({"scheduler": {"type": "WarmupLR", "params":
      {"warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  expect_table(s, {{-1, 0.0}, {0, 0.0}, {1, 0.25}, {3, 0.75}, {4, 1.0}, {9, 1.0}});
  // DeepSpeed's defaults: 0 -> 0.001 over 1000 steps, log.
  s = parse_schedule(R"({"scheduler": {"type": "WarmupLR"}})");
  expect_table(s, {{0, 0.0}, {999, 0.001}, {5000, 0.001}});
  // warmup_num_steps below 2 is 2 (DeepSpeed takes max(2, .)): ln 1 / ln 2 = 0, then the max.
  s = parse_schedule(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}})");
  expect_table(s, {{0, 0.0}, {1, 0.001}, {2, 0.001}});
}

TEST(LrSchedule, WarmupDecayLR) {
  // W = 4, T = 10, linear: i / 4 while warming, then (10 - i) / 6, never below 0.
  const LrSchedule s = parse_schedule(R"({"scheduler": {"type": "WarmupDecayLR", "params":
      {"total_num_steps": 10, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  expect_table(s, {{-1, 0.0}, {0, 0.0}, {2, 0.5}, {3, 0.75}, {4, 1.0}, {5, 0.8333333}, {9, 0.1666667}, {10, 0.0}, {12, 0.0}});
}

TEST(LrSchedule, WarmupCosineLR) {
  // Group lr 2.0, W = 4, T = 10, warmup_min_ratio 0.1, cos_min_ratio 0.01, linear.
  // Warmup: ratio = 0.1 + 0.9 * i / 4. Then ratio = 0.01 + 0.99 * (1 + cos(pi * (i - 3) / 6)) / 2:
  // i = 4: cos(pi/6) = 0.8660254 -> 0.9336826; i = 6: cos(pi/2) = 0 -> 0.505; i = 9: cos(pi) = -1 -> 0.01.
  const LrSchedule s = parse_schedule(R"({"scheduler": {"type": "WarmupCosineLR", "params":
      {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.01,
       "warmup_type": "linear"}}})");
  expect_table(s, {{0, 0.2}, {2, 1.1}, {3, 1.55}, {4, 1.867365}, {6, 1.01}, {9, 0.02}}, 2.0);
  // Before its first step DeepSpeed sets only the first group's lr (to 0); the others keep their own.
  EXPECT_EQ(s.at(-1, 0, 2.0).lr, 0.0);
  EXPECT_EQ(s.at(-1, 1, 2.0).lr, 2.0);
  Result<LoadedConfig> bad = parse_config(R"({"scheduler": {"type": "WarmupCosineLR", "params":
      {"total_num_steps": 4, "warmup_num_steps": 4}}})", "<test>");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("must exceed warmup_num_steps"), std::string::npos) << bad.status().message();
}

TEST(LrSchedule, OneCycleWithMomentumAndDecay) {
  // Cycle 0.1 -> 1.0 over 4 iterations and back over 4 (step ratio 0.5); scale at i from b = i + 1:
  // x = b / 8 - floor(b / 8); scale = x / 0.5 rising, (x - 1) / -0.5 falling. Then the decay: k = i - 7,
  // lr = 0.1 / (1 + 0.5 * k / 2). beta1 = 0.9 - 0.1 * scale during the cycle, 0.9 after (no mom decay).
  const LrSchedule s = parse_schedule(R"({"scheduler": {"type": "OneCycle", "params":
      {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_second_step_size": 4,
       "decay_lr_rate": 0.5, "decay_step_size": 2, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}}})");
  expect_table(s, {{-1, 0.1}, {0, 0.325}, {1, 0.55}, {3, 1.0}, {5, 0.55}, {6, 0.325}, {7, 0.1}, {8, 0.08}, {11, 0.05}});
  const std::vector<std::pair<std::int64_t, double>> beta1 = {{-1, 0.8}, {0, 0.875}, {3, 0.8}, {5, 0.85}, {8, 0.9}};
  for (const auto& [i, b] : beta1) {
    const LrSchedule::Point p = s.at(i, 0, 1.0);
    EXPECT_TRUE(p.sets_betas);
    EXPECT_NEAR(p.beta1, b, kTableTol) << "i = " << i;
    EXPECT_EQ(p.beta2, 0.99);
  }
  Result<LoadedConfig> missing = parse_config(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}})", "<t>");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("scheduler.params.cycle_min_lr is missing"), std::string::npos);
}

TEST(LrSchedule, BadConfigsNameTheKey) {
  for (const auto& [json, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"({"scheduler": {"params": {}}})", "scheduler.type is missing"},
           {R"({"scheduler": {"type": "Cosine"}})", "scheduler.type = \"Cosine\""},
           {R"({"scheduler": {"type": "LRRangeTest"}})", "LRRangeTest"},
           {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})", "total_num_steps is missing"},
           {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})", "warmup_type"},
           {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -1}}})", "warmup_max_lr"},
           {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})", "Hugging Face"}}) {
    Result<LoadedConfig> c = parse_config(json, "<test>");
    ASSERT_FALSE(c.ok()) << json;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
  }
  // DeepSpeed's resume counter is reported, not used: the schedule follows the optimizer's steps.
  Result<LoadedConfig> c = parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}})", "<t>");
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->notes.size(), 1u);
  EXPECT_NE(c->notes[0].find("last_batch_iteration"), std::string::npos);
}

// apply() before each step: the applied step k runs with i = k - 2 (DeepSpeed steps the scheduler after each
// applied optimizer step, from -1); an fp16 overflow skips a step and the schedule waits with it.
TEST(LrSchedule, ApplyFollowsTheAppliedSteps) {
  const LrSchedule s = parse_schedule(R"({"scheduler": {"type": "WarmupLR", "params":
      {"warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  test::Trainer t(Schedule::sync, DType::f16, o, 0, {64, 5});
  ASSERT_TRUE(t.created());
  std::vector<float> used;
  const test::GradFn grads = test::random_grads(1e-2, {2});  // iteration 2 overflows
  for (int it = 0; it < 5; ++it) {
    s.apply(t.opt(), {1.0});
    used.push_back(t.opt().group_hyper(0).lr);
    t.run(it, it, grads);
  }
  // Iterations 0, 1 are steps 1, 2 (i = -1, 0); iteration 2 overflows (skipped, still i = 1); 3, 4 are
  // steps 3, 4 (i = 1, 2).
  EXPECT_EQ(used, (std::vector<float>{0.0f, 0.0f, 0.25f, 0.25f, 0.5f}));
  EXPECT_EQ(t.opt().step_count(), 4);
}

}  // namespace
}  // namespace zoe
