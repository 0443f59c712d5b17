// DeepSpeed's learning-rate schedules — the DeepSpeed config's "scheduler": {"type": ..., "params": {...}} —
// with DeepSpeed's parameter names, defaults and semantics (deepspeed/runtime/lr_schedules.py), for any
// trainer that drives zoe::OffloadOptimizer. `i` below is the scheduler's last_batch_iteration; W =
// max(2, warmup_num_steps); T = total_num_steps; warmup "log": g = log(i + 1) / log(W), "linear": g = i / W.
//
//   WarmupLR        lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * (i < W ? g : 1)
//   WarmupDecayLR   the same, then (i >= W) lr = min + (max - min) * max(0, (T - i) / max(1, T - W))
//   WarmupCosineLR  lr = the param group's own lr * r: r = warmup_min_ratio + (1 - warmup_min_ratio) * g
//                   for i < W, then cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (i - W + 1) /
//                   (T - W))) / 2, at least 0
//   OneCycle        a triangle between cycle_min_lr and cycle_max_lr (rising over cycle_first_step_size
//                   iterations, falling over cycle_second_step_size), then cycle_min_lr / (1 +
//                   decay_lr_rate * k / decay_step_size) for the k-th iteration after it (no decay when
//                   either is 0). With cycle_momentum, beta1 moves the opposite way between cycle_max_mom and
//                   cycle_min_mom (after the cycle: cycle_max_mom * (1 + decay_mom_rate * k /
//                   decay_step_size)) and beta2 is set to 0.99, as DeepSpeed sets it.
//
// When: DeepSpeed's engine calls the scheduler's step() after every optimizer step that was applied (not one
// skipped for an fp16 overflow), and the scheduler starts at i = -1, the value it sets when it is created.
// So the applied step k (1-based) runs with i = k - 2: for_next_step() takes the number of applied steps so
// far (OffloadOptimizer::step_count()). At i = -1: WarmupLR and WarmupDecayLR give warmup_min_lr; OneCycle
// cycle_min_lr and beta1 = cycle_min_mom; WarmupCosineLR 0 for the first param group and the others' own
// lr (DeepSpeed's get_lr returns one value there, which sets the first group only).
// DeepSpeed also reads cycle_first_stair_count / cycle_second_stair_count and then never uses them: zoe
// accepts them and, like DeepSpeed, has no staircase.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "zoe/offload.h"

namespace zoe {

struct LrSchedule {
  enum class Type { warmup_lr, warmup_decay_lr, warmup_cosine_lr, one_cycle };
  Type type = Type::warmup_lr;
  // WarmupLR, WarmupDecayLR (and the warmup of WarmupCosineLR)
  double warmup_min_lr = 0.0, warmup_max_lr = 0.001;
  std::int64_t warmup_num_steps = 1000;
  bool warmup_linear = false;  // warmup_type "linear"; DeepSpeed's default is "log"
  std::int64_t total_num_steps = 0;  // WarmupDecayLR, WarmupCosineLR: required
  // WarmupCosineLR
  double warmup_min_ratio = 0.0, cos_min_ratio = 0.0001;
  // OneCycle: cycle_min_lr and cycle_max_lr are required
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0, decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000, cycle_second_step_size = -1;  // -1: cycle_first_step_size
  double decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;

  struct Point {
    double lr = 0;
    bool sets_betas = false;  // OneCycle with cycle_momentum
    double beta1 = 0, beta2 = 0;
  };
  // At last_batch_iteration `i` (>= -1), for param group `group` whose configured lr is `group_lr`.
  Point at(std::int64_t i, std::size_t group, double group_lr) const;
  // For the optimizer's next step, after `applied_steps` applied steps.
  Point for_next_step(std::int64_t applied_steps, std::size_t group, double group_lr) const {
    return at(applied_steps - 1, group, group_lr);
  }
  // Sets every param group's lr (and OneCycle's betas) for opt's next step; group_lrs[g] is group g's
  // configured lr (what WarmupCosineLR scales).
  void apply(OffloadOptimizer& opt, const std::vector<double>& group_lrs) const;
};

std::string_view lr_schedule_name(LrSchedule::Type type);  // DeepSpeed's type names: "WarmupLR", ...

}  // namespace zoe
