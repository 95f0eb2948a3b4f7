// Reads the memory limits in effect for this process and puts them into words (Note [Memory
// limits] in memory_limits.h): getrlimit, capget, /proc and the memory cgroup's files. It maps,
// locks and frees nothing; pages.cpp asks it before a mapping and after a refused mlock.
#include "strata/io/memory_limits.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "strata/base/error.h"
#include "strata/io/pages.h"
#include "strata/base/units.h"

namespace strata {
namespace {

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

}  // namespace

namespace detail {

std::size_t hugetlb_free_bytes() {
  return read_hugetlb_pool().available_bytes();
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

namespace detail {

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

void warn_lock_failure(const char* tier, std::size_t length, std::size_t bytes,
                       int error) noexcept {
  if (g_lock_warned.exchange(true)) return;
  try {
    const std::string warning =
        lock_failure_warning(tier, length, bytes, error, read_memory_limits());
    std::fprintf(stderr, "strata: warning: %s\n", warning.c_str());
  } catch (...) {
    std::fprintf(stderr,
                 "strata: warning: %s could not lock %zu bytes of host memory (mlock: %s); "
                 "it stays pageable. Raise RLIMIT_MEMLOCK (ulimit -l).\n",
                 tier, length, std::strerror(error));
  }
}

}  // namespace detail

}  // namespace strata
