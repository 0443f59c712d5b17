// SVE Adam, vector-length agnostic: one binary for every SVE width (128 bits on Grace's Neoverse V2, 256 on
// V1, up to 2048), the lane count read with CNTW where the shared body asks for it. Every operation is on
// whole vectors under an all-true predicate: the body's tail staging pads the last vector, as on the other
// ISAs, so no element takes a different path. fp16 converts with FCVT (round to nearest even under Linux's
// default FPCR); bf16 rounds with integer ops and the 8-bit codes saturate explicitly, as in adam_neon.cpp,
// so the codes and bits equal the other ISAs'.
#include <arm_sve.h>

#include <cstddef>
#include <cstdint>

#include "base/convert.h"
#include "simd/kernels.h"

namespace zoe::simd::sve {
namespace {

inline svbool_t all() { return svptrue_b32(); }

// The fp32 lanes of this CPU's vectors, read where used: CNTW is one instruction, and reading it before an
// SVE kernel runs would fault on a CPU without SVE.
struct Lanes {
  operator std::size_t() const { return svcntw(); }
};

struct V {
  using F = svfloat32_t;
  static constexpr Lanes lanes{};
  static constexpr std::size_t max_lanes = 64;  // 2048 bits, the architecture's largest vector
  static F set(float x) { return svdup_n_f32(x); }
  static F load(const float* p) { return svld1_f32(all(), p); }
  static void store(float* p, F x) { svst1_f32(all(), p, x); }
  // 16-bit values are loaded into the low half of each 32-bit lane (LD1H, zero-extended), where FCVT reads
  // a half and writes one, and stored from there (ST1H).
  static F load_f16(const std::uint16_t* p) {
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(svld1uh_u32(all(), p)));
  }
  static F load_bf16(const std::uint16_t* p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svld1uh_u32(all(), p), 16));
  }
  static void store_f16(std::uint16_t* p, F x) {
    svst1h_u32(all(), p, svreinterpret_u32_f16(svcvt_f16_f32_x(all(), x)));
  }
  static void store_bf16(std::uint16_t* p, F x) {
    const svuint32_t bits = svreinterpret_u32_f32(x);
    const svuint32_t high = svlsr_n_u32_x(all(), bits, 16);
    const svuint32_t bias = svadd_n_u32_x(all(), svand_n_u32_x(all(), high, 1), 0x7fff);
    const svuint32_t rounded = svlsr_n_u32_x(all(), svadd_u32_x(all(), bits, bias), 16);
    const svuint32_t quiet_nan = svorr_n_u32_x(all(), high, 0x40);
    svst1h_u32(all(), p, svsel_u32(svcmpuo_f32(all(), x, x), quiet_nan, rounded));
  }
  static F add(F a, F b) { return svadd_f32_x(all(), a, b); }
  static F sub(F a, F b) { return svsub_f32_x(all(), a, b); }
  static F mul(F a, F b) { return svmul_f32_x(all(), a, b); }
  static F div(F a, F b) { return svdiv_f32_x(all(), a, b); }
  static F sqrt(F a) { return svsqrt_f32_x(all(), a); }
  static F fma(F a, F b, F c) { return svmla_f32_x(all(), c, a, b); }
  static F abs(F a) { return svabs_f32_x(all(), a); }
  // x86 maxps: a where a > b, else b (so b when either is NaN). FMAX would return the NaN.
  static F max(F a, F b) { return svsel_f32(svcmpgt_f32(all(), a, b), a, b); }
  static F sign(F a) {
    const F zero = svdup_n_f32(0.0f), one = svdup_n_f32(1.0f);
    return svsub_f32_x(all(), svsel_f32(svcmpgt_n_f32(all(), a, 0.0f), one, zero),
                       svsel_f32(svcmplt_n_f32(all(), a, 0.0f), one, zero));
  }
  static F load_i8(const std::int8_t* p) { return svcvt_f32_s32_x(all(), svld1sb_s32(all(), p)); }
  static void store_i8(std::int8_t* p, F x) {
    // Round to nearest even (FRINTN, then an exact FCVTZS that saturates), clamp to 8 bits; NaN to -128 as
    // on x86 (FCVTZS gives 0).
    svint32_t q = svcvt_s32_f32_x(all(), svrintn_f32_x(all(), x));
    q = svsel_s32(svcmpuo_f32(all(), x, x), svdup_n_s32(-128), q);
    q = svmin_n_s32_x(all(), svmax_n_s32_x(all(), q, -128), 127);
    svst1b_s32(all(), p, q);
  }
  static F load_e5m3(const std::uint8_t* p) {
    const svuint32_t c = svld1ub_u32(all(), p);
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svadd_n_u32_x(all(), c, 768), 20));
  }
  static void store_e5m3(std::uint8_t* p, F x) {
    const svuint32_t r = svlsr_n_u32_x(all(), svadd_n_u32_x(all(), svreinterpret_u32_f32(x), 1u << 19), 20);
    svint32_t c = svsub_n_s32_x(all(), svreinterpret_s32_u32(r), 768);
    c = svmin_n_s32_x(all(), svmax_n_s32_x(all(), c, 0), 255);
    svst1b_u32(all(), p, svreinterpret_u32_s32(c));
  }
};

#include "simd/kernel_bodies.inl"

}  // namespace

// Built on first use, on a CPU that runs SVE: the lane count is the CPU's.
const KernelTable& table() {
  static const KernelTable t = make_table("sve", false);
  return t;
}

}  // namespace zoe::simd::sve
