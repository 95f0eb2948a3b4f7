// The limits on memory in effect for this process, read from the kernel and put into words:
// RLIMIT_MEMLOCK, CAP_IPC_LOCK, VmLck, the hugetlb pool and the memory cgroup (Note [Memory
// limits]). It reads, checks and reports; it never maps, locks or frees memory (pages.h does, and
// asks here first), and of pages.h it uses only the page sizes.
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <string_view>

namespace strata {

// Note [Memory limits]
// ~~~~~~~~~~~~~~~~~~~~~
// Three limits bound the pinned slab; strata reports each instead of crashing on it:
//  - RLIMIT_MEMLOCK caps what mlock may lock (root with CAP_IPC_LOCK is exempt); often 8 MiB,
//    and 64 KiB in many containers. A refused lock is a warning (once per process, naming
//    the bytes asked, the limit, VmLck already locked and the three usual ways to raise it) and
//    the buffer stays pageable: the same bytes, slower DMA.
//  - A memory cgroup (docker --memory, systemd MemoryMax=) OOM-kills the process when the memory
//    it touches exceeds memory.max and the kernel cannot reclaim enough. A mapping of 2 MiB or
//    more that is used whole (map_pages without reserve_only: pinned slabs, staging buffers,
//    which are locked, registered or filled at once; smaller ones are not worth the cgroup's
//    files being read) is refused up front with an OutOfMemoryError naming the cgroup, its
//    limit and its use when it exceeds the cgroup's room: memory.max less memory.current, plus
//    the page cache (active_file + inactive_file) that would be reclaimed first. Swap is not
//    counted: locked pages cannot go there. A reserve_only arena is touched lazily, so a
//    reservation beyond the room only warns. The tightest of the process's cgroup and its ancestors
//    counts, with that cgroup's use (v2, or v1's memory controller). hugetlb pages are charged to
//    the hugetlb controller, not memory, and are not checked against it.
//  - A refused huge page allocation falls back to 4 KiB pages (Note [Huge pages] in pages.h).

/// Bytes of a limit that is not set.
inline constexpr std::size_t kUnlimitedBytes = std::numeric_limits<std::size_t>::max();

/// The memory cgroup limit that applies to this process.
struct CgroupMemory {
  /// Directory the limit was read from (the tightest of the process's cgroup and its ancestors);
  /// "" when there is no memory cgroup (none mounted, or the root cgroup).
  std::string path;
  std::size_t limit_bytes = kUnlimitedBytes;  ///< memory.max / memory.limit_in_bytes
  std::size_t current_bytes = 0;              ///< memory.current / memory.usage_in_bytes
  /// Page cache charged to it (active_file + inactive_file): reclaimed before an OOM kill.
  std::size_t reclaimable_bytes = 0;
  /// Bytes that can still be charged without an OOM kill: limit - current + reclaimable, capped
  /// at the limit; kUnlimitedBytes without a limit.
  [[nodiscard]] std::size_t room_bytes() const noexcept;
};

/// The limits on memory in effect for this process (Note [Memory limits]).
struct MemoryLimits {
  std::size_t memlock_limit_bytes = kUnlimitedBytes;  ///< RLIMIT_MEMLOCK, soft
  bool memlock_exempt = false;   ///< CAP_IPC_LOCK is effective: mlock ignores RLIMIT_MEMLOCK
  std::size_t locked_bytes = 0;  ///< already locked by this process (VmLck)
  CgroupMemory cgroup;
  std::size_t hugetlb_free_bytes = 0;  ///< free 2 MiB hugetlb pages, in bytes
  /// Bytes mlock may still lock under RLIMIT_MEMLOCK (kUnlimitedBytes when exempt or unlimited).
  [[nodiscard]] std::size_t lockable_bytes() const noexcept;
};

/// Reads the limits from getrlimit, capget, /proc/self/status, /proc/self/cgroup, the cgroup's
/// files and /proc/meminfo, each time (a process may be moved to another cgroup), and
/// /proc/self/mountinfo once. Never throws: what cannot be read is left unlimited (0 for counts).
MemoryLimits read_memory_limits() noexcept;
/// The memory cgroup part of read_memory_limits().
CgroupMemory read_cgroup_memory() noexcept;
/// "RLIMIT_MEMLOCK is 65536 bytes (64.00 KiB), 0 bytes (0 B) already locked (VmLck)" plus the
/// cgroup's limit, use and room where there is one: for messages.
std::string describe_memory_limits(const MemoryLimits& limits);

namespace detail {

/// Free 2 MiB hugetlb pages (HugePages_Free less HugePages_Rsvd in /proc/meminfo), in bytes; 0
/// when the default huge page size is not 2 MiB (a mapping's length is rounded to 2 MiB pages).
std::size_t hugetlb_free_bytes();

/// Refuses, before it is made, a mapping of `length` bytes (for a buffer of `bytes`) used whole
/// when the memory cgroup has no room for it: @throws OutOfMemoryError naming `tier`, the
/// cgroup, its limit, use and room. A `reserve_only` mapping (touched lazily) only warns, once
/// per process. Note [Memory limits].
void check_cgroup_room(std::size_t length, std::size_t bytes, const char* tier, bool reserve_only);

/// What lock_pages does when mlock of `length` bytes (the mapping of a `bytes` buffer) failed
/// with `error`: warns once per process with lock_failure_warning (the memory limits read now).
void warn_lock_failure(const char* tier, std::size_t length, std::size_t bytes, int error) noexcept;

/// Lets lock_pages' and the arena reservation's once-per-process warnings warn again; for tests.
void reset_memory_limit_warnings() noexcept;

/// A cgroup v2 memory controller's state from the texts of memory.max ("max" or bytes),
/// memory.current and memory.stat (its active_file and inactive_file); path left empty. Text
/// that does not parse leaves the field at its default. Pure, for tests.
CgroupMemory parse_cgroup_memory(std::string_view max_text, std::string_view current_text,
                                 std::string_view stat_text = {});
/// The same from cgroup v1's memory.limit_in_bytes, memory.usage_in_bytes and memory.stat (its
/// hierarchical_memory_limit, total_active_file, total_inactive_file); a limit of 2^62 or more
/// is v1's "unlimited" (LONG_MAX rounded down to a page). Pure, for tests.
CgroupMemory parse_cgroup_v1_memory(std::string_view limit_text, std::string_view usage_text,
                                    std::string_view stat_text = {});

/// Where this process's memory cgroup is, from /proc/self/cgroup and /proc/self/mountinfo
/// texts: the cgroup v2 directory ("" if no cgroup2 is mounted) and the v1 memory controller's
/// directory ("" if none). A mount whose root is not "/" (a cgroup namespace, a container) is
/// resolved as the kernel shows it. Pure, for tests.
struct CgroupDirs {
  std::string v2;
  std::string v1_memory;
  std::string v2_mount;  ///< the cgroup2 mount point: ancestors are walked up to it
  std::string v1_mount;  ///< the v1 memory controller's mount point
};
CgroupDirs parse_cgroup_dirs(std::string_view proc_self_cgroup, std::string_view mountinfo);

/// The warning lock_pages gives when mlock of `asked_bytes` (a mapping of `buffer_bytes`) fails
/// with `error`. Pure, for tests.
std::string lock_failure_warning(const char* tier, std::size_t asked_bytes,
                                 std::size_t buffer_bytes, int error, const MemoryLimits& limits);

}  // namespace detail

}  // namespace strata
