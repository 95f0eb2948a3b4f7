// strata error types. Note [Errors]: every layer reports failures as exceptions derived from
// strata::Error; each carries an Errc (mapped 1:1 to the C API's negative codes) and a message
// that names the values that explain it (which tier, which key, which file, how much was asked
// and free). Destructors never throw; functions marked noexcept never report through errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace strata {

/// Error categories. Values are stable: the C API returns their negation.
enum class Errc : int {
  invalid_argument = 1,  ///< a bad parameter, configuration key or value
  out_of_memory = 2,     ///< a tier (device, pinned host, NVMe swap) has no room
  io_error = 3,          ///< a read, write, open or allocate on a file failed
  corrupt_data = 4,      ///< a checksum or format check failed
  cuda_error = 5,        ///< a CUDA runtime call failed
  unsupported = 6,       ///< the build or the machine cannot do what was asked
  not_found = 7,         ///< a named tensor, file or key does not exist
  internal = 8,          ///< a broken invariant inside strata
};

/// Short name of an error category ("out_of_memory").
const char* to_string(Errc code) noexcept;

/// Base of every strata exception.
class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

/// A tier could not satisfy an allocation. Carries the numbers that explain why.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(std::string tier, std::size_t requested_bytes, std::size_t free_bytes,
                   std::size_t largest_free_bytes, const std::string& detail = {});
  [[nodiscard]] const std::string& tier() const noexcept { return tier_; }
  [[nodiscard]] std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  [[nodiscard]] std::size_t free_bytes() const noexcept { return free_bytes_; }
  [[nodiscard]] std::size_t largest_free_bytes() const noexcept { return largest_free_bytes_; }

 private:
  std::string tier_;
  std::size_t requested_bytes_;
  std::size_t free_bytes_;
  std::size_t largest_free_bytes_;
};

/// A file operation failed. Names the file, the byte range and the system error.
class IoError : public Error {
 public:
  /// `error` is a positive errno (EIO, ENOSPC, ...) or 0 for a non-system failure (a checksum
  /// mismatch uses Errc::corrupt_data).
  IoError(Errc code, std::string path, std::uint64_t offset, std::uint64_t bytes, int error,
          const std::string& what_failed);
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] int error_number() const noexcept { return errno_; }

 private:
  std::string path_;
  std::uint64_t offset_;
  std::uint64_t bytes_;
  int errno_;
};

namespace detail {
/// Concatenates anything streamable; for building error messages only (not a hot path).
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}
}  // namespace detail

}  // namespace strata

/// Throws strata::Error(Errc::invalid_argument) with the streamed message unless `cond` holds.
#define STRATA_EXPECTS(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) [[unlikely]]                                       \
      throw ::strata::Error(::strata::Errc::invalid_argument,       \
                            ::strata::detail::concat(__VA_ARGS__)); \
  } while (0)

/// Throws strata::Error(code) with the streamed message.
#define STRATA_FAIL(code, ...) throw ::strata::Error((code), ::strata::detail::concat(__VA_ARGS__))
