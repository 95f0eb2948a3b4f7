// RuntimeOptions: everything that configures a strata runtime, as C++ structs or as one JSON
// document with the same keys. Sizes accept units ("512MiB", "2GB") or plain byte counts.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "strata/io/io_options.h"
#include "strata/io/swap_space.h"
#include "strata/base/tunables.h"
#include "strata/runtime/backend.h"

namespace strata {

enum class EvictionKind { Lru, FarthestNextUse };
std::string_view to_string(EvictionKind kind) noexcept;

/// JSON keys (all optional):
/// ```
/// { "backend": "auto|host|cuda", "device_budget": "1GiB", "host_budget": "4GiB",
///   "link_gbps": 25, "device_ordinal": 0,
///   "nvme": { "paths": ["/mnt/nvme0", "/mnt/nvme1"], "capacity": "100GiB",
///             "stripe": "1MiB", "keep_files": false },
///   "io": { "engine": "auto|uring|posix", "block": "1MiB", "queue_depth": 16,
///           "threads": 4, "direct": true, "sqpoll": false, "faults": ["read:3:eio"] },
///   "checksums": true, "eviction": "lru|farthest_next_use", "trace_events": 65536,
///   "staging_chunk": "4MiB", "staging_chunks": 4, "host_copy_on_the_way": true,
///   "quiet": false }
/// ```
/// The smallest staging slot and slot count a small host budget is shrunk to.
inline constexpr std::size_t kMinStagingChunkBytes = tunables::kMinStagingChunkBytes;
inline constexpr unsigned kMinStagingChunks = tunables::kMinStagingChunks;

struct RuntimeOptions {
  BackendOptions backend;
  std::size_t host_budget_bytes = tunables::kHostBudgetBytes;  ///< pinned host tier (one slab)
  SwapOptions nvme;                                            ///< no paths = no NVMe tier
  IoOptions io;
  bool checksums = true;
  EvictionKind eviction = EvictionKind::Lru;
  std::size_t trace_events = tunables::kTraceEvents;               ///< telemetry ring size
  std::size_t staging_chunk_bytes = tunables::kStagingChunkBytes;  ///< NVMe<->device pipeline chunk
  unsigned staging_chunks = tunables::kStagingChunks;  ///< staging slots in the host slab
  /// An NVMe -> device move keeps a host copy on the way when the host tier has room without
  /// evicting. false: it does not, and on a host-addressable device with no link model (the
  /// host backend, unpaced) the chunks then land in the device copy itself (Note [Direct NVMe
  /// to device]): for a model streamed through a host tier smaller than it, where the host
  /// copies would be evicted before reuse and each costs a memcpy on the compute's cores.
  bool host_copy_on_the_way = true;
  bool quiet = false;

  /// Throws strata::Error (invalid_argument) naming the first bad key.
  void validate() const;
  /// Shrinks a staging area that does not fit the host budget with one I/O block (Note
  /// [Staging fits the budget]); says what it changed, or "" when it fits as configured. The
  /// Runtime calls it (and prints the sentence unless quiet).
  std::string fit_staging_to_budget();
  /// Parses and validates a JSON document; unknown keys and impossible values are errors naming
  /// the key ("nvme.capacity: ...").
  static RuntimeOptions from_json(std::string_view json);
};

}  // namespace strata
