// The gradient-accumulation kernels of every kernel table this CPU runs x every gradient dtype, in every
// mode, bit for bit against a float64 oracle, at the sizes where vector code goes wrong, with unaligned
// pointers and guard elements around each array.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "simd/kernels.h"
#include "tests/reference.h"
#include "tests/simd/kernel_variants.h"

namespace zoe::simd {
namespace {

using test::kVariants;
using test::Random;
using test::skip_reason;
using test::Variant;

constexpr int kModes[] = {kAccumulateAdd, kAccumulateFirst, kAccumulateZeroSource,
                          kAccumulateFirst | kAccumulateZeroSource};
// Elements on each side of an array that no kernel may touch: wider than any vector.
constexpr std::size_t kGuard = 64;
constexpr unsigned char kGuardByte = 0xa5;
// Unit roundoff of fp32 round-to-nearest: each fp32 addition is exact within a factor (1 + d), |d| <= kU.
constexpr double kU = 1.0 / (1 << 24);

std::string mode_name(int mode) {
  std::string name = (mode & kAccumulateFirst) != 0 ? "first" : "add";
  return (mode & kAccumulateZeroSource) != 0 ? name + "+zero_source" : name;
}

// The oracle for one element. acc + g is a single IEEE addition, correctly rounded; float(double(acc) + g)
// is that same float: double's 53 bits are at least 2 x 24 + 2, the condition under which rounding to
// double and then to float equals rounding once (S. A. Figueroa, "When is double rounding innocuous?",
// SIGNUM Newsletter 30(3), 1995). The widening of an f16/bf16 gradient to float is exact.
float oracle(float acc, double g, int mode) {
  return (mode & kAccumulateFirst) != 0 ? static_cast<float>(g) : static_cast<float>(static_cast<double>(acc) + g);
}

bool same_float(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  return std::memcmp(&got, &want, sizeof got) == 0;
}

// Stores x as dtype at element i of bytes; returns the value stored, exactly.
double put_grad(DType dtype, unsigned char* bytes, std::size_t i, float x) {
  if (dtype == DType::f32) {
    std::memcpy(bytes + i * 4, &x, 4);
    return x;
  }
  const std::uint16_t h = dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
  std::memcpy(bytes + i * 2, &h, 2);
  return dtype == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
}

// Uniform in [-1, 1) times 2^e, e uniform in [-12, 12]: sums of very different magnitudes round in every
// way, and the smallest f16 values are subnormal; 2^12 stays far inside f16's range.
float wide_value(Random& rng) {
  return static_cast<float>(std::ldexp(rng.uniform(-1, 1), static_cast<int>(rng.uniform(-12, 13))));
}

// acc and g of n elements starting `offset` elements into buffers with kGuard guard elements after them.
struct Arrays {
  DType dtype;
  std::size_t n, offset;
  std::vector<float> acc;
  std::vector<unsigned char> g;
  std::vector<double> values;  // g's elements, exactly

