// Test oracle: torch.optim.Adam/AdamW in float64, plus deterministic data and tolerance helpers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "zoe/adam.h"

namespace zoe::test {

// |got - want| <= rel * |want| + abs
struct Tolerance {
  double rel, abs;
  bool accepts(double got, double want) const {
    if (std::isnan(want)) return std::isnan(got);
    return std::fabs(got - want) <= rel * std::fabs(want) + abs;
  }
};

// fp32 state against float64 state after 20 steps: a few ulps per step, accumulated. abs parts sit far
// below each quantity's scale here (p ~ 1, m ~ 1e-2, v ~ 1e-4).
inline constexpr Tolerance kParamTol{1e-5, 1e-7};
inline constexpr Tolerance kExpAvgTol{1e-5, 1e-9};
inline constexpr Tolerance kExpAvgSqTol{1e-5, 1e-12};

// A sum of squares against its float64 sum. The kernels add squares in float partial sums of at most
// 1024 / (4 x lanes) terms (all positive), then in double: the relative error is at most that count x 2^-24
// (1.5e-5 for scalar's 256 terms) and typically its square root x 2^-24 (1e-6), where random values lie.
inline constexpr double kSumSqRelTol = 1e-5;

struct RefState {
  std::vector<double> p, m, v;
};

inline void reference_step(const AdamHyper& h, const StepOptions& o, RefState& s, const std::vector<double>& grad) {
  const double t = static_cast<double>(o.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(double(h.beta1), t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(double(h.beta2), t) : 1.0;
  for (std::size_t i = 0; i < s.p.size(); ++i) {
    double g = grad[i] * double(o.grad_scale);
    if (!h.adamw && h.weight_decay != 0) g += double(h.weight_decay) * s.p[i];
    s.m[i] += (1.0 - double(h.beta1)) * (g - s.m[i]);
    s.v[i] = double(h.beta2) * s.v[i] + (1.0 - double(h.beta2)) * g * g;
    if (h.adamw) s.p[i] *= 1.0 - double(h.lr) * double(h.weight_decay);
    const double denom = std::sqrt(s.v[i]) / std::sqrt(bc2) + double(h.eps);
    s.p[i] -= double(h.lr) / bc1 * s.m[i] / denom;
  }
}

// Deterministic uniform values in [lo, hi).
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  double uniform(double lo, double hi) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return lo + (hi - lo) * static_cast<double>(state_ >> 11) * (1.0 / 9007199254740992.0);
  }

 private:
  std::uint64_t state_;
};

// A gradient buffer holding values in one dtype, and the exact values it holds as doubles.
struct GradData {
  std::vector<unsigned char> bytes;
  std::vector<double> values;
};

inline GradData make_grad(DType dtype, std::size_t n, Random& rng, double scale, std::size_t offset_elems = 0) {
  GradData g;
  g.bytes.assign((n + offset_elems) * dtype_size(dtype), 0);
  g.values.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(rng.uniform(-scale, scale));
    unsigned char* dst = g.bytes.data() + (i + offset_elems) * dtype_size(dtype);
    if (dtype == DType::f32) {
      std::memcpy(dst, &x, 4);
      g.values[i] = x;
    } else {
      const std::uint16_t h = dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
      std::memcpy(dst, &h, 2);
      g.values[i] = dtype == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
    }
  }
  return g;
}

inline const void* grad_ptr(const GradData& g, DType dtype, std::size_t offset_elems = 0) {
  return g.bytes.data() + offset_elems * dtype_size(dtype);
}

}  // namespace zoe::test
