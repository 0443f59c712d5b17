// DeepSpeed's learning-rate schedules (zoe/lr_schedule.h has the formulas and when each value applies).
#include "zoe/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace zoe {
namespace {

// The warmup's fraction at i < W (W = max(2, warmup_num_steps)).
double warmup_gamma(const LrSchedule& s, std::int64_t i) {
  const double w = static_cast<double>(std::max<std::int64_t>(2, s.warmup_num_steps));
  return s.warmup_linear ? static_cast<double>(i) / w : std::log(static_cast<double>(i + 1)) / std::log(w);
}

LrSchedule::Point one_cycle(const LrSchedule& s, std::int64_t i) {
  LrSchedule::Point p;
  const double first = s.cycle_first_step_size;
  const double second = s.cycle_second_step_size < 0 ? first : s.cycle_second_step_size;
  const double total = first + second, step_ratio = first / total;
  p.sets_betas = s.cycle_momentum;
  p.beta2 = 0.99;
  if (i < 0) {  // what the scheduler sets when it is created
    p.lr = s.cycle_min_lr;
    p.beta1 = s.cycle_min_mom;
    return p;
  }
  if (static_cast<double>(i) < total) {
    const double b = static_cast<double>(i + 1);
    const double cycle = std::floor(1.0 + b / total), x = 1.0 + b / total - cycle;
    const double scale = x <= step_ratio ? x / step_ratio : (x - 1.0) / (step_ratio - 1.0);
    p.lr = s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * scale;
    p.beta1 = s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * scale;
    return p;
  }
  const double k = static_cast<double>(i) - total + 1.0;
  const bool no_decay_interval = s.decay_step_size == 0;
  p.lr = no_decay_interval || s.decay_lr_rate == 0 ? s.cycle_min_lr
                                                   : s.cycle_min_lr / (1.0 + s.decay_lr_rate * (k / s.decay_step_size));
  p.beta1 = no_decay_interval || s.decay_mom_rate == 0 ? s.cycle_max_mom
                                                       : s.cycle_max_mom * (1.0 + s.decay_mom_rate * (k / s.decay_step_size));
  return p;
}

}  // namespace

std::string_view lr_schedule_name(LrSchedule::Type type) {
  switch (type) {
    case LrSchedule::Type::warmup_lr: return "WarmupLR";
    case LrSchedule::Type::warmup_decay_lr: return "WarmupDecayLR";
    case LrSchedule::Type::warmup_cosine_lr: return "WarmupCosineLR";
    case LrSchedule::Type::one_cycle: return "OneCycle";
  }
  return "invalid";
}

LrSchedule::Point LrSchedule::at(std::int64_t i, std::size_t group, double group_lr) const {
  Point p;
  const std::int64_t w = std::max<std::int64_t>(2, warmup_num_steps);
  const double delta = warmup_max_lr - warmup_min_lr;
  switch (type) {
    case Type::warmup_lr:
      p.lr = i < 0 ? warmup_min_lr : warmup_min_lr + delta * (i < w ? warmup_gamma(*this, i) : 1.0);
      break;
    case Type::warmup_decay_lr: {
      double gamma = 0;
      if (i >= 0) {
        gamma = i < w ? warmup_gamma(*this, i)
                      : std::max(0.0, static_cast<double>(total_num_steps - i) /
                                          std::max(1.0, static_cast<double>(total_num_steps - w)));
      }
      p.lr = warmup_min_lr + delta * gamma;
      break;
    }
    case Type::warmup_cosine_lr: {
      if (i < 0) {
        p.lr = group == 0 ? 0.0 : group_lr;
        break;
      }
      double ratio;
      if (i < w) {
        ratio = warmup_min_ratio + warmup_gamma(*this, i) * (1.0 - warmup_min_ratio);
      } else {
        const double done = static_cast<double>(i - w + 1), span = static_cast<double>(total_num_steps - w);
        ratio = std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + std::cos(std::numbers::pi * done / span)) / 2.0);
      }
      p.lr = group_lr * ratio;
      break;
    }
    case Type::one_cycle:
      return one_cycle(*this, i);
  }
  return p;
}

void LrSchedule::apply(OffloadOptimizer& opt, const std::vector<double>& group_lrs) const {
  for (std::size_t g = 0; g < group_lrs.size(); ++g) {
    const Point p = for_next_step(opt.step_count(), g, group_lrs[g]);
    OptimizerHyper& h = opt.group_hyper(g);
    h.lr = static_cast<float>(p.lr);
    if (p.sets_betas) {
      h.beta1 = static_cast<float>(p.beta1);
      h.beta2 = static_cast<float>(p.beta2);
    }
  }
}

}  // namespace zoe
