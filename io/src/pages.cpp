// Page-aligned and huge-page buffers (Note [Huge pages] in pages.h): mapping, advising, locking
// and measuring them. The memory limits they are checked against are read and reported in
// memory_limits.cpp; nothing here reads a cgroup or words a limit.
#include "strata/io/pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "strata/base/error.h"
#include "strata/io/memory_limits.h"
#include "strata/base/units.h"

namespace strata {
namespace {

constexpr const char* kThpEnabledPath = "/sys/kernel/mm/transparent_hugepage/enabled";

std::atomic<bool> g_huge_page_warned{false};

void warn_huge_pages_once(const std::string& warning) {
  if (warning.empty() || g_huge_page_warned.exchange(true)) return;
  std::fprintf(stderr, "strata: warning: %s\n", warning.c_str());
}

// The THP mode is fixed for the process's purposes: read once (one line; "" if absent).
const std::string& thp_enabled_text() {
  static const std::string text = [] {
    std::ifstream in(kThpEnabledPath);
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return text;
}

bool thp_usable(std::string_view thp_enabled) {
  const std::string_view mode = detail::thp_mode(thp_enabled);
  return mode == "madvise" || mode == "always";
}

std::string thp_state(std::string_view thp_enabled) {
  const std::string_view mode = detail::thp_mode(thp_enabled);
  if (mode.empty()) return detail::concat("THP is unavailable (no ", kThpEnabledPath, ")");
  return detail::concat("THP is \"", mode, "\" (", kThpEnabledPath, ")");
}

void* checked_mmap(std::size_t length, int flags, const char* tier, std::size_t bytes) {
  void* data = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (data == MAP_FAILED) {
    throw OutOfMemoryError(
        tier, bytes, 0, 0,
        detail::concat("mmap of ", length, " bytes failed: ", std::strerror(errno)));
  }
  return data;
}

// Maps `length` (a multiple of kHugePageBytes) at a 2 MiB boundary: over-maps by 2 MiB and
// unmaps the unaligned head and tail.
void* map_aligned(std::size_t length, int flags, const char* tier, std::size_t bytes) {
  auto* raw = static_cast<std::byte*>(checked_mmap(length + kHugePageBytes, flags, tier, bytes));
  const auto address = reinterpret_cast<std::uintptr_t>(raw);
  auto* data = raw + (align_up(address, kHugePageBytes) - address);
  if (data != raw) ::munmap(raw, static_cast<std::size_t>(data - raw));
  if (const std::size_t tail =
          static_cast<std::size_t>(raw + length + kHugePageBytes - (data + length));
      tail != 0)
    ::munmap(data + length, tail);
  return data;
}

}  // namespace

const char* to_string(HugePages huge) noexcept {
  switch (huge) {
    case HugePages::Transparent:
      return "transparent";
    case HugePages::Hugetlb:
      return "hugetlb";
    case HugePages::Off:
      return "off";
  }
  return "?";
}

HugePages parse_huge_pages(std::string_view text, std::string_view what) {
  for (const HugePages h : {HugePages::Transparent, HugePages::Hugetlb, HugePages::Off})
    if (text == to_string(h)) return h;
  STRATA_FAIL(Errc::invalid_argument, what, ": \"", text,
              "\" is not one of transparent, hugetlb, off");
}

HugePages default_huge_pages() noexcept {
  static const HugePages policy = [] {
    const char* env = std::getenv("STRATA_HUGE_PAGES");
    if (env == nullptr || *env == '\0') return HugePages::Transparent;
    try {
      return parse_huge_pages(env, "STRATA_HUGE_PAGES");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "strata: warning: %s; using transparent\n", e.what());
      return HugePages::Transparent;
    }
  }();
  return policy;
}

namespace detail {

std::string_view thp_mode(std::string_view thp_enabled) noexcept {
  const std::size_t open = thp_enabled.find('[');
  const std::size_t close = thp_enabled.find(']', open);
  if (open == std::string_view::npos || close == std::string_view::npos) return {};
  return thp_enabled.substr(open + 1, close - open - 1);
}

HugePagePlan plan_huge_pages(HugePages asked, std::size_t bytes, std::string_view thp_enabled,
                             std::size_t hugetlb_free_bytes, const char* tier) {
  if (bytes < kHugePageBytes || asked == HugePages::Off) return {};
  const std::size_t length = mapped_bytes(bytes);
  if (asked == HugePages::Hugetlb && hugetlb_free_bytes >= length) return {HugePages::Hugetlb, {}};
  const bool thp = thp_usable(thp_enabled);
  const HugePages use = thp ? HugePages::Transparent : HugePages::Off;
  const std::string fallback =
      thp ? concat("using transparent huge pages (", thp_state(thp_enabled), ")")
          : concat(
                "using 4 KiB pages, so O_DIRECT requests from this buffer are split at the "
                "disk's segment limit");
  if (asked == HugePages::Hugetlb) {
    return {use, concat(tier, " asked for hugetlb pages for ", format_bytes(length),
                        " but HugePages_Free has ", format_bytes(hugetlb_free_bytes),
                        " available (reserve them with sysctl vm.nr_hugepages); ", fallback,
                        thp ? "" : concat("; ", thp_state(thp_enabled)))};
  }
  if (thp) return {HugePages::Transparent, {}};
  return {HugePages::Off,
          concat(tier, " asked for transparent huge pages for ", format_bytes(length), " but ",
                 thp_state(thp_enabled),
                 " and no hugetlb pages were asked for (STRATA_HUGE_PAGES=hugetlb with "
                 "vm.nr_hugepages); ",
                 fallback, ". Set ", kThpEnabledPath, " to madvise or always.")};
}

void reset_huge_page_warning() noexcept {
  g_huge_page_warned.store(false);
}

}  // namespace detail

void* map_pages(std::size_t bytes, const char* tier, bool reserve_only, HugePages huge,
                HugePages* used) {
  const std::size_t length = mapped_bytes(bytes);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (reserve_only) flags |= MAP_NORESERVE;
  if (bytes < kHugePageBytes) {
    if (used != nullptr) *used = HugePages::Off;
    return checked_mmap(length, flags, tier, bytes);
  }
  if (reserve_only) {
    detail::check_cgroup_room(length, bytes, tier, reserve_only);
    // A lazily touched arena (the host backend's device tier, where NVMe reads may land
    // directly): no pages can be reserved up front, so hugetlb is out, but transparent huge
    // pages come with the first touch of each 2 MiB. Where THP is unusable it stays on 4 KiB
    // pages silently: the pinned slab's warning already says so.
    void* data = map_aligned(length, flags, tier, bytes);
    const bool thp = huge != HugePages::Off && thp_usable(thp_enabled_text()) &&
                     ::madvise(data, length, MADV_HUGEPAGE) == 0;
    if (!thp) ::madvise(data, length, MADV_NOHUGEPAGE);
    if (used != nullptr) *used = thp ? HugePages::Transparent : HugePages::Off;
    return data;
  }

  const std::size_t hugetlb_free = huge == HugePages::Hugetlb ? detail::hugetlb_free_bytes() : 0;
  detail::HugePagePlan plan =
      detail::plan_huge_pages(huge, bytes, thp_enabled_text(), hugetlb_free, tier);
  void* data = nullptr;
  if (plan.use == HugePages::Hugetlb) {
    // hugetlb mappings are huge-page aligned by the kernel; the pages are reserved here, so a
    // pool emptied since /proc/meminfo was read shows as ENOMEM.
    data = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, flags | MAP_HUGETLB, -1, 0);
    if (data == MAP_FAILED) {
      const int error = errno;
      data = nullptr;
      plan = detail::plan_huge_pages(huge, bytes, thp_enabled_text(), 0, tier);
      plan.warning =
          detail::concat(plan.warning, " (mmap MAP_HUGETLB: ", std::strerror(error), ")");
    }
  }
  if (data == nullptr) {
    // hugetlb pages are charged to the hugetlb controller and reserved by the mmap above; these
    // are charged to the memory cgroup as they are touched.
    detail::check_cgroup_room(length, bytes, tier, /*reserve_only=*/false);
    data = map_aligned(length, flags, tier, bytes);
    // Before the first touch, so the first fault (or mlock) takes the pages advised.
    if (plan.use == HugePages::Transparent) {
      if (::madvise(data, length, MADV_HUGEPAGE) != 0) {
        plan.warning = detail::concat(
            tier, " asked for ", to_string(huge), " huge pages for ", format_bytes(length),
            " but madvise(MADV_HUGEPAGE) failed: ", std::strerror(errno), "; using 4 KiB pages");
        plan.use = HugePages::Off;
      }
    } else {
      ::madvise(data, length, MADV_NOHUGEPAGE);  // Off means 4 KiB pages, even under THP "always"
    }
  }
  warn_huge_pages_once(plan.warning);
  if (used != nullptr) *used = plan.use;
  return data;
}

