// Every kernel table this CPU runs x every gradient dtype x every copy-out dtype, against the float64
// reference over 20 steps, at the sizes where vector code goes wrong, with unaligned pointers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "tests/reference.h"
#include "tests/simd/kernel_variants.h"

namespace zoe::simd {
namespace {

using test::GradData;
using test::Random;
using test::RefState;

constexpr int kSteps = 20;

using test::kVariants;
using test::Variant;
using test::skip_reason;

using Param = std::tuple<int /*variant*/, DType /*grad*/, int /*OutElem*/>;

// The kernel's per-step scalars, as cpu_adam.cpp derives them.
AdamConstants constants_of(const AdamHyper& h, int step, float grad_scale) {
  AdamConstants c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(double(h.beta1), step) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(double(h.beta2), step) : 1.0;
  c.neg_step_size = static_cast<float>(-double(h.lr) / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = h.eps;
  c.decay = h.adamw ? static_cast<float>(1.0 - double(h.lr) * h.weight_decay) : 1.0f;
  c.l2 = h.adamw ? 0.0f : h.weight_decay;
  c.grad_scale = grad_scale;
  return c;
}

class AdamKernel : public ::testing::TestWithParam<Param> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  DType grad_dtype() const { return std::get<1>(GetParam()); }
  int out_elem() const { return std::get<2>(GetParam()); }

  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }

