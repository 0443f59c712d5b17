// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of iSCSI, ext4 and RocksDB: better
// error detection than CRC-32 for the same cost. Software, slicing-by-8; no ISA-specific code.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zoe {

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (the CRC of the bytes before them; 0 for
// none), so that crc32c(b, nb, crc32c(a, na)) == crc32c(a followed by b). Check value:
// crc32c("123456789", 9) == 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0);

}  // namespace zoe
