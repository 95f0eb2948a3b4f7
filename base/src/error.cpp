#include "strata/base/error.h"

#include <cstring>

#include "strata/base/units.h"

namespace strata {

const char* to_string(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::out_of_memory:
      return "out_of_memory";
    case Errc::io_error:
      return "io_error";
    case Errc::corrupt_data:
      return "corrupt_data";
    case Errc::cuda_error:
      return "cuda_error";
    case Errc::unsupported:
      return "unsupported";
    case Errc::not_found:
      return "not_found";
    case Errc::internal:
      return "internal";
  }
  return "unknown";
}

OutOfMemoryError::OutOfMemoryError(std::string tier, std::size_t requested_bytes,
                                   std::size_t free_bytes, std::size_t largest_free_bytes,
                                   const std::string& detail)
    : Error(Errc::out_of_memory,
            detail::concat("out of memory on tier ", tier, ": asked for ", requested_bytes,
                           " bytes (", format_bytes(requested_bytes), "), ", free_bytes,
                           " bytes free (", format_bytes(free_bytes), "), largest free block ",
                           largest_free_bytes, " bytes (", format_bytes(largest_free_bytes), ")",
                           detail.empty() ? "" : "; ", detail)),
      tier_(std::move(tier)),
      requested_bytes_(requested_bytes),
      free_bytes_(free_bytes),
      largest_free_bytes_(largest_free_bytes) {}

IoError::IoError(Errc code, std::string path, std::uint64_t offset, std::uint64_t bytes, int error,
                 const std::string& what_failed)
    : Error(code,
            detail::concat(what_failed, " of ", bytes, " bytes at offset ", offset, " of ", path,
                           error != 0 ? ": " : "", error != 0 ? std::strerror(error) : "",
                           error != 0 ? detail::concat(" (errno ", error, ")") : "")),
      path_(std::move(path)),
      offset_(offset),
      bytes_(bytes),
      errno_(error) {}

}  // namespace strata
