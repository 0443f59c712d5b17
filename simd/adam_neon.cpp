// NEON (Advanced SIMD, every AArch64 CPU) Adam, 4 fp32 lanes. fp16 has conversion instructions (FCVTL,
// FCVTN, round to nearest even under Linux's default FPCR); bf16 rounding is done with integer ops, as in the
// avx2 kernel. The 8-bit codes round with FCVTNS and saturate explicitly, NaN to -128 as x86's cvtps2dq and
// saturating packs give it, so every ISA writes the same codes.
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>

#include "base/convert.h"
#include "simd/kernels.h"

namespace zoe::simd::neon {
namespace {

// Four bytes to the low half of a vector, without reading past them (a tail buffer holds only four).
inline uint8x8_t load4_u8(const void* p) {
  std::uint32_t w;
  __builtin_memcpy(&w, p, 4);
  return vreinterpret_u8_u32(vdup_n_u32(w));
}

inline void store4_u8(void* p, uint8x8_t x) {
  const std::uint32_t w = vget_lane_u32(vreinterpret_u32_u8(x), 0);
  __builtin_memcpy(p, &w, 4);
}

struct V {
  using F = float32x4_t;
  static constexpr std::size_t lanes = 4;
  static constexpr std::size_t max_lanes = lanes;
  static F set(float x) { return vdupq_n_f32(x); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static F load_f16(const std::uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static F load_bf16(const std::uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static void store_f16(std::uint16_t* p, F x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
  static void store_bf16(std::uint16_t* p, F x) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x);
    const uint32x4_t high = vshrq_n_u32(bits, 16);
    const uint32x4_t bias = vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(high, vdupq_n_u32(1)));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, bias), 16);
    const uint32x4_t is_nan = vmvnq_u32(vceqq_f32(x, x));
    const uint32x4_t result = vbslq_u32(is_nan, vorrq_u32(high, vdupq_n_u32(0x40)), rounded);
    vst1_u16(p, vmovn_u32(result));  // every lane is below 2^16: the narrowing is exact
  }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F abs(F a) { return vabsq_f32(a); }
  // x86 maxps: a where a > b, else b (so b when either is NaN). FMAX would return the NaN.
  static F max(F a, F b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static F sign(F a) {
    const uint32x4_t one = vreinterpretq_u32_f32(vdupq_n_f32(1.0f));
    const float32x4_t zero = vdupq_n_f32(0.0f);
    return vsubq_f32(vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(a, zero), one)),
                     vreinterpretq_f32_u32(vandq_u32(vcltq_f32(a, zero), one)));
  }
  static F load_i8(const std::int8_t* p) {
    const int16x8_t w = vmovl_s8(vreinterpret_s8_u8(load4_u8(p)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
  }
  static void store_i8(std::int8_t* p, F x) {
    // Round to nearest even, saturate to 32 then 16 then 8 bits; FCVTNS gives 0 for NaN, x86 -128.
    const int32x4_t nan_code = vdupq_n_s32(-128);
    const int32x4_t q = vbslq_s32(vceqq_f32(x, x), vcvtnq_s32_f32(x), nan_code);
    const int16x4_t w = vqmovn_s32(q);
    store4_u8(p, vreinterpret_u8_s8(vqmovn_s16(vcombine_s16(w, w))));
  }
  static F load_e5m3(const std::uint8_t* p) {
    const uint32x4_t c = vmovl_u16(vget_low_u16(vmovl_u8(load4_u8(p))));
    return vreinterpretq_f32_u32(vshlq_n_u32(vaddq_u32(c, vdupq_n_u32(768)), 20));
  }
  static void store_e5m3(std::uint8_t* p, F x) {
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(1u << 19)), 20);
    int32x4_t c = vsubq_s32(vreinterpretq_s32_u32(r), vdupq_n_s32(768));
    c = vminq_s32(vmaxq_s32(c, vdupq_n_s32(0)), vdupq_n_s32(255));
    const uint16x4_t w = vmovn_u32(vreinterpretq_u32_s32(c));
    store4_u8(p, vmovn_u16(vcombine_u16(w, w)));
  }
};

#include "simd/kernel_bodies.inl"

constexpr KernelTable kTable = make_table("neon", false);

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace zoe::simd::neon
