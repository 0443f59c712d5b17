// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of iSCSI, ext4 and RocksDB: better
// error detection than CRC-32 for the same cost. The one implementation in zoe (checkpoints, swap files): the
// SSE4.2 crc32 instruction where the CPU has it (checked at run time), software slicing-by-8 otherwise; the
// values are the same either way.
#pragma once

#include "base/private.h"

#include <cstddef>
#include <cstdint>

namespace zoe {

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (the CRC of the bytes before them; 0 for
// none), so that crc32c(b, nb, crc32c(a, na)) == crc32c(a followed by b). Check value:
// crc32c("123456789", 9) == 0xE3069283. From 64 KiB on, the hardware path runs three chains over the
// buffer's thirds and joins them (about 2.8x the rate of one chain: 26 against 9.6 GB/s for 16 MiB on a Zen 4).
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0);

// The CRC-32C of three arrays of the same length at once (a swap tile's p, m and v): three independent chains
// keep the crc32 unit busy, where one chain waits on its own latency.
void crc32c_x3(const void* a, const void* b, const void* c, std::size_t bytes, std::uint32_t out[3]);

bool crc32c_hardware();  // whether the SSE4.2 path runs
// The software path whatever the CPU: the reference the hardware path is tested against.
std::uint32_t crc32c_software(const void* data, std::size_t bytes, std::uint32_t crc = 0);

}  // namespace zoe
