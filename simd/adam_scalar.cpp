// Plain C++ Adam: runs on any x86-64 and is the reference the vector kernels are checked against.
// Compiled with -fno-math-errno so that sqrt is one instruction rather than a libm call.
#include <cstddef>
#include <cstdint>

#include "base/convert.h"
#include "simd/kernels.h"

namespace zoe::simd::scalar {
namespace {

struct V {
  using F = float;
  static constexpr std::size_t lanes = 1;
  static constexpr std::size_t max_lanes = lanes;
  static F set(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_f16(const std::uint16_t* p) { return f16_to_f32(*p); }
  static F load_bf16(const std::uint16_t* p) { return bf16_to_f32(*p); }
  static void store_f16(std::uint16_t* p, F x) { *p = f32_to_f16(x); }
  static void store_bf16(std::uint16_t* p, F x) { *p = f32_to_bf16(x); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F abs(F a) { return __builtin_fabsf(a); }
  static F max(F a, F b) { return a > b ? a : b; }
  static F sign(F a) { return static_cast<float>((a > 0.0f) - (a < 0.0f)); }
  static F load_i8(const std::int8_t* p) { return static_cast<float>(*p); }
  static void store_i8(std::int8_t* p, F x) {
    // As cvtps2dq then a saturating pack: NaN and values out of range saturate (NaN to -128).
    const float r = __builtin_rintf(x);
    *p = r >= 127.0f ? 127 : r >= -128.0f ? static_cast<std::int8_t>(r) : -128;
  }
  static F load_e5m3(const std::uint8_t* p) { return bits_float((std::uint32_t{*p} + 768u) << 20); }
  static void store_e5m3(std::uint8_t* p, F x) {
    const std::int32_t r = static_cast<std::int32_t>((float_bits(x) + (1u << 19)) >> 20) - 768;
    *p = static_cast<std::uint8_t>(r < 0 ? 0 : r > 255 ? 255 : r);
  }
};

#include "simd/kernel_bodies.inl"

constexpr KernelTable kTable = make_table("scalar", false);

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace zoe::simd::scalar
