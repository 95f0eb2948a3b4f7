#include "strata/io/pages.h"

#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "strata/io/error.h"
#include "strata/io/units.h"

namespace strata {
namespace {

constexpr const char* kThpEnabledPath = "/sys/kernel/mm/transparent_hugepage/enabled";

std::atomic<bool> g_huge_page_warned{false};

void warn_huge_pages_once(const std::string& warning) {
  if (warning.empty() || g_huge_page_warned.exchange(true)) return;
  std::fprintf(stderr, "strata: warning: %s\n", warning.c_str());
}

std::string read_text(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A "Name:   123 kB" value from /proc/meminfo, in the unit written (0 if absent).
std::size_t meminfo_value(const std::string& meminfo, std::string_view key) {
  const std::size_t at = meminfo.find(std::string(key) + ":");
  if (at == std::string::npos) return 0;
  return std::strtoull(meminfo.c_str() + at + key.size() + 1, nullptr, 10);
}

struct HugetlbPool {
  std::size_t free_pages = 0, reserved_pages = 0, page_bytes = kHugePageBytes;
  [[nodiscard]] std::size_t available_bytes() const {
    // Only 2 MiB pages: a mapping's length is rounded to them (mapped_bytes).
    if (page_bytes != kHugePageBytes || free_pages <= reserved_pages) return 0;
    return (free_pages - reserved_pages) * page_bytes;
  }
};

HugetlbPool read_hugetlb_pool() {
  const std::string meminfo = read_text("/proc/meminfo");
  HugetlbPool pool;
  pool.free_pages = meminfo_value(meminfo, "HugePages_Free");
  pool.reserved_pages = meminfo_value(meminfo, "HugePages_Rsvd");
  if (const std::size_t kb = meminfo_value(meminfo, "Hugepagesize"); kb != 0)
    pool.page_bytes = kb * KiB;
  return pool;
}

// ---- Memory limits (Note [Memory limits]) ----

std::atomic<bool> g_lock_warned{false};
std::atomic<bool> g_reserve_warned{false};

std::string bytes_text(std::size_t bytes) {
  if (bytes == kUnlimitedBytes) return "unlimited";
  return detail::concat(bytes, " bytes (", format_bytes(bytes), ")");
}

std::string describe_cgroup(const CgroupMemory& cgroup) {
  return detail::concat("the memory cgroup ", cgroup.path, " allows ",
                        bytes_text(cgroup.limit_bytes), " and uses ",
                        bytes_text(cgroup.current_bytes), ", of which ",
                        bytes_text(cgroup.reclaimable_bytes), " is page cache");
}

// The number at the start of `text` (after blanks); nullopt-like false when there is none.
bool parse_size(std::string_view text, std::size_t* value) {
  const std::string copy(text);
  const char* begin = copy.c_str();
  while (*begin == ' ' || *begin == '\t')
    ++begin;
  if (*begin < '0' || *begin > '9') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(begin, &end, 10);
  if (errno != 0 || end == begin) return false;
  *value = static_cast<std::size_t>(parsed);
  return true;
}

// A "key value" line's value from a cgroup memory.stat (0 if absent).
std::size_t stat_value(std::string_view stat, std::string_view key) {
  for (std::size_t at = 0; at < stat.size();) {
    std::size_t end = stat.find('\n', at);
    if (end == std::string_view::npos) end = stat.size();
    const std::string_view line = stat.substr(at, end - at);
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ' ') {
      std::size_t value = 0;
      return parse_size(line.substr(key.size() + 1), &value) ? value : 0;
    }
    at = end + 1;
  }
  return 0;
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  for (std::size_t at = 0;;) {
    const std::size_t end = text.find(sep, at);
    parts.push_back(text.substr(at, end == std::string_view::npos ? text.npos : end - at));
    if (end == std::string_view::npos) return parts;
    at = end + 1;
  }
}

// The directory of cgroup `path` (from /proc/self/cgroup) under a mount of hierarchy root
// `root` at `mount_point`.
std::string cgroup_dir(std::string_view mount_point, std::string_view root, std::string_view path) {
  std::string_view rest = path;
  if (root != "/") {
    if (rest.substr(0, root.size()) == root)
      rest.remove_prefix(root.size());
    else
      rest = {};  // outside the mount's view: the best guess is the mount itself
  }
  std::string dir(mount_point);
  while (!rest.empty() && rest.front() == '/')
    rest.remove_prefix(1);
  while (!rest.empty() && rest.back() == '/')
    rest.remove_suffix(1);
  if (!rest.empty()) dir = detail::concat(dir, "/", rest);
  return dir;
}

// The tightest memory limit of the cgroup at `dir` and its ancestors up to `mount` (v2 or v1;
// the root cgroup has none). Only a level with a limit has its use and memory.stat read (but
// v1's own cgroup): they are slower to read than the limit, and most levels have none.
CgroupMemory read_cgroup_hierarchy(std::string dir, const std::string& mount, bool v2) {
  CgroupMemory tightest;
  for (bool leaf = true;; leaf = false) {
    const std::string limit =
        read_text((dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes")).c_str());
    // v1's memory.stat names the limit of ancestors a container cannot see
    // (hierarchical_memory_limit): read at the process's own cgroup.
    std::string stat = !v2 && leaf ? read_text((dir + "/memory.stat").c_str()) : std::string();
    const CgroupMemory limit_only = v2 ? detail::parse_cgroup_memory(limit, "")
                                       : detail::parse_cgroup_v1_memory(limit, "", stat);
    if (limit_only.limit_bytes != kUnlimitedBytes) {
      const std::string current =
          read_text((dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")).c_str());
      if (stat.empty()) stat = read_text((dir + "/memory.stat").c_str());
      CgroupMemory here = v2 ? detail::parse_cgroup_memory(limit, current, stat)
                             : detail::parse_cgroup_v1_memory(limit, current, stat);
      here.path = dir;
      if (tightest.path.empty() || here.room_bytes() < tightest.room_bytes()) tightest = here;
    }
    const std::size_t slash = dir.rfind('/');
    if (dir.size() <= mount.size() || slash == std::string::npos || slash < mount.size()) break;
    dir.resize(slash);
  }
  return tightest;
}

// The THP mode is fixed for the process's purposes: read once.
const std::string& thp_enabled_text() {
  static const std::string text = read_text(kThpEnabledPath);
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

void reset_memory_limit_warnings() noexcept {
  g_lock_warned.store(false);
  g_reserve_warned.store(false);
}

CgroupMemory parse_cgroup_memory(std::string_view max_text, std::string_view current_text,
                                 std::string_view stat_text) {
  CgroupMemory memory;
  std::size_t value = 0;
  if (parse_size(max_text, &value)) memory.limit_bytes = value;  // "max": unlimited
  if (parse_size(current_text, &value)) memory.current_bytes = value;
  memory.reclaimable_bytes =
      stat_value(stat_text, "active_file") + stat_value(stat_text, "inactive_file");
  return memory;
}

CgroupMemory parse_cgroup_v1_memory(std::string_view limit_text, std::string_view usage_text,
                                    std::string_view stat_text) {
  // v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712).
  constexpr std::size_t kV1Unlimited = std::size_t{1} << 62;
  CgroupMemory memory;
  std::size_t value = 0;
  if (parse_size(limit_text, &value) && value < kV1Unlimited) memory.limit_bytes = value;
  // hierarchical_memory_limit: the tightest of this cgroup and its ancestors.
  if (const std::size_t hierarchical = stat_value(stat_text, "hierarchical_memory_limit");
      hierarchical != 0 && hierarchical < kV1Unlimited)
    memory.limit_bytes = std::min(memory.limit_bytes, hierarchical);
  if (parse_size(usage_text, &value)) memory.current_bytes = value;
  memory.reclaimable_bytes =
      stat_value(stat_text, "total_active_file") + stat_value(stat_text, "total_inactive_file");
  return memory;
}

CgroupDirs parse_cgroup_dirs(std::string_view proc_self_cgroup, std::string_view mountinfo) {
  // /proc/self/cgroup: "0::/path" (v2), "4:memory:/path" or "4:cpu,memory:/path" (v1).
  std::string_view v2_path, v1_path;
  bool has_v2 = false, has_v1 = false;
  for (const std::string_view line : split(proc_self_cgroup, '\n')) {
    const std::size_t first = line.find(':');
    const std::size_t second = line.find(':', first + 1);
    if (first == std::string_view::npos || second == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, first);
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = line.substr(second + 1);
    if (id == "0" && controllers.empty()) {
      v2_path = path;
      has_v2 = true;
    }
    for (const std::string_view c : split(controllers, ','))
      if (c == "memory") {
        v1_path = path;
        has_v1 = true;
      }
  }
  // /proc/self/mountinfo: "id parent major:minor root mount_point options [tags] - type source
  // super_options".
  CgroupDirs dirs;
  for (const std::string_view line : split(mountinfo, '\n')) {
    const std::vector<std::string_view> fields = split(line, ' ');
    std::size_t dash = 0;
    while (dash < fields.size() && fields[dash] != "-")
      ++dash;
    if (dash < 5 || dash + 4 > fields.size()) continue;
    const std::string_view root = fields[3], mount_point = fields[4], type = fields[dash + 1];
    if (type == "cgroup2" && has_v2 && dirs.v2.empty()) {
      dirs.v2 = cgroup_dir(mount_point, root, v2_path);
      dirs.v2_mount = std::string(mount_point);
    } else if (type == "cgroup" && has_v1 && dirs.v1_memory.empty()) {
      for (const std::string_view option : split(fields[dash + 3], ','))
        if (option == "memory") {
          dirs.v1_memory = cgroup_dir(mount_point, root, v1_path);
          dirs.v1_mount = std::string(mount_point);
        }
    }
  }
  return dirs;
}

std::string lock_failure_warning(const char* tier, std::size_t asked_bytes,
                                 std::size_t buffer_bytes, int error, const MemoryLimits& limits) {
  const std::string asked = asked_bytes == buffer_bytes
                                ? bytes_text(asked_bytes)
                                : concat(bytes_text(asked_bytes), ", the whole pages of a ",
                                         buffer_bytes, "-byte buffer,");
  const bool limit_is_why = limits.lockable_bytes() < asked_bytes;
  std::string why;
  if (limit_is_why) {
    const std::size_t needed_kib = (limits.locked_bytes + asked_bytes + KiB - 1) / KiB;
    why = concat(
        "the buffer stays pageable (the same bytes, slower DMA). To pin it, raise "
        "RLIMIT_MEMLOCK to at least ",
        needed_kib,
        " KiB, or make it unlimited: ulimit -l unlimited in the shell, LimitMEMLOCK=infinity in "
        "a systemd unit, --ulimit memlock=-1 with docker run (or grant CAP_IPC_LOCK)");
  } else {
    why = concat(
        "RLIMIT_MEMLOCK allows it, so the system or the memory cgroup is short of memory; the "
        "buffer stays pageable (the same bytes, slower DMA). Free memory or lower the pinned "
        "budget");
  }
  return concat(tier, " could not lock ", asked, " of host memory (mlock: ", std::strerror(error),
                "): ", describe_memory_limits(limits), "; ", why, ".");
}

}  // namespace detail

std::size_t CgroupMemory::room_bytes() const noexcept {
  if (limit_bytes == kUnlimitedBytes) return kUnlimitedBytes;
  const std::size_t used =
      current_bytes > reclaimable_bytes ? current_bytes - reclaimable_bytes : 0;
  return limit_bytes > used ? limit_bytes - used : 0;
}

std::size_t MemoryLimits::lockable_bytes() const noexcept {
  if (memlock_exempt || memlock_limit_bytes == kUnlimitedBytes) return kUnlimitedBytes;
  return memlock_limit_bytes > locked_bytes ? memlock_limit_bytes - locked_bytes : 0;
}

CgroupMemory read_cgroup_memory() noexcept {
  try {
    // The mounts are read once (a process does not move between mount namespaces while it
    // allocates); its cgroup is read each time (a process may be moved to another).
    static const std::string mountinfo = read_text("/proc/self/mountinfo");
    const detail::CgroupDirs dirs =
        detail::parse_cgroup_dirs(read_text("/proc/self/cgroup"), mountinfo);
    // A v2 hierarchy without the memory controller (a hybrid system binds it to v1) has no
    // memory.max anywhere; then v1's memory controller holds the limit, if any.
    if (!dirs.v2.empty()) {
      CgroupMemory memory = read_cgroup_hierarchy(dirs.v2, dirs.v2_mount, /*v2=*/true);
      if (!memory.path.empty()) return memory;
    }
    if (!dirs.v1_memory.empty())
      return read_cgroup_hierarchy(dirs.v1_memory, dirs.v1_mount, /*v2=*/false);
  } catch (...) {
    // allocation failure while reading: no limit known
  }
  return {};
}

MemoryLimits read_memory_limits() noexcept {
  MemoryLimits limits;
  if (rlimit limit{}; ::getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    limits.memlock_limit_bytes = static_cast<std::size_t>(limit.rlim_cur);
  // The calling thread's effective set: mlock checks it, not the process's first thread.
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3]{};
  if (::syscall(SYS_capget, &header, caps) == 0)
    limits.memlock_exempt = (caps[CAP_IPC_LOCK / 32].effective >> (CAP_IPC_LOCK % 32)) & 1u;
  try {
    limits.locked_bytes = meminfo_value(read_text("/proc/self/status"), "VmLck") * KiB;
    limits.hugetlb_free_bytes = read_hugetlb_pool().available_bytes();
  } catch (...) {
    // allocation failure while reading: leave the counts at 0
  }
  limits.cgroup = read_cgroup_memory();
  return limits;
}

std::string describe_memory_limits(const MemoryLimits& limits) {
  std::string text =
      limits.memlock_limit_bytes == kUnlimitedBytes
          ? std::string("RLIMIT_MEMLOCK is unlimited")
          : detail::concat("RLIMIT_MEMLOCK is ", bytes_text(limits.memlock_limit_bytes));
  if (limits.memlock_exempt) text += ", which CAP_IPC_LOCK exempts this process from";
  text = detail::concat(text, ", ", bytes_text(limits.locked_bytes), " already locked (VmLck)");
  if (limits.cgroup.path.empty()) return text + ", no memory cgroup limit";
  return detail::concat(text, ", ", describe_cgroup(limits.cgroup));
}

namespace {

// Note [Memory limits]: a mapping used whole is refused before it is made when the memory
// cgroup has no room for it; a lazily touched reservation only warns.
void check_cgroup_room(std::size_t length, std::size_t bytes, const char* tier, bool reserve_only) {
  const CgroupMemory cgroup = read_cgroup_memory();
  const std::size_t room = cgroup.room_bytes();
  if (length <= room) return;
  const std::string what =
      length == bytes ? bytes_text(length)
                      : detail::concat(bytes_text(length), " (whole pages of ", bytes, " bytes)");
  const char* advice =
      "Raise the cgroup's limit (docker run --memory, MemoryMax= in a systemd unit, or its "
      "memory.max, memory.limit_in_bytes in cgroup v1) or lower this tier's budget";
  if (!reserve_only) {
    throw OutOfMemoryError(
        tier, bytes, room, room,
        detail::concat(describe_cgroup(cgroup), ", room for ", bytes_text(room), ": the ", what,
                       " mapping would have the kernel's OOM killer end the process as it is "
                       "locked or filled. ",
                       advice));
  }
  if (!g_reserve_warned.exchange(true)) {
    std::fprintf(stderr,
                 "strata: warning: %s reserves %s but %s, room for %s: the reservation is "
                 "touched lazily, and the kernel's OOM killer ends the process if it fills "
                 "beyond the room. %s.\n",
                 tier, what.c_str(), describe_cgroup(cgroup).c_str(), bytes_text(room).c_str(),
                 advice);
  }
}

}  // namespace

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
    check_cgroup_room(length, bytes, tier, reserve_only);
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

  const std::size_t hugetlb_free =
      huge == HugePages::Hugetlb ? read_hugetlb_pool().available_bytes() : 0;
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
    check_cgroup_room(length, bytes, tier, /*reserve_only=*/false);
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
  const int error = errno;
  if (!g_lock_warned.exchange(true)) {
    try {
      const std::string warning =
          detail::lock_failure_warning(tier, length, bytes, error, read_memory_limits());
      std::fprintf(stderr, "strata: warning: %s\n", warning.c_str());
    } catch (...) {
      std::fprintf(stderr,
                   "strata: warning: %s could not lock %zu bytes of host memory (mlock: %s); "
                   "it stays pageable. Raise RLIMIT_MEMLOCK (ulimit -l).\n",
                   tier, length, std::strerror(error));
    }
  }
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
