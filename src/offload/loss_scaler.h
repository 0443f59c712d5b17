// fp16 dynamic loss scaling (DeepSpeed's fp16 section, torch's GradScaler): the scale the gradients were
// produced with, and its update after each step from whether the gradients overflowed.
#pragma once

#include "src/private.h"

#include <cstdint>

#include "zoe/offload.h"

namespace zoe {

class LossScaler {
 public:
  explicit LossScaler(const LossScaleOptions& options);

  // 1 when loss scaling is off.
  float scale() const { return scale_; }
  // After a step: an overflow skipped it. Backs off after `hysteresis` overflows; grows after
  // growth_interval clean steps.
  void update(bool overflow);

  // Saved and restored with the optimizer state.
  using State = LossScaleState;
  State state() const { return {scale_, clean_steps_, hysteresis_left_}; }
  void restore(const State& s) {
    scale_ = s.scale;
    clean_steps_ = s.clean_steps;
    hysteresis_left_ = s.hysteresis_left;
  }

 private:
  LossScaleOptions options_;
  float scale_;
  std::int64_t clean_steps_ = 0;
  std::int32_t hysteresis_left_;
};

}  // namespace zoe