  // Runs kSteps steps over n elements whose arrays start `offset` elements past an allocation, and checks
  // p, m, v against the reference after each step, and the copy-out against the kernel's own p.
  void check(std::size_t n, std::size_t offset, const AdamHyper& h, float grad_scale) {
    const KernelTable& table = variant().table();
    Random rng(n * 31 + offset);
    std::vector<float> p(n + offset), m(n + offset, 0.0f), v(n + offset, 0.0f);
    std::vector<std::uint16_t> out(n + offset, 0);
    RefState ref{std::vector<double>(n), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
    for (std::size_t i = 0; i < n; ++i) {
      p[offset + i] = static_cast<float>(rng.uniform(-1.0, 1.0));
      ref.p[i] = p[offset + i];
    }
    for (int step = 1; step <= kSteps; ++step) {
      const GradData g = test::make_grad(grad_dtype(), n, rng, 1e-2, offset);
      StepOptions o;
      o.step = step;
      o.grad_scale = grad_scale;
      const AdamConstants c = constants_of(h, step, grad_scale);
      table.adam[int(grad_dtype())][out_elem()][kStateF32](c, test::in_place(p.data() + offset, m.data() + offset, v.data() + offset),
                                                p.data() + offset, m.data() + offset, v.data() + offset,
                                                test::grad_ptr(g, grad_dtype(), offset),
                                                out_elem() == kOutNone ? nullptr : out.data() + offset, n);
      test::reference_step(h, o, ref, g.values);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(test::kParamTol.accepts(p[offset + i], ref.p[i]))
            << "p[" << i << "] = " << p[offset + i] << ", reference " << ref.p[i] << " at step " << step;
        ASSERT_TRUE(test::kExpAvgTol.accepts(m[offset + i], ref.m[i]))
            << "m[" << i << "] = " << m[offset + i] << ", reference " << ref.m[i] << " at step " << step;
        ASSERT_TRUE(test::kExpAvgSqTol.accepts(v[offset + i], ref.v[i]))
            << "v[" << i << "] = " << v[offset + i] << ", reference " << ref.v[i] << " at step " << step;
        if (out_elem() != kOutNone) {
          const float pi = p[offset + i];
          const std::uint16_t want = out_elem() == kOutF16 ? float_to_f16(pi) : float_to_bf16(pi);
          ASSERT_EQ(out[offset + i], want) << "out[" << i << "] for p = " << pi << " at step " << step;
        }
      }
    }
    // Nothing outside [offset, offset + n) was written.
    for (std::size_t i = 0; i < offset; ++i) {
      ASSERT_EQ(m[i], 0.0f);
      ASSERT_EQ(out[i], 0);
    }
  }
};

AdamHyper adamw_hyper() {
  AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.01f;
  return h;
}

TEST_P(AdamKernel, EdgeSizesMatchReference) {
  const std::size_t lanes = variant().table().lanes;
  for (std::size_t n : {std::size_t(0), std::size_t(1), lanes - 1, lanes, lanes + 1, 2 * lanes + 3}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    check(n, 0, adamw_hyper(), 1.0f);
  }
}

TEST_P(AdamKernel, LargeOddSizeUnalignedMatchesReference) { check(100'003, 1, adamw_hyper(), 1.0f); }

TEST_P(AdamKernel, AdamWithL2AndGradScaleMatchesReference) {
  AdamHyper h = adamw_hyper();
  h.adamw = false;
  h.weight_decay = 0.1f;
  check(1'001, 3, h, 0.25f);
}

TEST_P(AdamKernel, NoBiasCorrectionMatchesReference) {
  AdamHyper h = adamw_hyper();
  h.bias_correction = false;
  h.beta1 = 0.8f;
  h.beta2 = 0.95f;
  h.eps = 1e-6f;
  check(777, 0, h, 1.0f);
}

TEST_P(AdamKernel, AgreesWithScalarKernel) {
  // Same inputs through this ISA and the scalar kernel: after one step, within a few ulps of each input's
  // scale (p ~ 1, m ~ 1e-2, v ~ 1e-4): FMA contraction and cancellation in the moment updates differ.
  const KernelTable& table = variant().table();
  const std::size_t n = 4099;
  Random rng(11);
  std::vector<float> p(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = static_cast<float>(rng.uniform(-1, 1));
    m[i] = static_cast<float>(rng.uniform(-1e-2, 1e-2));
    v[i] = static_cast<float>(rng.uniform(0, 1e-4));
  }
  auto p2 = p, m2 = m, v2 = v;
  GradData g = test::make_grad(grad_dtype(), n, rng, 1e-2);
  AdamConstants c{0.9f, 0.1f, 0.999f, 0.001f, -0.0123f, 1.3f, 1e-8f, 0.9999f, 0.0f, 0.5f};
  std::vector<std::uint16_t> o1(n), o2(n);
  const int out = out_elem();
  table.adam[int(grad_dtype())][out][kStateF32](c, test::in_place(p.data(), m.data(), v.data()), p.data(), m.data(), v.data(),
                                                g.bytes.data(), o1.data(), n);
  scalar::table().adam[int(grad_dtype())][out][kStateF32](c, test::in_place(p2.data(), m2.data(), v2.data()), p2.data(),
                                                          m2.data(), v2.data(), g.bytes.data(), o2.data(), n);
  for (std::size_t i = 0; i < n; ++i) {
    constexpr double kUlps = 8 * 6e-8;
    ASSERT_NEAR(p[i], p2[i], kUlps * 1.0) << i;
    ASSERT_NEAR(m[i], m2[i], kUlps * 1e-2) << i;
    ASSERT_NEAR(v[i], v2[i], kUlps * 1e-4) << i;
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  static const char* kOut[] = {"none", "f16", "bf16"};
  return std::string(kVariants[std::get<0>(info.param)].token) + "_" +
         std::string(dtype_name(std::get<1>(info.param))) + "_out_" + kOut[std::get<2>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamKernel,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16),
                                            ::testing::Values(int(kOutNone), int(kOutF16), int(kOutBF16))),
                         param_name);

// bf16 moments (AdamTensor::state_dtype): each step starts from the kernel's own stored state, computes in
// fp32, and stores m and v rounded to bf16. Checked step by step against float64 from the same state: p
// within kParamTol (the update uses the unrounded fp32 moments), m and v within one bf16 ulp of the float64
// values (2^-7 relative: fp32 and float64 may round to either neighbour of a value between two bf16s). And
// the same bits whatever the split of the array into calls (what tiles and threads do).
class AdamKernelBf16State : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  DType grad_dtype() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(AdamKernelBf16State, EachStepMatchesFloat64FromItsOwnRoundedState) {
  const KernelTable& table = variant().table();
  constexpr test::Tolerance kBf16Ulp{0x1p-7, 1e-30};
  const std::size_t n = 3 * table.lanes * 37 + 5;  // whole vectors and a tail
  Random rng(77);
  std::vector<float> p(n), p_split(n);
  std::vector<std::uint16_t> m(n, 0), v(n, 0), m_split(n, 0), v_split(n, 0), out(n), out_split(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = p_split[i] = static_cast<float>(rng.uniform(-1.0, 1.0));
  const std::size_t cut = table.lanes * 5 + 3;  // mid-vector: the tail path on one side, an odd start on the other
  const AdamHyper h = adamw_hyper();
  for (int step = 1; step <= kSteps; ++step) {
    const GradData g = test::make_grad(grad_dtype(), n, rng, 1e-2, 0);
    StepOptions o;
    o.step = step;
    RefState ref{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
    for (std::size_t i = 0; i < n; ++i) {
      ref.p[i] = p[i];
      ref.m[i] = bf16_to_float(m[i]);
      ref.v[i] = bf16_to_float(v[i]);
    }
    const AdamConstants c = constants_of(h, step, 1.0f);
    table.adam[int(grad_dtype())][kOutBF16][kStateBF16](c, test::in_place(p.data(), m.data(), v.data()), p.data(), m.data(), v.data(),
                                                         test::grad_ptr(g, grad_dtype(), 0), out.data(), n);
    const AdamFn fn = table.adam[int(grad_dtype())][kOutBF16][kStateBF16];
    const auto* gb = static_cast<const unsigned char*>(test::grad_ptr(g, grad_dtype(), 0));
    fn(c, test::in_place(p_split.data(), m_split.data(), v_split.data()), p_split.data(), m_split.data(),
       v_split.data(), gb, out_split.data(), cut);
    fn(c, test::in_place(p_split.data() + cut, m_split.data() + cut, v_split.data() + cut), p_split.data() + cut,
       m_split.data() + cut, v_split.data() + cut, gb + cut * dtype_size(grad_dtype()), out_split.data() + cut, n - cut);
    test::reference_step(h, o, ref, g.values);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(test::kParamTol.accepts(p[i], ref.p[i])) << "p[" << i << "] at step " << step;
      ASSERT_TRUE(kBf16Ulp.accepts(bf16_to_float(m[i]), ref.m[i]))
          << "m[" << i << "] = " << bf16_to_float(m[i]) << ", float64 " << ref.m[i] << " at step " << step;
      ASSERT_TRUE(kBf16Ulp.accepts(bf16_to_float(v[i]), ref.v[i]))
          << "v[" << i << "] = " << bf16_to_float(v[i]) << ", float64 " << ref.v[i] << " at step " << step;
      ASSERT_EQ(out[i], float_to_bf16(p[i]));
    }
    ASSERT_EQ(p, p_split) << "step " << step;
    ASSERT_EQ(m, m_split) << "step " << step;
    ASSERT_EQ(v, v_split) << "step " << step;
    ASSERT_EQ(out, out_split) << "step " << step;
  }
}

std::string bf16_state_name(const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
  return std::string(kVariants[std::get<0>(info.param)].token) + "_grad_" + std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamKernelBf16State,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16)),
                         bf16_state_name);

// Tests that do not depend on the dtype combination, once per kernel table.
class KernelTableTest : public ::testing::TestWithParam<int> {
 protected:
  const Variant& variant() const { return kVariants[GetParam()]; }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(KernelTableTest, NonFiniteGradientsPropagateAsInTorch) {
  const KernelTable& table = variant().table();
  const std::size_t n = 3 * table.lanes + 1;
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n, 0.01f);
  g[1] = NAN;
  g[n - 1] = INFINITY;
  AdamConstants c{0.9f, 0.1f, 0.999f, 0.001f, -0.01f, 1.0f, 1e-8f, 1.0f, 0.0f, 1.0f};
  table.adam[kF32][kOutNone][kStateF32](c, test::in_place(p.data(), m.data(), v.data()), p.data(), m.data(), v.data(),
                                        g.data(), nullptr, n);
  EXPECT_TRUE(std::isnan(p[1]));
  EXPECT_TRUE(std::isnan(m[1]));
  EXPECT_TRUE(std::isnan(p[n - 1]));  // inf / inf in the update, as torch computes it
  EXPECT_TRUE(std::isinf(v[n - 1]));
  EXPECT_TRUE(std::isfinite(p[0]));
  EXPECT_TRUE(std::isfinite(p[n - 2]));
}

TEST_P(KernelTableTest, CountsNonFiniteGradients) {
  const KernelTable& table = variant().table();
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Random rng(5);
    const std::size_t n = 5000;
    GradData g = test::make_grad(dtype, n, rng, 1.0);
    std::size_t first = 0;
    EXPECT_EQ(table.count_non_finite[int(dtype)](g.bytes.data(), n, &first), 0u);
    EXPECT_EQ(first, n);
    const std::size_t size = dtype_size(dtype);
    auto poke = [&](std::size_t i, float x) {
      if (dtype == DType::f32) {
        std::memcpy(g.bytes.data() + i * size, &x, 4);
      } else {
        const std::uint16_t h = dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
        std::memcpy(g.bytes.data() + i * size, &h, 2);
      }
    };
    poke(4093, INFINITY);
    poke(1030, NAN);
    poke(4999, -INFINITY);
    EXPECT_EQ(table.count_non_finite[int(dtype)](g.bytes.data(), n, &first), 3u);
    EXPECT_EQ(first, 1030u);
  }
}

// The gradient norm's sum of squares: fast float blocks, exact double re-sums for blocks with non-finite
// values, huge values (a float square overflows) or tiny ones (a float square underflows).
TEST_P(KernelTableTest, SumsSquaresOfFiniteGradients) {
  const KernelTable& table = variant().table();
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Random rng(6);
    const std::size_t n = 5000;  // several blocks and a tail
    GradData g = test::make_grad(dtype, n, rng, 2.0);
    const std::size_t size = dtype_size(dtype);
    auto poke = [&](std::size_t i, float x) {
      if (dtype == DType::f32) {
        std::memcpy(g.bytes.data() + i * size, &x, 4);
        g.values[i] = x;
      } else {
        const std::uint16_t h = dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
        std::memcpy(g.bytes.data() + i * size, &h, 2);
        g.values[i] = dtype == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
      }
    };
    auto reference = [&](std::size_t from, std::size_t count) {
      double sum = 0;
      for (std::size_t i = from; i < from + count; ++i) {
        if (std::isfinite(g.values[i])) sum += g.values[i] * g.values[i];
      }
      return sum;
    };
    std::uint64_t bad = 99;
    EXPECT_NEAR(table.sum_squares[int(dtype)](g.bytes.data(), n, &bad), reference(0, n), test::kSumSqRelTol * reference(0, n));
    EXPECT_EQ(bad, 0u);
    poke(17, NAN);
    poke(3000, -INFINITY);
    EXPECT_NEAR(table.sum_squares[int(dtype)](g.bytes.data(), n, &bad), reference(0, n), test::kSumSqRelTol * reference(0, n));
    EXPECT_EQ(bad, 2u);
    if (dtype != DType::f16) {  // f16's range holds no overflowing or vanishing float squares
      poke(2100, 1e30f);
      const double big = table.sum_squares[int(dtype)](g.bytes.data(), n, &bad);
      EXPECT_TRUE(std::isfinite(big));
      EXPECT_NEAR(big, reference(0, n), test::kSumSqRelTol * reference(0, n));
      // A block of nothing but tiny values: its squares vanish in float, not in double.
      for (std::size_t i = 0; i < 1024; ++i) poke(i, 1e-25f);
      const double tiny = table.sum_squares[int(dtype)](g.bytes.data(), 1024, &bad);
      EXPECT_GT(tiny, 0.0);
      EXPECT_NEAR(tiny, reference(0, 1024), test::kSumSqRelTol * reference(0, 1024));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KernelTableTest, ::testing::Range(0, test::kVariantCount),
                         [](const ::testing::TestParamInfo<int>& i) { return std::string(kVariants[i.param].token); });

}  // namespace
}  // namespace zoe::simd
