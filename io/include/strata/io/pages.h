// Page-aligned anonymous host memory: the raw material of pinned slabs, staging buffers and the
// host backend's arena. Buffers from here satisfy O_DIRECT's alignment (4 KiB); those of 2 MiB or
// more are 2 MiB aligned and backed by huge pages where the system allows (Note [Huge pages]).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace strata {

inline constexpr std::size_t kPageBytes = 4096;
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// Note [Huge pages]
// ~~~~~~~~~~~~~~~~~
// An O_DIRECT request is one bio whose segments are the physically contiguous runs of its
// buffer. A buffer of scattered 4 KiB pages gives one segment per page, and the block layer
// splits a request at the queue's max_segments (254 on a virtio disk, 128 on many NVMe drives):
// a 4 MiB read from 4 KiB pages (1024 segments) reaches the device as several smaller requests,
// and the device's bandwidth at 4 MiB is never seen (measured on a virtio disk: fio 0.6-0.8 GB/s
// with default buffers, 1.35-1.65 GB/s with --iomem=shmhuge; one thread's 4 MiB preadv 0.65 GB/s
// from 4 KiB pages, 1.25 GB/s from a THP-backed buffer). A 2 MiB page is one segment, so the
// request goes whole, up to max_sectors_kb. Fewer TLB misses in memcpy and io_uring's buffer
// registration (one bvec per huge page) come with it.
//
// So every mapping of kHugePageBytes or more is 2 MiB aligned and occupies whole 2 MiB pages
// (its length is rounded up; the slack is at most 2 MiB - 4 KiB per buffer, and only touched if
// the buffer is locked), and is backed according to a HugePages policy:
//  - Transparent (default): madvise(MADV_HUGEPAGE) before the first touch or mlock, which works
//    when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always". With defrag
//    "madvise" (the kernel's default) the fault compacts memory to find a huge page; with
//    "never"/"defer" it may get 4 KiB pages that khugepaged merges later.
//  - Hugetlb: MAP_HUGETLB from the pages reserved with vm.nr_hugepages; never swapped, never
//    fragmented, but only as many as an administrator set aside.
//  - Off: 4 KiB pages (MADV_NOHUGEPAGE, so not even THP "always" changes them).
// A policy the system cannot honour falls back (Hugetlb -> Transparent -> Off) with one warning
// per process naming what was asked and what is there; it never fails an allocation. Smaller
// buffers and reserve_only arenas (touched lazily, never read into with O_DIRECT as a whole) are
// left to the kernel's default. huge_page_bytes() says what a buffer really got.
enum class HugePages { Transparent, Hugetlb, Off };

/// "transparent", "hugetlb" or "off".
const char* to_string(HugePages huge) noexcept;
/// Parses "transparent" | "hugetlb" | "off". @throws strata::Error (invalid_argument) naming
/// `what`.
HugePages parse_huge_pages(std::string_view text, std::string_view what = "huge pages");
/// The policy map_pages uses unless told: STRATA_HUGE_PAGES from the environment (read once; an
/// unknown value warns and is ignored), else HugePages::Transparent.
HugePages default_huge_pages() noexcept;

/// Bytes a mapping of `bytes` occupies: whole 2 MiB pages from kHugePageBytes on, else 4 KiB.
constexpr std::size_t mapped_bytes(std::size_t bytes) noexcept {
  const std::size_t unit = bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes;
  return (bytes + unit - 1) & ~(unit - 1);
}

/// Maps `bytes` of zeroed memory, 4 KiB aligned, and 2 MiB aligned from kHugePageBytes on, backed
/// as `huge` asks (Note [Huge pages]); `*used`, if given, receives the policy in effect (Off for a
/// small mapping). `reserve_only` maps with MAP_NORESERVE for an arena that is touched lazily:
/// it takes transparent huge pages (never hugetlb) as it is touched, when THP is usable. Throws
/// OutOfMemoryError naming `tier` when the kernel refuses the memory, or when the memory cgroup
/// has no room for a buffer used whole (Note [Memory limits] in memory_limits.h).
void* map_pages(std::size_t bytes, const char* tier, bool reserve_only = false,
                HugePages huge = default_huge_pages(), HugePages* used = nullptr);
/// Unmaps what map_pages(`bytes`, ...) returned; null is ignored.
void unmap_pages(void* data, std::size_t bytes) noexcept;
/// mlock()s the whole mapping; on refusal warns once per process, naming `tier`, the bytes asked,
/// RLIMIT_MEMLOCK, the bytes already locked and how to raise the limit (Note [Memory limits] in
/// memory_limits.h), and returns false: the buffer stays usable, pageable.
bool lock_pages(void* data, std::size_t bytes, const char* tier = "Host (pinned)") noexcept;
/// Physical memory of this machine in bytes (0 if unknown).
std::size_t physical_memory_bytes() noexcept;

/// Bytes of [data, data + bytes) resident in huge pages, read from /proc/self/smaps: a mapping's
/// AnonHugePages (THP) or Private_/Shared_Hugetlb (MAP_HUGETLB). Exact for a range covering whole
/// mappings, as map_pages' buffers do; where the range covers part of a mapping (the kernel may
/// merge neighbouring buffers with the same flags into one) it counts at most that mapping's huge
/// bytes and at most the overlap. 0 if smaps cannot be read.
std::size_t huge_page_bytes(const void* data, std::size_t bytes);

/// Move-only owner of map_pages() memory, optionally locked.
class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(std::size_t bytes, bool lock = false, const char* tier = "Host",
                      HugePages huge = default_huge_pages());
  PageBuffer(PageBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        locked_(other.locked_),
        huge_(other.huge_) {}
  PageBuffer& operator=(PageBuffer&& other) noexcept {
    if (this != &other) {
      unmap_pages(data_, bytes_);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      locked_ = other.locked_;
      huge_ = other.huge_;
    }
    return *this;
  }
  ~PageBuffer() { unmap_pages(data_, bytes_); }

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] bool locked() const noexcept { return locked_; }
  /// The policy in effect for this buffer (after any fallback; Off below kHugePageBytes).
  [[nodiscard]] HugePages huge_pages() const noexcept { return huge_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool locked_ = false;
  HugePages huge_ = HugePages::Off;
};

namespace detail {

/// What map_pages does with a request, decided from the system's state; `warning` is non-empty
/// when `use` is less than asked. `thp_enabled` is the text of
/// /sys/kernel/mm/transparent_hugepage/enabled ("" if absent), `hugetlb_free_bytes` is
/// HugePages_Free times the huge page size. Pure, for tests.
struct HugePagePlan {
  HugePages use = HugePages::Off;
  std::string warning;
};
HugePagePlan plan_huge_pages(HugePages asked, std::size_t bytes, std::string_view thp_enabled,
                             std::size_t hugetlb_free_bytes, const char* tier);

/// The active THP mode in `thp_enabled` text ("always [madvise] never" -> "madvise"; "" if none).
std::string_view thp_mode(std::string_view thp_enabled) noexcept;

/// Lets the next fallback warn again (the warning is once per process); for tests.
void reset_huge_page_warning() noexcept;

}  // namespace detail

}  // namespace strata
