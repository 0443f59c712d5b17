// 8-bit moments (kernels.h's scheme), every kernel table x every gradient dtype: each step against float64
// from the kernel's own decoded state, the codes every ISA writes from the same values, and the code's
// error bounds at block edges, tails and zero blocks.
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
using test::kVariants;
using test::Random;
using test::RefState;
using test::skip_reason;
using test::Variant;

constexpr int kSteps = 12;

AdamConstants constants_of(const AdamHyper& h, int step) {
  AdamConstants c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.neg_step_size = static_cast<float>(-double(h.lr) / (1.0 - std::pow(double(h.beta1), step)));
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double(h.beta2), step)));
  c.eps = h.eps;
  c.decay = static_cast<float>(1.0 - double(h.lr) * h.weight_decay);
  c.l2 = 0.0f;
  c.grad_scale = 1.0f;
  return c;
}

std::size_t blocks(std::size_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

struct Q8State {
  std::vector<std::int8_t> m;
  std::vector<std::uint8_t> v;
  std::vector<float> ms, vs;
  explicit Q8State(std::size_t n) : m(n, 0), v(n, 0), ms(blocks(n), 0.0f), vs(blocks(n), 0.0f) {}
  bool operator==(const Q8State&) const = default;
};

// The bounds of the codes (kernels.h), with fp32 and float64 free to round to either neighbour of a value
// near a code boundary: m within half a code step (scale / 254) of its fp32 value, v within 2^-4 of it
// relative, or under the smallest code (2^-31 of the block's largest). kSlack covers fp32 against float64.
constexpr double kSlack = 1e-5;
bool m_accepts(double got, double want, double scale) {
  return std::fabs(got - want) <= (0.5 / 127.0) * scale * (1 + kSlack) + kSlack * std::fabs(want);
}
bool v_accepts(double got, double want, double scale) {
  return std::fabs(got - want) <= 0x1p-4 * std::fabs(want) * (1 + kSlack) + 0x1p-31 * scale;
}

class AdamKernelInt8State : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  DType grad_dtype() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }
};

// Each step starts from the kernel's own codes: float64 Adam from their decoded values gives p (which the
// kernel updates from the unrounded fp32 moments) and the moments the new codes must hold within the
// code's bounds. Two calls split at a block boundary give the same bits as one (what tiles do).
TEST_P(AdamKernelInt8State, EachStepMatchesFloat64FromItsOwnDecodedState) {
  const KernelTable& table = variant().table();
  const std::size_t n = 2 * kQuantBlock + 3 * table.lanes + 5;  // two whole blocks, a short one with a tail
  Random rng(91);
  std::vector<float> p(n), p_split(n);
  std::vector<std::uint16_t> out(n), out_split(n);
  Q8State q(n), q_split(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = p_split[i] = static_cast<float>(rng.uniform(-1.0, 1.0));
  AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.01f;
  const AdamQ8Fn fn = table.adam_q8[int(grad_dtype())][kOutBF16];
  for (int step = 1; step <= kSteps; ++step) {
    // Gradients spanning decades within each block, as a layer's do: the small ones must keep their v.
    GradData g = test::make_grad(grad_dtype(), n, rng, 1e-2, 0);
    RefState ref{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
    std::vector<float> m0(n), v0(n);
    table.decode_q8(q.m.data(), q.v.data(), q.ms.data(), q.vs.data(), n, m0.data(), v0.data());
    for (std::size_t i = 0; i < n; ++i) {
      ref.p[i] = p[i];
      ref.m[i] = m0[i];
      ref.v[i] = v0[i];
    }
    const AdamConstants c = constants_of(h, step);
    const void* gp = test::grad_ptr(g, grad_dtype(), 0);
    fn(c, test::in_place(p.data(), q.m.data(), q.v.data(), q.ms.data(), q.vs.data()), p.data(), q.m.data(),
       q.v.data(), q.ms.data(), q.vs.data(), gp, out.data(), n);
    fn(c, test::in_place(p_split.data(), q_split.m.data(), q_split.v.data(), q_split.ms.data(), q_split.vs.data()),
       p_split.data(), q_split.m.data(), q_split.v.data(), q_split.ms.data(), q_split.vs.data(), gp,
       out_split.data(), kQuantBlock);
    fn(c,
       test::in_place(p_split.data() + kQuantBlock, q_split.m.data() + kQuantBlock, q_split.v.data() + kQuantBlock,
                      q_split.ms.data() + 1, q_split.vs.data() + 1),
       p_split.data() + kQuantBlock, q_split.m.data() + kQuantBlock, q_split.v.data() + kQuantBlock,
       q_split.ms.data() + 1, q_split.vs.data() + 1,
       static_cast<const unsigned char*>(gp) + kQuantBlock * dtype_size(grad_dtype()), out_split.data() + kQuantBlock,
       n - kQuantBlock);
    StepOptions o;
    o.step = step;
    test::reference_step(h, o, ref, g.values);
    std::vector<float> m1(n), v1(n);
    table.decode_q8(q.m.data(), q.v.data(), q.ms.data(), q.vs.data(), n, m1.data(), v1.data());
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t b = i / kQuantBlock;
      ASSERT_TRUE(test::kParamTol.accepts(p[i], ref.p[i])) << "p[" << i << "] at step " << step;
      ASSERT_TRUE(m_accepts(m1[i], ref.m[i], q.ms[b]))
          << "m[" << i << "] = " << m1[i] << ", float64 " << ref.m[i] << ", block scale " << q.ms[b] << " at step " << step;
      ASSERT_TRUE(v_accepts(v1[i], ref.v[i], q.vs[b]))
          << "v[" << i << "] = " << v1[i] << ", float64 " << ref.v[i] << ", block scale " << q.vs[b] << " at step " << step;
      ASSERT_EQ(out[i], float_to_bf16(p[i]));
    }
    for (std::size_t b = 0; b < q.ms.size(); ++b) ASSERT_GT(q.vs[b], 0.0f) << "block " << b;
    ASSERT_EQ(p, p_split) << "step " << step;
    ASSERT_TRUE(q == q_split) << "step " << step;
    ASSERT_EQ(out, out_split) << "step " << step;
  }
}

std::string q8_name(const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
  return std::string(kVariants[std::get<0>(info.param)].token) + "_grad_" + std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamKernelInt8State,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16)),
                         q8_name);

