// CRC-32C for the swap store's per-tile checksums, with the SSE4.2 crc32 instruction where the CPU has it
// (checked at run time; the software slicing-by-8 of src/offload/crc32c.h otherwise). The values are the
// same either way: crc32c_fast(d, n) == zoe::crc32c(d, n).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zoe::aio {

std::uint32_t crc32c_fast(const void* data, std::size_t bytes, std::uint32_t crc = 0);

// The CRC-32C of three arrays of the same length at once (a tile's p, m and v): three independent chains
// keep the crc32 unit busy, where one chain waits on its own latency.
void crc32c_x3(const void* a, const void* b, const void* c, std::size_t bytes, std::uint32_t out[3]);

bool crc32c_hardware();  // whether the SSE4.2 path runs

}  // namespace zoe::aio
