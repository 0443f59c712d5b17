// The scalar fp16/bf16 conversions against the compiler's own _Float16 and a float64 rounding oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/convert.h"

namespace zoe {
namespace {

TEST(Convert, F16RoundTripsEveryHalf) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_EQ(h & 0x7c00u, 0x7c00u);
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << "half 0x" << std::hex << h;
  }
}

// The compiler's IEEE half: _Float16 on x86-64; GCC 12's C++ has it not on AArch64, where __fp16 is the same
// format (FCVT, round to nearest even).
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif

TEST(Convert, F16MatchesCompilerConversionOnManyFloats) {
  // The compiler's conversion is IEEE round-to-nearest-even (libgcc on x86-64 without F16C).
  std::uint32_t x = 1;
  for (int i = 0; i < 2'000'000; ++i) {
    x = x * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &x, 4);
    if (std::isnan(f)) continue;
    const CompilerHalf want = static_cast<CompilerHalf>(f);
    std::uint16_t want_bits;
    std::memcpy(&want_bits, &want, 2);
    ASSERT_EQ(f32_to_f16(f), want_bits) << "float bits 0x" << std::hex << x;
  }
}

TEST(Convert, Bf16RoundsHalfToEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: ties up to even.
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0.00390625f), 0x3f82);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(3.4028235e38f), 0x7f80);  // the largest float rounds up to infinity
  const std::uint16_t nan = f32_to_bf16(NAN);
  EXPECT_TRUE(std::isnan(bf16_to_f32(nan)));
}

TEST(Convert, Bf16IsNearestOnManyFloats) {
  std::uint32_t x = 7;
  for (int i = 0; i < 1'000'000; ++i) {
    x = x * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &x, 4);
    if (!std::isfinite(f) || std::fabs(f) > 3.3e38f) continue;
    const std::uint16_t b = f32_to_bf16(f);
    const double got = bf16_to_f32(b);
    const double below = bf16_to_f32(static_cast<std::uint16_t>(b - 1));
    const double above = bf16_to_f32(static_cast<std::uint16_t>(b + 1));
    if (std::isfinite(below)) {
      ASSERT_LE(std::fabs(got - f), std::fabs(below - f)) << f;
    }
    if (std::isfinite(above)) {
      ASSERT_LE(std::fabs(got - f), std::fabs(above - f)) << f;
    }
  }
}

}  // namespace
}  // namespace zoe