  Arrays(DType d, std::size_t count, std::size_t off, Random& rng)
      : dtype(d), n(count), offset(off), acc(off + count + kGuard), g((off + count + kGuard) * dtype_size(d), kGuardByte),
        values(count) {
    std::memset(acc.data(), kGuardByte, acc.size() * 4);
    for (std::size_t i = 0; i < n; ++i) {
      acc[offset + i] = wide_value(rng);
      values[i] = put_grad(dtype, g.data(), offset + i, wide_value(rng));
    }
  }
  float* acc_at() { return acc.data() + offset; }
  unsigned char* g_at() { return g.data() + offset * dtype_size(dtype); }
  void set(std::size_t i, float acc_value, float g_value) {
    acc[offset + i] = acc_value;
    values[i] = put_grad(dtype, g.data(), offset + i, g_value);
  }
};

// Every byte of `bytes` outside [begin, end) still holds the guard byte.
void expect_guard_bytes(const unsigned char* bytes, std::size_t size, std::size_t begin, std::size_t end,
                        const char* what) {
  for (std::size_t b = 0; b < size; ++b) {
    if (b >= begin && b < end) continue;
    ASSERT_EQ(bytes[b], kGuardByte) << what << " byte " << b << " written, outside [" << begin << ", " << end << ")";
  }
}

void expect_guards_intact(const Arrays& a) {
  const std::size_t size = dtype_size(a.dtype);
  expect_guard_bytes(reinterpret_cast<const unsigned char*>(a.acc.data()), a.acc.size() * 4, a.offset * 4,
                     (a.offset + a.n) * 4, "acc");
  expect_guard_bytes(a.g.data(), a.g.size(), a.offset * size, (a.offset + a.n) * size, "g");
}

using Param = std::tuple<int /*variant*/, DType /*grad*/>;

class AccumulateKernel : public ::testing::TestWithParam<Param> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  const KernelTable& table() const { return variant().table(); }
  DType dtype() const { return std::get<1>(GetParam()); }
  AccumulateFn kernel() const { return table().accumulate[int(dtype())]; }

  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }

  // Runs the kernel once over `a` and checks every element against the oracle, g's bytes (all zero with
  // kAccumulateZeroSource, which is +0 in every dtype; else unchanged) and the guards.
  void run_and_check(Arrays& a, int mode) {
    SCOPED_TRACE("n = " + std::to_string(a.n) + ", offset " + std::to_string(a.offset) + ", " + mode_name(mode));
    const std::vector<float> before(a.acc.begin() + a.offset, a.acc.begin() + a.offset + a.n);
    const std::vector<unsigned char> g_before = a.g;
    kernel()(a.acc_at(), a.g_at(), a.n, mode);
    for (std::size_t i = 0; i < a.n; ++i) {
      const float want = oracle(before[i], a.values[i], mode);
      ASSERT_TRUE(same_float(a.acc[a.offset + i], want))
          << "acc[" << i << "] = " << a.acc[a.offset + i] << ", oracle " << want << " (acc was " << before[i]
          << ", g " << a.values[i] << ")";
    }
    const std::size_t size = dtype_size(dtype());
    for (std::size_t b = a.offset * size; b < (a.offset + a.n) * size; ++b) {
      const unsigned char want = (mode & kAccumulateZeroSource) != 0 ? 0 : g_before[b];
      ASSERT_EQ(a.g[b], want) << "g byte " << b;
    }
    expect_guards_intact(a);
  }

  void check(std::size_t n, std::size_t offset) {
    for (int mode : kModes) {
      Random rng(n * 131 + offset * 7 + static_cast<std::uint64_t>(mode));
      Arrays a(dtype(), n, offset, rng);
      run_and_check(a, mode);
    }
  }
};

TEST_P(AccumulateKernel, EdgeSizesMatchOracleBitForBit) {
  const std::size_t lanes = table().lanes;
  for (std::size_t n : {std::size_t(0), std::size_t(1), lanes - 1, lanes, lanes + 1, 2 * lanes + 3}) {
    for (std::size_t offset : {std::size_t(0), std::size_t(1)}) check(n, offset);
  }
}