class Int8Codes : public ::testing::TestWithParam<int> {
 protected:
  const Variant& variant() const { return kVariants[GetParam()]; }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }
};

// Values spanning twelve decades with random signs, a zero block and a short tail: every ISA writes the
// scalar kernel's codes, and decoding stays within the bounds; the v of 2^-30 of its block's largest keeps
// a code (a linear 8-bit code would round it to 0).
TEST_P(Int8Codes, EveryIsaWritesTheScalarCodesWithinTheBounds) {
  const KernelTable& table = variant().table();
  const std::size_t n = 3 * kQuantBlock + table.lanes + 3;
  Random rng(5);
  std::vector<float> m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double magnitude = std::pow(10.0, rng.uniform(-12.0, 0.0));
    m[i] = static_cast<float>(rng.uniform(-1.0, 1.0) < 0 ? -magnitude : magnitude);
    v[i] = static_cast<float>(std::pow(10.0, rng.uniform(-12.0, -2.0)));
  }
  for (std::size_t i = kQuantBlock; i < 2 * kQuantBlock; ++i) m[i] = v[i] = 0.0f;  // block 1: zeros
  v[5] = 1e-2f;
  v[6] = 1e-2f * 0x1p-30f;
  Q8State mine(n), scalar(n);
  table.encode_q8(m.data(), v.data(), n, mine.m.data(), mine.v.data(), mine.ms.data(), mine.vs.data());
  scalar::table().encode_q8(m.data(), v.data(), n, scalar.m.data(), scalar.v.data(), scalar.ms.data(), scalar.vs.data());
  ASSERT_TRUE(mine == scalar);
  EXPECT_EQ(mine.ms[1], 0.0f);
  EXPECT_EQ(mine.vs[1], 0.0f);
  std::vector<float> m2(n), v2(n);
  table.decode_q8(mine.m.data(), mine.v.data(), mine.ms.data(), mine.vs.data(), n, m2.data(), v2.data());
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / kQuantBlock;
    ASSERT_TRUE(m_accepts(m2[i], m[i], mine.ms[b])) << "m[" << i << "] = " << m[i] << " decoded " << m2[i];
    ASSERT_TRUE(v_accepts(v2[i], v[i], mine.vs[b])) << "v[" << i << "] = " << v[i] << " decoded " << v2[i];
    if (b == 1) {
      ASSERT_EQ(m2[i], 0.0f) << i;
    }
  }
  EXPECT_EQ(mine.vs[0], 1e-2f);
  EXPECT_GT(v2[6], 0.0f);
  EXPECT_LE(std::fabs(v2[6] - v[6]), 0x1p-4 * v[6]);
  // The block's largest values decode exactly: max |m| to +-scale, max v to scale.
  const std::size_t top = static_cast<std::size_t>(std::max_element(v.begin(), v.begin() + kQuantBlock) - v.begin());
  EXPECT_EQ(v2[top], mine.vs[0]);
}

// The streams ceiling reads and writes the same code bytes (its values are meaningless).
TEST_P(Int8Codes, StreamsCeilingTouchesOnlyItsRange) {
  const KernelTable& table = variant().table();
  const std::size_t n = kQuantBlock + table.lanes + 1;
  std::vector<float> p(n + 1, 1.0f), g(n + 1, 0.5f), ms(2, 1.0f), vs(2, 1.0f);
  std::vector<std::int8_t> m(n + 1, 3);
  std::vector<std::uint8_t> v(n + 1, 3);
  std::vector<std::uint16_t> out(n + 1, 0);
  table.streams_q8[kF32][kOutBF16](AdamConstants{}, test::in_place(p.data(), m.data(), v.data(), ms.data(), vs.data()),
                                   p.data(), m.data(), v.data(), ms.data(), vs.data(), g.data(), out.data(), n);
  EXPECT_EQ(p[n], 1.0f);
  EXPECT_EQ(m[n], 3);
  EXPECT_EQ(v[n], 3);
  EXPECT_EQ(out[n], 0);
  EXPECT_EQ(p[0], 1.5f);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Int8Codes, ::testing::Range(0, test::kVariantCount),
                         [](const ::testing::TestParamInfo<int>& param) { return std::string(kVariants[param.param].token); });

}  // namespace
}  // namespace zoe::simd
