// Options of the I/O engines and their defaults, in one place. Each is overridable and
// validated; a bad value is an error naming its key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/base/tunables.h"

namespace strata {

enum class EngineKind { Auto, Uring, Posix };
std::string_view to_string(EngineKind kind) noexcept;
/// Parses "auto", "uring" or "posix"; throws strata::Error naming `key` otherwise.
EngineKind parse_engine_kind(std::string_view text, std::string_view key = "io.engine");

/// One injected fault: the `nth` (1-based) read or write operation the engine completes fails
/// with EIO or ENOSPC, or transfers only part of its bytes (the engine must resubmit the rest).
/// Counted per operation the engine issues (a request split into chunks issues several).
/// `ring:N:eio|enospc`: the io_uring engine's N-th wait for completions fails with that errno,
/// as an unexpected error of the kernel's would (the posix engine has no ring and ignores it).
struct FaultSpec {
  enum class Op { Read, Write, Ring };
  enum class Kind { Eio, Enospc, Short };
  Op op = Op::Read;
  std::uint64_t nth = 1;
  Kind kind = Kind::Eio;
};
/// False when the build compiled fault injection out (-DSTRATA_FAULT_INJECTION=OFF).
bool fault_injection_available() noexcept;
/// Parses "read:3:eio", "write:10:enospc", "read:1:short", "ring:2:eio".
FaultSpec parse_fault(std::string_view text, std::string_view key = "io.faults");

namespace io_defaults = tunables;  // the defaults below: strata/base/tunables.h

struct IoOptions {
  EngineKind engine = EngineKind::Auto;
  std::size_t block_size = io_defaults::kBlockBytes;  ///< multiple of 4 KiB, 4 KiB..1 GiB
  unsigned queue_depth = io_defaults::kQueueDepth;    ///< 1..4096
  unsigned threads = io_defaults::kPosixThreads;      ///< 1..256 (POSIX engine)
  bool direct = io_defaults::kDirect;
  bool sqpoll = false;            ///< io_uring kernel submission thread
  std::vector<FaultSpec> faults;  ///< fault injection (tests)
  bool quiet = false;             ///< no notices on stderr

  /// Throws strata::Error (invalid_argument) naming the first bad key.
  void validate() const;
};

}  // namespace strata
