#include "strata/io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>

#include "strata/base/error.h"

namespace strata {

const DeviceLimits File::kUnknownDevice{};

void File::find_device() noexcept {
  struct stat st {};
  if (::fstat(fd_, &st) == 0) device_ = &device_limits(st.st_dev);
}

File::File(std::string path, Mode mode, bool direct) : path_(std::move(path)) {
  int flags = O_CLOEXEC;
  switch (mode) {
    case Mode::Read:
      flags |= O_RDONLY;
      break;
    case Mode::ReadWrite:
      flags |= O_RDWR;
      break;
    case Mode::Create:
      flags |= O_RDWR | O_CREAT | O_TRUNC;
      break;
  }
  if (direct) {
    fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0644);
    if (fd_ >= 0) {
      direct_ = true;
      find_device();
      return;
    }
    if (errno != EINVAL) throw IoError(Errc::io_error, path_, 0, 0, errno, "open");
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      std::fprintf(stderr,
                   "strata: warning: %s: the filesystem refuses O_DIRECT (tmpfs?); using "
                   "buffered I/O for such files\n",
                   path_.c_str());
    }
  }
  fd_ = ::open(path_.c_str(), flags, 0644);
  if (fd_ < 0) throw IoError(Errc::io_error, path_, 0, 0, errno, "open");
  find_device();
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    direct_ = other.direct_;
    device_ = other.device_;
  }
  return *this;
}

File::~File() {
  close();
}

void File::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw IoError(Errc::io_error, path_, 0, 0, errno, "fstat");
  return static_cast<std::uint64_t>(st.st_size);
}

void File::allocate(std::uint64_t bytes) {
  if (bytes == 0) return;
  const int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
  if (rc != 0) throw IoError(Errc::io_error, path_, 0, bytes, rc, "fallocate");
}

}  // namespace strata
