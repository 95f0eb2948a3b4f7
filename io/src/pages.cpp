#include "strata/io/pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "strata/io/error.h"
#include "strata/io/units.h"

namespace strata {

void* map_pages(std::size_t bytes, const char* tier, bool reserve_only) {
  const std::size_t length = align_up(bytes, kPageBytes);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (reserve_only) flags |= MAP_NORESERVE;
  void* data = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (data == MAP_FAILED) {
    throw OutOfMemoryError(
        tier, bytes, 0, 0,
        detail::concat("mmap of ", length, " bytes failed: ", std::strerror(errno)));
  }
  return data;
}

void unmap_pages(void* data, std::size_t bytes) noexcept {
  if (data != nullptr) ::munmap(data, align_up(bytes, kPageBytes));
}

bool lock_pages(void* data, std::size_t bytes) noexcept {
  if (::mlock(data, align_up(bytes, kPageBytes)) == 0) return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    std::fprintf(stderr,
                 "strata: warning: could not lock %zu bytes of host memory (mlock: %s); "
                 "pinned buffers stay pageable. Raise RLIMIT_MEMLOCK (ulimit -l) to pin them.\n",
                 bytes, std::strerror(errno));
  }
  return false;
}

std::size_t physical_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : 0;
}

PageBuffer::PageBuffer(std::size_t bytes, bool lock, const char* tier)
    : data_(map_pages(bytes, tier)), bytes_(bytes) {
  if (lock) locked_ = lock_pages(data_, bytes_);
}

}  // namespace strata