void unmap_pages(void* data, std::size_t bytes) noexcept {
  if (data != nullptr) ::munmap(data, mapped_bytes(bytes));
}

bool lock_pages(void* data, std::size_t bytes, const char* tier) noexcept {
  // The whole mapping: a lock ending inside a 2 MiB page would split it (and a hugetlb mapping
  // cannot be split at all).
  const std::size_t length = mapped_bytes(bytes);
  if (::mlock(data, length) == 0) return true;
  detail::warn_lock_failure(tier, length, bytes, errno);
  return false;
}

std::size_t physical_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : 0;
}

std::size_t huge_page_bytes(const void* data, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t end = begin + bytes;
  std::ifstream smaps("/proc/self/smaps");
  std::size_t total = 0;
  std::size_t overlap = 0;  // of the current mapping with the range; 0 when they do not meet
  std::size_t huge = 0;     // the current mapping's huge bytes
  auto finish = [&] {
    total += std::min(huge, overlap);
    huge = overlap = 0;
  };
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long lo = 0, hi = 0;
    char dash = 0;
    // A mapping's header "lo-hi perms ..." starts with hex digits; its fields with "Name:".
    if (std::sscanf(line.c_str(), "%llx%c%llx", &lo, &dash, &hi) == 3 && dash == '-') {
      finish();
      const std::uintptr_t a = std::max<std::uintptr_t>(lo, begin);
      const std::uintptr_t b = std::min<std::uintptr_t>(hi, end);
      overlap = b > a ? b - a : 0;
      continue;
    }
    if (overlap == 0) continue;
    for (const char* key : {"AnonHugePages:", "Private_Hugetlb:", "Shared_Hugetlb:"}) {
      if (line.rfind(key, 0) == 0) {
        huge += std::strtoull(line.c_str() + std::strlen(key), nullptr, 10) * KiB;
        break;
      }
    }
  }
  finish();
  return total;
}

PageBuffer::PageBuffer(std::size_t bytes, bool lock, const char* tier, HugePages huge)
    : bytes_(bytes) {
  data_ = map_pages(bytes, tier, /*reserve_only=*/false, huge, &huge_);
  if (lock) locked_ = lock_pages(data_, bytes_, tier);
}

}  // namespace strata
