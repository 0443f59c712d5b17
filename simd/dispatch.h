// Picks the kernel table once at run time from CPUID + XCR0 (x86-64) or the HWCAP bits (AArch64), honouring
// ZOE_ISA.
#pragma once

#include "simd/private.h"

#include <string_view>

#include "simd/kernels.h"
#include "zoe/adam.h"
#include "zoe/status.h"

namespace zoe::simd {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;                   // with the OS saving YMM state
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;  // with the OS saving ZMM state
  bool avx512bf16 = false;
  bool asimd = false, sve = false;  // AArch64: Advanced SIMD (NEON) and SVE, from getauxval(AT_HWCAP)
  unsigned sve_bits = 0;            // SVE's vector length on this CPU, in bits
};

const CpuFeatures& cpu_features();
bool isa_supported(Isa isa);
std::optional<Isa> parse_isa(std::string_view name);

// `requested` is "auto" or an ISA token. The ZOE_ISA environment variable, when set and not empty, replaces
// "auto"; an explicit request wins over it. Both are always checked: an unknown name or one this CPU cannot
// run is an error naming where it came from and what this CPU supports.
Result<Isa> choose_isa(std::string_view requested);

// The table for `isa`, which must be supported; avx512 uses native bf16 rounding when the CPU has it.
const KernelTable& kernel_table(Isa isa);

}  // namespace zoe::simd
