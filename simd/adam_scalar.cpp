// Plain C++ Adam: runs on any x86-64 and is the reference the vector kernels are checked against.
// Compiled with -fno-math-errno so that sqrt is one instruction rather than a libm call.
#include <cstddef>
#include <cstdint>

#include "simd/convert.h"
#include "simd/kernels.h"

namespace zoe::simd::scalar {
namespace {

struct V {
  using F = float;
  static constexpr std::size_t lanes = 1;
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
};

#include "simd/adam_body.inl"

constexpr KernelTable kTable = make_table("scalar", false);

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace zoe::simd::scalar
