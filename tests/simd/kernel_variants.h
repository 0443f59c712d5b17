// The kernel tables the simd suites test: each ISA of the build's architecture, and for avx512 both bf16
// variants where the CPU runs them.
#pragma once

#include <string>

#include "simd/dispatch.h"
#include "simd/kernels.h"

namespace zoe::test {

struct Variant {
  const char* token;
  Isa isa;
  const simd::KernelTable& (*table)();
  bool needs_native_bf16;
};

// Each architecture's own kernels: the build links no other.
inline constexpr Variant kVariants[] = {
    {"scalar", Isa::scalar, simd::scalar::table, false},
#if defined(__aarch64__)
    {"neon", Isa::neon, simd::neon::table, false},
    {"sve", Isa::sve, simd::sve::table, false},
#else
    {"avx2", Isa::avx2, simd::avx2::table, false},
    {"avx512", Isa::avx512, simd::avx512::table, false},
    {"avx512bf16", Isa::avx512, simd::avx512bf16::table, true},
#endif
};
inline constexpr int kVariantCount = sizeof kVariants / sizeof kVariants[0];

// Empty when this CPU runs the variant; otherwise the reason for the skip.
inline std::string skip_reason(const Variant& v) {
  if (!simd::isa_supported(v.isa)) return std::string("this CPU cannot run ") + v.token + " code";
  if (v.needs_native_bf16 && !simd::cpu_features().avx512bf16) return "this CPU lacks AVX512_BF16";
  return {};
}

// The state a kernel reads when it steps in place: the arrays it writes.
inline simd::StateIn in_place(const float* p, const void* m, const void* v, const float* m_scale = nullptr,
                              const float* v_scale = nullptr) {
  return simd::StateIn{p, m, v, m_scale, v_scale};
}

}  // namespace zoe::test
