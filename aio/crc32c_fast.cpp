#include "aio/crc32c_fast.h"

#include <cstring>

#include "src/offload/crc32c.h"

namespace zoe::aio {
namespace {

std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);  // x86 is little-endian: the bytes in stream order, as crc32q consumes them
  return v;
}

// The ~crc pre- and post-conditioning matches zoe::crc32c, so partial results chain the same way.
__attribute__((target("sse4.2"))) std::uint32_t crc_hw(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  std::uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) c = __builtin_ia32_crc32di(c, load64(p));
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return ~c32;
}

__attribute__((target("sse4.2"))) void crc_hw_x3(const unsigned char* a, const unsigned char* b,
                                                 const unsigned char* c, std::size_t n, std::uint32_t out[3]) {
  std::uint64_t ca = 0xFFFFFFFFu, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ca = __builtin_ia32_crc32di(ca, load64(a + i));
    cb = __builtin_ia32_crc32di(cb, load64(b + i));
    cc = __builtin_ia32_crc32di(cc, load64(c + i));
  }
  out[0] = crc_hw(a + i, n - i, ~static_cast<std::uint32_t>(ca));
  out[1] = crc_hw(b + i, n - i, ~static_cast<std::uint32_t>(cb));
  out[2] = crc_hw(c + i, n - i, ~static_cast<std::uint32_t>(cc));
}

bool detect_hardware() {
  __builtin_cpu_init();  // may run before the libgcc constructor that fills the CPU model
  return __builtin_cpu_supports("sse4.2");
}

const bool kHardware = detect_hardware();

}  // namespace

bool crc32c_hardware() { return kHardware; }

std::uint32_t crc32c_fast(const void* data, std::size_t bytes, std::uint32_t crc) {
  if (kHardware) return crc_hw(static_cast<const unsigned char*>(data), bytes, crc);
  return zoe::crc32c(data, bytes, crc);
}

void crc32c_x3(const void* a, const void* b, const void* c, std::size_t bytes, std::uint32_t out[3]) {
  if (kHardware) {
    crc_hw_x3(static_cast<const unsigned char*>(a), static_cast<const unsigned char*>(b),
              static_cast<const unsigned char*>(c), bytes, out);
    return;
  }
  out[0] = zoe::crc32c(a, bytes);
  out[1] = zoe::crc32c(b, bytes);
  out[2] = zoe::crc32c(c, bytes);
}

}  // namespace zoe::aio