TEST_P(AccumulateKernel, LargeOddSizeUnalignedMatchesOracleBitForBit) {
  check(100'003, 1);
  check(100'003, 3);
}

TEST_P(AccumulateKernel, FirstMicroBatchNeverReadsTheAccumulator) {
  for (int mode : {int(kAccumulateFirst), kAccumulateFirst | kAccumulateZeroSource}) {
    Random rng(3);
    Arrays a(dtype(), 3 * table().lanes + 5, 1, rng);
    for (std::size_t i = 0; i < a.n; ++i) a.acc[a.offset + i] = NAN;  // were it read, NaN would come out
    run_and_check(a, mode);
    for (std::size_t i = 0; i < a.n; ++i) ASSERT_FALSE(std::isnan(a.acc[a.offset + i])) << i;
  }
}

TEST_P(AccumulateKernel, ZeroSourceLeavesPositiveZeroEvenForNegativeAndNonFiniteGradients) {
  Random rng(4);
  Arrays a(dtype(), 2 * table().lanes + 3, 1, rng);
  a.set(0, 1.0f, -0.0f);
  a.set(1, 1.0f, -INFINITY);
  a.set(a.n - 1, 1.0f, NAN);
  a.set(a.n - 2, 1.0f, -1.5f);
  run_and_check(a, kAccumulateZeroSource);
}

TEST_P(AccumulateKernel, NanAndInfPropagateAsIeeeAddition) {
  const std::size_t lanes = table().lanes;
  for (int mode : kModes) {
    Random rng(5);
    Arrays a(dtype(), 3 * lanes + 2, 1, rng);
    a.set(0, NAN, 1.0f);                // NaN + x = NaN
    a.set(1, 2.0f, NAN);                // x + NaN = NaN
    a.set(lanes - 1, 2.0f, INFINITY);   // x + Inf = Inf
    a.set(lanes, -INFINITY, 3.0f);      // -Inf + x = -Inf
    a.set(lanes + 1, INFINITY, -INFINITY);  // Inf - Inf = NaN
    a.set(a.n - 1, INFINITY, INFINITY);     // in the tail
    run_and_check(a, mode);
  }
}

// k micro-batches, the first with kAccumulateFirst, against their float64 sum. Recursive summation of k
// terms makes k - 1 roundings, so |acc - exact| <= gamma(k - 1) * sum_j |g_j| with gamma(m) = m u / (1 - m u)
// (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2); the g_j are exact in
// fp32, the widening being exact.
TEST_P(AccumulateKernel, EightMicroBatchesStayWithinTheRecursiveSummationBound) {
  constexpr int kMicroBatches = 8;
  constexpr double kGamma = (kMicroBatches - 1) * kU / (1 - (kMicroBatches - 1) * kU);
  const std::size_t n = 10'007;
  Random rng(8);
  std::vector<float> acc(n + 1);
  std::vector<double> exact(n, 0.0), abs_sum(n, 0.0);
  std::vector<unsigned char> g((n + 1) * dtype_size(dtype()));
  for (int k = 0; k < kMicroBatches; ++k) {
    for (std::size_t i = 0; i < n; ++i) {
      const double v = put_grad(dtype(), g.data(), i + 1, static_cast<float>(rng.uniform(-1, 1)));
      exact[i] += v;
      abs_sum[i] += std::fabs(v);
    }
    const int mode = (k == 0 ? kAccumulateFirst : kAccumulateAdd) | kAccumulateZeroSource;
    kernel()(acc.data() + 1, g.data() + dtype_size(dtype()), n, mode);
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_LE(std::fabs(acc[i + 1] - exact[i]), kGamma * abs_sum[i])
        << "acc[" << i << "] = " << acc[i + 1] << ", exact sum " << exact[i];
  }
}

// The ceiling's loads and stores cover exactly the kernel's elements; with f32 and bf16 its widening is the
// kernel's, so it writes the same values too.
TEST_P(AccumulateKernel, StreamsCeilingWritesTheSameElements) {
  for (int mode : kModes) {
    SCOPED_TRACE(mode_name(mode));
    Random rng(9);
    Arrays a(dtype(), 5 * table().lanes + 7, 1, rng);
    Arrays b = a;
    table().accumulate_streams[int(dtype())](a.acc_at(), a.g_at(), a.n, mode);
    kernel()(b.acc_at(), b.g_at(), b.n, mode);
    expect_guards_intact(a);
    EXPECT_EQ(a.g, b.g);
    if (dtype() != DType::f16) {
      EXPECT_EQ(std::memcmp(a.acc.data(), b.acc.data(), a.acc.size() * 4), 0);
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(kVariants[std::get<0>(info.param)].token) + "_" + std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AccumulateKernel,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16)),
                         param_name);

}  // namespace
}  // namespace zoe::simd
