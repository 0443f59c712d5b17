// AVX2 + FMA + F16C Adam (8 fp32 lanes). bf16 rounding has no instruction here, so it is done with integer
// ops (round half to even, NaN kept quiet).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "base/convert.h"
#include "simd/kernels.h"

namespace zoe::simd::avx2 {
namespace {

struct V {
  using F = __m256;
  static constexpr std::size_t lanes = 8;
  static constexpr std::size_t max_lanes = lanes;
  static F set(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  // A step out of place (adam_body.inl): stores that bypass the cache, p 32-byte aligned.
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream_fence() { _mm_sfence(); }
  static F load_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F load_bf16(const std::uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store_f16(std::uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store_bf16(std::uint16_t* p, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i result = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Every 32-bit lane holds a value below 2^16, so the saturating pack is exact.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F sign(F a) {
    const F zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one),
                         _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one));
  }
  static F load_i8(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_i8(std::int8_t* p, F x) {
    const __m256i q = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static F load_e5m3(const std::uint8_t* p) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(768)), 20));
  }
  static void store_e5m3(std::uint8_t* p, F x) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(1 << 19)), 20);
    r = _mm256_sub_epi32(r, _mm256_set1_epi32(768));
    r = _mm256_min_epi32(_mm256_max_epi32(r, _mm256_setzero_si256()), _mm256_set1_epi32(255));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
};

#include "simd/kernel_bodies.inl"

constexpr KernelTable kTable = make_table("avx2", false);

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace zoe::simd::avx2
