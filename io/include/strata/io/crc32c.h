// CRC32C (Castagnoli), as used by iSCSI, ext4 and RocksDB. SSE4.2 hardware instruction where the
// CPU has it (chosen at run time), a table otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

/// CRC32C of `bytes` bytes at `data`, continuing from `crc` (0 to start).
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept;
/// True when crc32c() uses the hardware instruction.
bool crc32c_hardware() noexcept;

}  // namespace strata
