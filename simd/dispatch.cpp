#include "simd/dispatch.h"

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace zoe::simd {
namespace {

// The ISAs zoe knows, best first: one architecture's run on its CPUs, the other's never.
constexpr Isa kIsas[] = {Isa::avx512, Isa::avx2, Isa::sve, Isa::neon, Isa::scalar};

#if defined(__x86_64__)
std::uint64_t read_xcr0() {
  std::uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<std::uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid(1, eax, ebx, ecx, edx);
  const bool osxsave = (ecx >> 27) & 1;
  if (!osxsave) return f;
  const bool fma = (ecx >> 12) & 1;
  const bool f16c = (ecx >> 29) & 1;
  const std::uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;             // SSE and AVX state
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM state
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const unsigned leaf7_ebx = ebx;
  if (os_ymm) {
    f.avx2 = (leaf7_ebx >> 5) & 1;
    f.fma = fma;
    f.f16c = f16c;
  }
  if (os_zmm) {
    f.avx512f = (leaf7_ebx >> 16) & 1;
    f.avx512dq = (leaf7_ebx >> 17) & 1;
    f.avx512bw = (leaf7_ebx >> 30) & 1;
    f.avx512vl = (leaf7_ebx >> 31) & 1;
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512bf16 = (eax >> 5) & 1;
  }
  return f;
}
#elif defined(__aarch64__)
// The kernel's HWCAP bits (asm/hwcap.h): Advanced SIMD, and SVE. The vector length this thread runs with
// comes from prctl (PR_SVE_GET_VL: bytes in the low 16 bits), without an SVE instruction.
constexpr unsigned long kHwcapAsimd = 1ul << 1;
constexpr unsigned long kHwcapSve = 1ul << 22;
constexpr int kPrSveGetVl = 51;

unsigned sve_vector_bits() {
  const int vl = prctl(kPrSveGetVl, 0, 0, 0, 0);
  return vl < 0 ? 0 : static_cast<unsigned>(vl & 0xffff) * 8;
}

CpuFeatures detect() {
  CpuFeatures f;
  const unsigned long hwcap = getauxval(AT_HWCAP);
  f.asimd = (hwcap & kHwcapAsimd) != 0;
  f.sve = (hwcap & kHwcapSve) != 0;
  if (f.sve) f.sve_bits = sve_vector_bits();
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

std::string supported_list() {
  std::string s;
  for (Isa isa : supported_isas()) {
    if (!s.empty()) s += ", ";
    s += isa_name(isa);
  }
  return s;
}

// `name` must be an ISA zoe knows and this CPU runs; `source` names where it came from in the error.
Result<Isa> checked_isa(std::string_view source, std::string_view name) {
  const std::optional<Isa> isa = parse_isa(name);
  if (!isa) {
    return invalid_argument(std::string(source) + "=" + std::string(name) +
                            " is not an ISA zoe knows; use auto, scalar, avx2, avx512, neon or sve (this CPU "
                            "supports " + supported_list() + ")");
  }
  if (!isa_supported(*isa)) {
    return Status(StatusCode::unsupported, std::string(source) + "=" + std::string(name) +
                                               " is not supported by this CPU; it supports " + supported_list());
  }
  return *isa;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return f.avx2 && f.fma && f.f16c;
    case Isa::avx512:
      return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c;
    case Isa::neon:
      return f.asimd;
    case Isa::sve:
      return f.asimd && f.sve;
  }
  return false;
}

std::optional<Isa> parse_isa(std::string_view name) {
  for (Isa isa : kIsas) {
    if (name == isa_name(isa)) return isa;
  }
  return std::nullopt;
}

Result<Isa> choose_isa(std::string_view requested) {
  // Both are checked whenever given, so a typo is never hidden by the other. An explicit request wins: the
  // environment sets the default for code that asks for "auto", which lets a whole test run be forced to one
  // ISA while tests that name their ISA keep it.
  std::optional<Isa> from_env;
  if (const char* env = std::getenv("ZOE_ISA"); env != nullptr && *env != '\0') {
    Result<Isa> e = checked_isa("ZOE_ISA", env);
    if (!e.ok()) return e.status();
    from_env = *e;
  }
  if (requested != "auto" && !requested.empty()) return checked_isa("requested ISA", requested);
  return from_env ? *from_env : supported_isas().front();
}

// Each architecture's build links its own kernels only; isa_supported never admits the other's.
const KernelTable& kernel_table(Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::avx512:
      return cpu_features().avx512bf16 ? avx512bf16::table() : avx512::table();
    case Isa::avx2:
      return avx2::table();
#elif defined(__aarch64__)
    case Isa::sve:
      return sve::table();
    case Isa::neon:
      return neon::table();
#endif
    default:
      break;
  }
  return scalar::table();
}

}  // namespace zoe::simd

namespace zoe {

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    case Isa::scalar:
      return "scalar";
    case Isa::sve:
      return "sve";
    case Isa::neon:
      return "neon";
  }
  return "invalid";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
  for (Isa isa : simd::kIsas) {
    if (simd::isa_supported(isa)) isas.push_back(isa);
  }
  return isas;
}

std::string cpu_features_text() {
  const simd::CpuFeatures& f = simd::cpu_features();
  char text[200];
#if defined(__aarch64__)
  std::snprintf(text, sizeof text, "asimd=%d sve=%d sve_bits=%u", f.asimd, f.sve, f.sve_bits);
#else
  std::snprintf(text, sizeof text, "avx2=%d fma=%d f16c=%d avx512f=%d avx512bw=%d avx512vl=%d avx512dq=%d avx512bf16=%d",
                f.avx2, f.fma, f.f16c, f.avx512f, f.avx512bw, f.avx512vl, f.avx512dq, f.avx512bf16);
#endif
  return text;
}

}  // namespace zoe
