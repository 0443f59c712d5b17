#include "base/crc32c.h"

#include <array>
#include <cstring>

#if defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#endif

namespace zoe {
namespace {

constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed

// kTables[0] is the byte-at-a-time table; kTables[k][b] is the CRC of byte b followed by k zero bytes, which
// lets one step fold 8 input bytes with 8 independent lookups (slicing-by-8, Kounavis & Berry, Intel 2005).
using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = make_tables();

// Little-endian load whatever the host's order, so the slicing below reads bytes in stream order.
std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian (x86-64, AArch64 Linux): the bytes in stream order, as crc32 consumes them
  return v;
}

// The CRC-32C instructions: SSE4.2's crc32 on x86-64, the CRC extension's crc32c on AArch64 (optional before
// Armv8.1, so both are checked at run time). The same function of the same bits.
#if defined(__x86_64__)
#define ZOE_CRC_TARGET __attribute__((target("sse4.2")))
ZOE_CRC_TARGET inline std::uint64_t crc_step64(std::uint64_t c, std::uint64_t v) {
  return __builtin_ia32_crc32di(c, v);
}
ZOE_CRC_TARGET inline std::uint32_t crc_step8(std::uint32_t c, unsigned char b) { return __builtin_ia32_crc32qi(c, b); }
#elif defined(__aarch64__)
#define ZOE_CRC_TARGET __attribute__((target("+crc")))
ZOE_CRC_TARGET inline std::uint64_t crc_step64(std::uint64_t c, std::uint64_t v) {
  return __crc32cd(static_cast<std::uint32_t>(c), v);
}
ZOE_CRC_TARGET inline std::uint32_t crc_step8(std::uint32_t c, unsigned char b) { return __crc32cb(c, b); }
#else
#error "zoe builds for x86-64 and AArch64"
#endif

// The ~crc pre- and post-conditioning matches the software path, so partial results chain the same way.
ZOE_CRC_TARGET std::uint32_t crc_hw(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  std::uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) c = crc_step64(c, load64(p));
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = crc_step8(c32, *p);
  return ~c32;
}

ZOE_CRC_TARGET void crc_hw_x3(const unsigned char* a, const unsigned char* b, const unsigned char* c, std::size_t n,
                              std::uint32_t out[3]) {
  std::uint64_t ca = 0xFFFFFFFFu, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ca = crc_step64(ca, load64(a + i));
    cb = crc_step64(cb, load64(b + i));
    cc = crc_step64(cc, load64(c + i));
  }
  out[0] = crc_hw(a + i, n - i, ~static_cast<std::uint32_t>(ca));
  out[1] = crc_hw(b + i, n - i, ~static_cast<std::uint32_t>(cb));
  out[2] = crc_hw(c + i, n - i, ~static_cast<std::uint32_t>(cc));
}

// Polynomial arithmetic modulo the CRC-32C polynomial, in the CRC's bit-reflected form: bit 31 is the
// coefficient of x^0, bit 0 that of x^31. It joins CRCs computed apart: for the conditioned CRC,
// crc(A then B) = crc(A) * x^(8 |B|) + crc(B) (mod P), whatever the lengths.
std::uint32_t multiply_mod(std::uint32_t a, std::uint32_t b) {
  std::uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) product ^= b;    // a's x^i term times b
    b = (b & 1u) ? (b >> 1) ^ kPolynomial : b >> 1;  // b *= x: x^32 is the polynomial's low terms
  }
  return product;
}

// x^(8 bytes) mod P: the factor that moves a CRC past `bytes` more bytes.
std::uint32_t shift_factor(std::uint64_t bytes) {
  std::uint32_t result = 0x80000000u;  // 1
  std::uint32_t power = 0x00800000u;   // x^8
  for (; bytes != 0; bytes >>= 1) {
    if (bytes & 1u) result = multiply_mod(result, power);
    power = multiply_mod(power, power);
  }
  return result;
}

// One long buffer as three interleaved chains over its thirds, joined: the crc32 instruction's latency is
// three times its issue interval, so one chain runs at a third of the unit's rate. Same value as crc_hw.
ZOE_CRC_TARGET std::uint32_t crc_hw_long(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  const std::size_t third = n / 3 / 8 * 8;
  std::uint32_t parts[3];
  crc_hw_x3(p, p + third, p + 2 * third, third, parts);
  const std::uint32_t one_third = shift_factor(third);
  std::uint32_t c = multiply_mod(parts[0], multiply_mod(one_third, one_third)) ^ multiply_mod(parts[1], one_third) ^ parts[2];
  c = crc_hw(p + 3 * third, n - 3 * third, c);
  return crc == 0 ? c : multiply_mod(crc, shift_factor(n)) ^ c;
}

// Below this, the joining's few thousand cycles are not repaid.
constexpr std::size_t kLongBuffer = 64 * 1024;

bool detect_hardware() {
#if defined(__x86_64__)
  __builtin_cpu_init();  // may run before the libgcc constructor that fills the CPU model
  return __builtin_cpu_supports("sse4.2");
#else
  constexpr unsigned long kHwcapCrc32 = 1ul << 7;  // asm/hwcap.h
  return (getauxval(AT_HWCAP) & kHwcapCrc32) != 0;
#endif
}

const bool kHardware = detect_hardware();

}  // namespace

bool crc32c_hardware() { return kHardware; }

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) {
  if (!kHardware) return crc32c_software(data, bytes, crc);
  const auto* p = static_cast<const unsigned char*>(data);
  return bytes >= kLongBuffer ? crc_hw_long(p, bytes, crc) : crc_hw(p, bytes, crc);
}

void crc32c_x3(const void* a, const void* b, const void* c, std::size_t bytes, std::uint32_t out[3]) {
  if (kHardware) {
    crc_hw_x3(static_cast<const unsigned char*>(a), static_cast<const unsigned char*>(b),
              static_cast<const unsigned char*>(c), bytes, out);
    return;
  }
  out[0] = crc32c_software(a, bytes);
  out[1] = crc32c_software(b, bytes);
  out[2] = crc32c_software(c, bytes);
}

std::uint32_t crc32c_software(const void* data, std::size_t bytes, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    const std::uint64_t v = load_le64(p) ^ c;
    c = kTables[7][v & 0xFF] ^ kTables[6][(v >> 8) & 0xFF] ^ kTables[5][(v >> 16) & 0xFF] ^
        kTables[4][(v >> 24) & 0xFF] ^ kTables[3][(v >> 32) & 0xFF] ^ kTables[2][(v >> 40) & 0xFF] ^
        kTables[1][(v >> 48) & 0xFF] ^ kTables[0][v >> 56];
  }
  for (; bytes > 0; --bytes, ++p) c = (c >> 8) ^ kTables[0][(c ^ *p) & 0xFFu];
  return ~c;
}

}  // namespace zoe
