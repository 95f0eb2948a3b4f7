// Page-aligned anonymous host memory: the raw material of pinned slabs, staging buffers and the
// host backend's arena. Buffers from here satisfy O_DIRECT's alignment (4 KiB).
#pragma once

#include <cstddef>
#include <utility>

namespace strata {

inline constexpr std::size_t kPageBytes = 4096;

/// Maps `bytes` (rounded up to pages) of zeroed, page-aligned memory. `reserve_only` maps with
/// MAP_NORESERVE for an arena that is touched lazily. Throws OutOfMemoryError naming `tier` when
/// the kernel refuses.
void* map_pages(std::size_t bytes, const char* tier, bool reserve_only = false);
void unmap_pages(void* data, std::size_t bytes) noexcept;
/// mlock()s the range; on refusal (RLIMIT_MEMLOCK) warns once per process and returns false.
bool lock_pages(void* data, std::size_t bytes) noexcept;
/// Physical memory of this machine in bytes (0 if unknown).
std::size_t physical_memory_bytes() noexcept;

/// Move-only owner of map_pages() memory, optionally locked.
class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(std::size_t bytes, bool lock = false, const char* tier = "Host");
  PageBuffer(PageBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        locked_(other.locked_) {}
  PageBuffer& operator=(PageBuffer&& other) noexcept {
    if (this != &other) {
      unmap_pages(data_, bytes_);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      locked_ = other.locked_;
    }
    return *this;
  }
  ~PageBuffer() { unmap_pages(data_, bytes_); }

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] bool locked() const noexcept { return locked_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool locked_ = false;
};

}  // namespace strata
