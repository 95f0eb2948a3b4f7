// The Runtime's statistics as it reports them: counters of one tier (TierStats) and bytes moved
// per path (TransferStats). Plain records; runtime/src/statistics.h counts them, as an Observer.
#pragma once

#include <cstdint>

namespace strata {

/// Counters of one tier. Bytes are the tensors' bytes.
struct TierStats {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t leased_bytes = 0;
  std::uint64_t bytes_in = 0;     ///< moved into this tier
  std::uint64_t bytes_out = 0;    ///< written back from this tier to the one below
  std::uint64_t moves = 0;        ///< copies that arrived in this tier
  std::uint64_t evictions = 0;    ///< copies dropped or demoted to make room (or asked)
  std::uint64_t write_backs = 0;  ///< dirty copies written to the tier below
  std::uint64_t hits = 0;         ///< acquires that found a current copy
  std::uint64_t misses = 0;       ///< acquires that had to move the tensor
  std::uint64_t compactions = 0;  ///< copies slid to close holes
  /// Note [Compressed copies]: of bytes_in, those that arrived compressed (on the device: the
  /// compressed bytes read to make a copy), and the dequantizations done here.
  std::uint64_t bytes_in_compressed = 0;
  std::uint64_t dequantizations = 0;
  std::uint64_t bytes_dequantized = 0;  ///< full-width bytes they produced
  std::uint64_t dequant_ns = 0;         ///< their time on the stream that ran them
};

/// Bytes moved, named after the path they took: NVMe chunks landing in a kept host copy count as
/// nvme_to_host and then host_to_device; chunks through staging slots or landing in the device
/// copy directly (Note [Direct NVMe to device]) count as nvme_to_device.
struct TransferStats {
  std::uint64_t bytes_host_to_device = 0;
  std::uint64_t bytes_device_to_host = 0;
  std::uint64_t bytes_nvme_to_host = 0;
  std::uint64_t bytes_host_to_nvme = 0;
  std::uint64_t bytes_nvme_to_device = 0;
  std::uint64_t bytes_device_to_nvme = 0;
};

}  // namespace strata
