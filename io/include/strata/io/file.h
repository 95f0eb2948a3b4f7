// File: an open file descriptor with the facts I/O needs (path, O_DIRECT or not, the block
// device behind it). RAII.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "strata/io/device_limits.h"

namespace strata {

class File {
 public:
  enum class Mode {
    Read,       ///< existing file, read-only
    ReadWrite,  ///< existing file
    Create,     ///< create or truncate, read-write
  };

  File() = default;
  /// Opens `path`. With `direct`, tries O_DIRECT first; a filesystem that refuses it (tmpfs)
  /// gets buffered I/O and one warning per process on stderr.
  /// @throws IoError naming the path and errno (ENOENT, EACCES, EROFS, ...).
  File(std::string path, Mode mode, bool direct);
  File(File&& other) noexcept
      : path_(std::move(other.path_)),
        fd_(std::exchange(other.fd_, -1)),
        direct_(other.direct_),
        device_(other.device_) {}
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// True when opened with O_DIRECT: offsets, lengths and buffers must be 4 KiB aligned.
  [[nodiscard]] bool direct() const noexcept { return direct_; }
  [[nodiscard]] bool is_open() const noexcept { return fd_ >= 0; }
  /// The request limits of the block device holding the file (Note [Request sizes]); unknown
  /// (all 0) for a file on tmpfs, overlayfs or any filesystem without a block device.
  [[nodiscard]] const DeviceLimits& device() const noexcept { return *device_; }
  [[nodiscard]] std::uint64_t size() const;
  /// Reserves [0, bytes) on disk (fallocate). @throws IoError, e.g. ENOSPC naming the path.
  void allocate(std::uint64_t bytes);
  void close() noexcept;

 private:
  void find_device() noexcept;

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  const DeviceLimits* device_ = &kUnknownDevice;

  static const DeviceLimits kUnknownDevice;
};

}  // namespace strata
