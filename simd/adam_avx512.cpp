// AVX-512 (F, BW, VL, DQ) Adam, 16 fp32 lanes. Compiled twice: with ZOE_NATIVE_BF16 (and -mavx512bf16) the
// bf16 copy-out uses VCVTNEPS2BF16; without it, integer round half to even, as in the avx2 kernel.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "base/convert.h"
#include "simd/kernels.h"

#ifdef ZOE_NATIVE_BF16
#define ZOE_AVX512_NAMESPACE avx512bf16
#else
#define ZOE_AVX512_NAMESPACE avx512
#endif

namespace zoe::simd::ZOE_AVX512_NAMESPACE {
namespace {

struct V {
  using F = __m512;
  static constexpr std::size_t lanes = 16;
  static constexpr std::size_t max_lanes = lanes;
  static F set(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  // A step out of place (adam_body.inl): stores that bypass the cache, p 64-byte aligned.
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream_fence() { _mm_sfence(); }
  static F load_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_bf16(const std::uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store_f16(std::uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#ifdef ZOE_NATIVE_BF16
  // Round to nearest even; the instruction treats subnormal inputs as zero (|x| < 1.2e-38, far below any
  // weight a model holds).
  static void store_bf16(std::uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
  }
#else
  static void store_bf16(std::uint16_t* p, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    __m512i result = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    result = _mm512_mask_or_epi32(result, is_nan, high, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(result));
  }
#endif
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F sign(F a) {
    const F zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    return _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), one),
                         _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), one));
  }
  static F load_i8(const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_i8(std::int8_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  static F load_e5m3(const std::uint8_t* p) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(768)), 20));
  }
  static void store_e5m3(std::uint8_t* p, F x) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(1 << 19)), 20);
    r = _mm512_max_epi32(_mm512_sub_epi32(r, _mm512_set1_epi32(768)), _mm512_setzero_si512());
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(r));  // saturates at 255
  }
};

#include "simd/kernel_bodies.inl"

#ifdef ZOE_NATIVE_BF16
constexpr KernelTable kTable = make_table("avx512", true);
#else
constexpr KernelTable kTable = make_table("avx512", false);
#endif

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace zoe::simd::ZOE_AVX512_NAMESPACE
