#include "src/offload/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace zoe {

LossScaler::LossScaler(const LossScaleOptions& options)
    : options_(options),
      scale_(!options.enabled ? 1.0f : options.dynamic ? options.initial_scale : options.static_scale),
      hysteresis_left_(std::max(1, options.hysteresis)) {}

// DeepSpeed's rule: an overflow with hysteresis budget left only spends it; with none left it backs the
// scale off (and keeps backing off on each further overflow) until a growth refills the budget.
void LossScaler::update(bool overflow) {
  if (!options_.enabled || !options_.dynamic) return;
  if (overflow) {
    clean_steps_ = 0;
    if (hysteresis_left_ > 1) {
      --hysteresis_left_;
    } else {
      scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
    }
    return;
  }
  if (options_.consecutive_hysteresis) hysteresis_left_ = std::max(1, options_.hysteresis);
  if (++clean_steps_ >= options_.growth_interval) {
    clean_steps_ = 0;
    hysteresis_left_ = std::max(1, options_.hysteresis);
    // Growth stops at the largest float, as torch's GradScaler stops: an infinite scale makes every
    // gradient overflow, so every later step would be skipped, and backing off from inf stays inf.
    if (const float grown = scale_ * options_.growth_factor; std::isfinite(grown)) scale_ = grown;
  }
}

}  // namespace zoe
