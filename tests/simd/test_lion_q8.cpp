// Lion with its moment in 8 bits (kernels.h's m code), every kernel table x every gradient dtype: each call is
// exactly "decode the codes, step Lion in fp32 with the same table's fp32 kernel, encode again" — the same p,
// codes and scales bit for bit — in place and out of place, split at a block boundary or not, and the
// decoded moment stays within the code's bound of the fp32 one.
#include <gtest/gtest.h>

#include <cmath>
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
using test::skip_reason;
using test::Variant;

constexpr int kSteps = 8;

std::size_t blocks(std::size_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

LionConstants lion_constants() {
  LionConstants c{};
  c.beta1 = 0.9f;
  c.one_minus_beta1 = 1.0f - c.beta1;
  c.beta2 = 0.99f;
  c.one_minus_beta2 = 1.0f - c.beta2;
  c.neg_lr = -1e-3f;
  c.decay = static_cast<float>(1.0 - 1e-3 * 0.1);
  c.grad_scale = 1.0f;
  return c;
}

struct Codes {
  std::vector<std::int8_t> m;
  std::vector<float> scale;
  explicit Codes(std::size_t n) : m(n, 0), scale(blocks(n), 0.0f) {}
  bool operator==(const Codes&) const = default;
};

class LionKernelInt8State : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  DType grad_dtype() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(LionKernelInt8State, IsTheFp32StepBetweenDecodeAndEncode) {
  const KernelTable& table = variant().table();
  const std::size_t n = 2 * kQuantBlock + 3 * table.lanes + 5;  // two whole blocks, a short one with a tail
  const int g_index = int(grad_dtype());
  Random rng(17);
  std::vector<float> p(n), p_split(n), p_aside(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>(rng.uniform(-1.0, 1.0));
  Codes q(n);
  const LionConstants c = lion_constants();
  const LionQ8Fn fn = table.lion_q8[g_index][kOutBF16];
  for (int step = 1; step <= kSteps; ++step) {
    const GradData g = test::make_grad(grad_dtype(), n, rng, 1e-2, 0);
    const void* gp = test::grad_ptr(g, grad_dtype(), 0);
    // The reference: the codes decoded, this table's fp32 Lion, encoded again.
    std::vector<float> m(n), p_ref = p;
    std::vector<std::uint16_t> out_ref(n);
    table.decode_q8(q.m.data(), nullptr, q.scale.data(), nullptr, n, m.data(), nullptr);
    const std::vector<float> m_before = m;
    const StepArrays<1> a{p_ref.data(), {m.data()}, p_ref.data(), {m.data()}, gp, out_ref.data()};
    table.lion.step[g_index][kOutBF16][kStateF32](c, a, n);
    Codes want(n);
    table.encode_q8(m.data(), nullptr, n, want.m.data(), nullptr, want.scale.data(), nullptr);
    // Out of place (overlap's speculation): the state read stays as it was.
    Codes aside(n);
    const Codes before = q;
    std::vector<std::uint16_t> out_aside(n);
    fn(c, test::in_place(p.data(), q.m.data(), nullptr, q.scale.data()), p_aside.data(), aside.m.data(),
       aside.scale.data(), gp, out_aside.data(), n);
    ASSERT_TRUE(q == before) << "step " << step << ": the state read was written";
    // In place, in one call and split at a block boundary.
    p_split = p;
    Codes split = q;
    std::vector<std::uint16_t> out(n), out_split(n);
    fn(c, test::in_place(p.data(), q.m.data(), nullptr, q.scale.data()), p.data(), q.m.data(), q.scale.data(), gp,
       out.data(), n);
    fn(c, test::in_place(p_split.data(), split.m.data(), nullptr, split.scale.data()), p_split.data(), split.m.data(),
       split.scale.data(), gp, out_split.data(), kQuantBlock);
    fn(c, test::in_place(p_split.data() + kQuantBlock, split.m.data() + kQuantBlock, nullptr, split.scale.data() + 1),
       p_split.data() + kQuantBlock, split.m.data() + kQuantBlock, split.scale.data() + 1,
       static_cast<const unsigned char*>(gp) + kQuantBlock * dtype_size(grad_dtype()), out_split.data() + kQuantBlock,
       n - kQuantBlock);
    ASSERT_EQ(p, p_ref) << "step " << step;
    ASSERT_EQ(out, out_ref) << "step " << step;
    ASSERT_TRUE(q == want) << "step " << step;
    ASSERT_EQ(p_aside, p_ref) << "step " << step;
    ASSERT_TRUE(aside == want) << "step " << step;
    ASSERT_EQ(p_split, p) << "step " << step;
    ASSERT_TRUE(split == q) << "step " << step;
    // The decoded moment within half a code step (scale / 254) of the fp32 one it was encoded from.
    std::vector<float> decoded(n);
    table.decode_q8(q.m.data(), nullptr, q.scale.data(), nullptr, n, decoded.data(), nullptr);
    for (std::size_t i = 0; i < n; ++i) {
      const double bound = q.scale[i / kQuantBlock] / 254.0 * (1 + 1e-5);
      ASSERT_LE(std::fabs(double(decoded[i]) - double(m[i])), bound) << "m[" << i << "] at step " << step;
    }
    ASSERT_NE(m, m_before) << "the moment moved";
  }
}

std::string lion_q8_name(const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
  return std::string(kVariants[std::get<0>(info.param)].token) + "_grad_" +
         std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, LionKernelInt8State,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16)),
                         lion_q8_name);

}  // namespace
}  // namespace zoe::simd
