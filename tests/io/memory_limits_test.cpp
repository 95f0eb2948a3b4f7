// Memory limits (Note [Memory limits]): RLIMIT_MEMLOCK, CAP_IPC_LOCK, VmLck and the memory
// cgroup read as the kernel shows them, their files parsed, and what a buffer does under them:
// warnings and errors naming what was asked and what is there, never a crash.
#include "strata/io/memory_limits.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "io_test_util.h"
#include "strata/base/error.h"
#include "strata/io/pages.h"
#include "strata/base/units.h"

namespace strata {
namespace {

using testing::count;
using testing::fill_pattern;

// VmLck of this process, in bytes, from /proc/self/status.
std::size_t vm_locked_bytes() {
  const std::string status = testing::read_file("/proc/self/status");
  const std::size_t at = status.find("VmLck:");
  return at == std::string::npos ? 0 : std::stoull(status.substr(at + 6)) * KiB;
}

// Whether mlock really locks here: ASan's runtime intercepts mlock and returns success without
// locking anything, so VmLck stays where it was and nothing about locking can be observed.
bool mlock_locks() {
  void* page =
      ::mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return false;
  const std::size_t before = vm_locked_bytes();
  const bool locked = ::mlock(page, kPageBytes) == 0 && vm_locked_bytes() > before;
  ::munmap(page, kPageBytes);
  return locked;
}
using testing::read_file;

TEST(MemoryLimits, ParsesCgroupV2Files) {
  const auto unlimited = detail::parse_cgroup_memory("max\n", "1073741824\n", "");
  EXPECT_EQ(unlimited.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(unlimited.current_bytes, 1073741824u);
  EXPECT_EQ(unlimited.room_bytes(), kUnlimitedBytes);

  // A real memory.stat's first lines: page cache is on the file LRUs, shmem on the anon ones.
  const char* stat =
      "anon 44040192\nfile 12582912\nkernel 3145728\nshmem 2097152\n"
      "inactive_anon 46137344\nactive_anon 0\ninactive_file 6291456\nactive_file 4194304\n"
      "unevictable 0\n";
  const auto limited = detail::parse_cgroup_memory("67108864\n", "50331648\n", stat);
  EXPECT_EQ(limited.limit_bytes, 64 * MiB);
  EXPECT_EQ(limited.current_bytes, 48 * MiB);
  EXPECT_EQ(limited.reclaimable_bytes, 10 * MiB);  // active_file + inactive_file, not shmem
  EXPECT_EQ(limited.room_bytes(), 64 * MiB - 48 * MiB + 10 * MiB);

  // Over the limit (charged before reclaim caught up): no room, not a wrapped-around size.
  const auto over = detail::parse_cgroup_memory("67108864\n", "75497472\n", "");
  EXPECT_EQ(over.room_bytes(), 0u);
  // Missing files leave the defaults.
  const auto absent = detail::parse_cgroup_memory("", "", "");
  EXPECT_EQ(absent.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(absent.current_bytes, 0u);
}

TEST(MemoryLimits, ParsesCgroupV1Files) {
  const char* unlimited_stat =
      "cache 4390912\nrss 1724416\nhierarchical_memory_limit 9223372036854771712\n"
      "total_cache 4390912\ntotal_inactive_file 868352\ntotal_active_file 3522560\n";
  const auto unlimited =
      detail::parse_cgroup_v1_memory("9223372036854771712\n", "7458816\n", unlimited_stat);
  EXPECT_EQ(unlimited.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(unlimited.current_bytes, 7458816u);
  EXPECT_EQ(unlimited.reclaimable_bytes, 868352u + 3522560u);
  EXPECT_EQ(unlimited.room_bytes(), kUnlimitedBytes);

  // This cgroup is unlimited but an ancestor is not: hierarchical_memory_limit says so.
  const auto inherited = detail::parse_cgroup_v1_memory(
      "9223372036854771712\n", "1048576\n",
      "hierarchical_memory_limit 134217728\ntotal_inactive_file 0\ntotal_active_file 0\n");
  EXPECT_EQ(inherited.limit_bytes, 128 * MiB);
  EXPECT_EQ(inherited.room_bytes(), 127 * MiB);
  const auto own =
      detail::parse_cgroup_v1_memory("67108864\n", "0\n", "hierarchical_memory_limit 134217728\n");
  EXPECT_EQ(own.limit_bytes, 64 * MiB);
}

TEST(MemoryLimits, FindsTheMemoryCgroupDirectory) {
  // A hybrid system (memory on v1, v2 mounted at unified), as systemd's hybrid layout.
  const char* hybrid_cgroup = "9:name=systemd:/\n4:memory:/process_api/eab5\n1:cpu:/\n0::/\n";
  const char* hybrid_mounts =
      "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
      "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
  const auto hybrid = detail::parse_cgroup_dirs(hybrid_cgroup, hybrid_mounts);
  EXPECT_EQ(hybrid.v1_memory, "/sys/fs/cgroup/memory/process_api/eab5");
  EXPECT_EQ(hybrid.v2, "/sys/fs/cgroup/unified");
  EXPECT_EQ(hybrid.v2_mount, "/sys/fs/cgroup/unified");

  // Unified (v2 only), with an optional field before the "-".
  const auto unified = detail::parse_cgroup_dirs(
      "0::/user.slice/user-1000.slice/session-2.scope\n",
      "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
      "rw,nsdelegate,memory_recursiveprot\n");
  EXPECT_EQ(unified.v2, "/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope");
  EXPECT_EQ(unified.v1_memory, "");

  // A container without a cgroup namespace: the mount's root is the container's cgroup.
  const auto container = detail::parse_cgroup_dirs(
      "0::/docker/abc123/worker\n",
      "700 690 0:30 /docker/abc123 /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n");
  EXPECT_EQ(container.v2, "/sys/fs/cgroup/worker");

  const auto none = detail::parse_cgroup_dirs("", "22 1 0:21 / /proc rw - proc proc rw\n");
  EXPECT_EQ(none.v2, "");
  EXPECT_EQ(none.v1_memory, "");
}

TEST(MemoryLimits, LockWarningNamesTheAskTheLimitWhatIsLockedAndWhatToSet) {
  MemoryLimits limits;
  limits.memlock_limit_bytes = 64 * KiB;
  limits.locked_bytes = 8 * KiB;
  const std::string warning =
      detail::lock_failure_warning("Host (pinned)", 4 * MiB, 4 * MiB, ENOMEM, limits);
  for (const char* part :
       {"Host (pinned) could not lock 4194304 bytes (4.00 MiB)", "Cannot allocate memory",
        "RLIMIT_MEMLOCK is 65536 bytes (64.00 KiB)", "8192 bytes (8.00 KiB) already locked (VmLck)",
        "stays pageable", "at least 4104 KiB", "ulimit -l unlimited", "LimitMEMLOCK=infinity",
        "--ulimit memlock=-1", "no memory cgroup limit"})
    EXPECT_NE(warning.find(part), std::string::npos) << "no \"" << part << "\" in " << warning;

  // The mapping is whole 2 MiB pages: the warning names both sizes.
  const std::string rounded =
      detail::lock_failure_warning("Host (pinned)", 6 * MiB, 5 * MiB, ENOMEM, limits);
  EXPECT_NE(rounded.find("6291456 bytes (6.00 MiB), the whole pages of a 5242880-byte buffer"),
            std::string::npos)
      << rounded;

  // When the limit is not why (CAP_IPC_LOCK), it says so instead of advising ulimit.
  limits.memlock_exempt = true;
  limits.cgroup.path = "/sys/fs/cgroup/job";
  limits.cgroup.limit_bytes = 64 * MiB;
  limits.cgroup.current_bytes = 60 * MiB;
  const std::string exempt =
      detail::lock_failure_warning("Host (pinned)", 4 * MiB, 4 * MiB, ENOMEM, limits);
  EXPECT_NE(exempt.find("CAP_IPC_LOCK exempts"), std::string::npos) << exempt;
  EXPECT_NE(exempt.find("RLIMIT_MEMLOCK allows it"), std::string::npos) << exempt;
  EXPECT_NE(exempt.find("the memory cgroup /sys/fs/cgroup/job allows 67108864 bytes"),
            std::string::npos)
      << exempt;
  EXPECT_EQ(exempt.find("ulimit -l"), std::string::npos) << exempt;
}

// This process's values, read differently from the library: /proc/self/limits, the CapEff line
// of /proc/self/status and the cgroup files read here.
TEST(MemoryLimits, ReaderAgreesWithTheKernelFiles) {
  const std::string proc_limits = read_file("/proc/self/limits");
  const std::size_t row = proc_limits.find("Max locked memory");
  ASSERT_NE(row, std::string::npos) << proc_limits;
  std::istringstream row_fields(proc_limits.substr(row + std::strlen("Max locked memory")));
  std::string soft;
  row_fields >> soft;

  PageBuffer locked(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
  const MemoryLimits limits = read_memory_limits();
  if (soft == "unlimited") {
    EXPECT_EQ(limits.memlock_limit_bytes, kUnlimitedBytes);
  } else {
    EXPECT_EQ(limits.memlock_limit_bytes, std::stoull(soft));
  }
  const std::string status = read_file("/proc/self/status");
  const std::size_t cap = status.find("CapEff:");
  ASSERT_NE(cap, std::string::npos);
  const unsigned long long cap_eff = std::stoull(status.substr(cap + 7), nullptr, 16);
  EXPECT_EQ(limits.memlock_exempt, ((cap_eff >> CAP_IPC_LOCK) & 1) != 0);
  const std::size_t vmlck = status.find("VmLck:");
  ASSERT_NE(vmlck, std::string::npos);
  EXPECT_EQ(limits.locked_bytes, std::stoull(status.substr(vmlck + 6)) * KiB);
  if (locked.locked() && mlock_locks()) {
    EXPECT_GE(limits.locked_bytes, 4 * MiB);
  }

  // The cgroup: its limit file in the directory named holds the limit reported, and that
  // directory is this process's cgroup or one of its ancestors.
  const CgroupMemory& cgroup = limits.cgroup;
  if (cgroup.path.empty()) {
    EXPECT_EQ(cgroup.limit_bytes, kUnlimitedBytes);
    EXPECT_EQ(cgroup.room_bytes(), kUnlimitedBytes);
    return;
  }
  // this process's cgroup path in the hierarchy that holds the limit, from /proc/self/cgroup
  std::string own;
  const bool v2 = std::ifstream(cgroup.path + "/memory.max").good();
  std::istringstream lines(read_file("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);) {
    const std::size_t first = line.find(':'), second = line.find(':', first + 1);
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    if (v2 ? line.rfind("0::", 0) == 0 : controllers.find(",memory,") != std::string::npos)
      own = line.substr(second + 1);
  }
  // The directory below its cgroup mount point is a leading part of that path (or, where the
  // mount's root is a container's cgroup, a part of it), whole components.
  std::string mount;
  std::istringstream mounts(read_file("/proc/mounts"));
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream fields(line);
    std::string source, point, type;
    fields >> source >> point >> type;
    if ((type == "cgroup" || type == "cgroup2") && cgroup.path.rfind(point, 0) == 0 &&
        point.size() > mount.size())
      mount = point;
  }
  ASSERT_FALSE(mount.empty()) << cgroup.path << " is under no cgroup mount";
  const std::string below = cgroup.path.substr(mount.size());
  EXPECT_NE((own + "/").find(below + "/"), std::string::npos)
      << cgroup.path << " is not the cgroup " << own << " or one of its ancestors";
  const std::string limit_text =
      read_file(cgroup.path + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  if (v2) {
    EXPECT_EQ(cgroup.limit_bytes, std::stoull(limit_text));
  } else {
    EXPECT_LE(cgroup.limit_bytes, std::stoull(limit_text));
  }
  EXPECT_GT(cgroup.current_bytes, 0u);
}

// What a forked child reports: its exit status and everything it wrote to stderr.
struct ChildResult {
  int status = 0;
  std::string output;
  [[nodiscard]] std::string describe() const {
    if (WIFSIGNALED(status))
      return "child killed by signal " + std::to_string(WTERMSIG(status)) + "; output:\n" + output;
    return "child exited " + std::to_string(WEXITSTATUS(status)) + "; output:\n" + output;
  }
  [[nodiscard]] bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Runs `body` in a forked child with its stderr on a pipe; the child's exit status is body's
// return value (an exception is exit status 99, its what() on stderr).
ChildResult run_in_child(const std::function<int()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
    int code = 98;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: uncaught exception: %s\n", e.what());
      code = 99;
    }
    std::fflush(stderr);
    ::_exit(code);
  }
  ::close(fds[1]);
  ChildResult result;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    result.output.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  while (::waitpid(pid, &result.status, 0) < 0 && errno == EINTR) {
  }
  return result;
}

// Clears CAP_IPC_LOCK from the calling thread's effective set (which exempts root from
// RLIMIT_MEMLOCK); false if capset refuses.
bool drop_ipc_lock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3]{};
  if (::syscall(SYS_capget, &header, caps) != 0) return false;
  caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  return ::syscall(SYS_capset, &header, caps) == 0;
}

TEST(MemoryLimits, LowMemlockLimitLeavesBuffersPageableWithOneWarningNamingIt) {
  if (!mlock_locks()) GTEST_SKIP() << "mlock locks nothing in this process (ASan intercepts it)";
  const ChildResult child = run_in_child([] {
    if (!drop_ipc_lock()) {
      std::fprintf(stderr, "child: capset: %s\n", std::strerror(errno));
      return 2;
    }
    const rlimit low{64 * KiB, 64 * KiB};
    if (::setrlimit(RLIMIT_MEMLOCK, &low) != 0) {
      std::fprintf(stderr, "child: setrlimit: %s\n", std::strerror(errno));
      return 3;
    }
    detail::reset_memory_limit_warnings();
    PageBuffer out(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
    PageBuffer in(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
    if (out.locked() || in.locked()) return 4;  // a 4 MiB lock under a 64 KiB limit
    const MemoryLimits limits = read_memory_limits();
    if (limits.memlock_exempt || limits.memlock_limit_bytes != 64 * KiB) return 5;
    fill_pattern(out.data(), out.size(), 11);
    std::memcpy(in.data(), out.data(), out.size());
    const std::vector<unsigned char> expected = testing::pattern(out.size(), 11);
    if (std::memcmp(in.data(), expected.data(), expected.size()) != 0) return 6;
    return 0;
  });
  ASSERT_TRUE(child.exited_ok()) << child.describe();
  const std::string& warnings = child.output;
  EXPECT_EQ(count(warnings, "could not lock"), 1u) << warnings;  // once per process
  for (const char* part :
       {"strata: warning: Host (pinned) could not lock 4194304 bytes (4.00 MiB)",
        "RLIMIT_MEMLOCK is 65536 bytes (64.00 KiB)", "already locked (VmLck)", "stays pageable",
        "ulimit -l", "LimitMEMLOCK=infinity", "--ulimit memlock=-1"})
    EXPECT_NE(warnings.find(part), std::string::npos) << "no \"" << part << "\" in " << warnings;
  EXPECT_EQ(warnings.find("CAP_IPC_LOCK exempts"), std::string::npos) << warnings;
}

// A memory cgroup of `limit_bytes` made for a test under the hierarchy that has the memory
// controller (v2 where its root delegates memory, else v1), removed at scope exit.
class TestCgroup {
 public:
  explicit TestCgroup(std::size_t limit_bytes) {
    if (::geteuid() != 0) {
      why_not_ = "not root: cannot make a memory cgroup";
      return;
    }
    std::string v2_mount, v1_mount;
    std::istringstream mounts(read_file("/proc/mounts"));
    for (std::string line; std::getline(mounts, line);) {
      std::istringstream fields(line);
      std::string source, point, type, options;
      fields >> source >> point >> type >> options;
      if (type == "cgroup2" && v2_mount.empty()) v2_mount = point;
      if (type == "cgroup" && ("," + options + ",").find(",memory,") != std::string::npos)
        v1_mount = point;
    }
    const std::string name = "/strata-test-" + std::to_string(::getpid());
    const bool v2 =
        !v2_mount.empty() &&
        read_file(v2_mount + "/cgroup.subtree_control").find("memory") != std::string::npos;
    if (v2) {
      dir_ = v2_mount + name;
      limit_file_ = "/memory.max";
    } else if (!v1_mount.empty()) {
      dir_ = v1_mount + name;
      limit_file_ = "/memory.limit_in_bytes";
    } else {
      why_not_ = "no memory controller: neither cgroup2 with memory in " + v2_mount +
                 "/cgroup.subtree_control nor a cgroup v1 memory mount";
      return;
    }
    if (::mkdir(dir_.c_str(), 0755) != 0) {
      why_not_ = "mkdir " + dir_ + ": " + std::strerror(errno);
      dir_.clear();
      return;
    }
    if (!write(limit_file_, std::to_string(limit_bytes))) {
      why_not_ = "cannot write " + dir_ + limit_file_;
      return;
    }
    ok_ = true;
  }
  ~TestCgroup() {
    if (dir_.empty()) return;
    // The child has exited; its charges may take a moment to be released.
    for (int attempt = 0; attempt < 100 && ::rmdir(dir_.c_str()) != 0 && errno == EBUSY; ++attempt)
      ::usleep(10'000);
  }
  TestCgroup(const TestCgroup&) = delete;
  TestCgroup& operator=(const TestCgroup&) = delete;

  [[nodiscard]] bool ok() const { return ok_; }
  [[nodiscard]] const std::string& why_not() const { return why_not_; }
  [[nodiscard]] const std::string& dir() const { return dir_; }
  /// Moves the calling process into the cgroup.
  [[nodiscard]] bool join() const { return write("/cgroup.procs", std::to_string(::getpid())); }

 private:
  [[nodiscard]] bool write(const std::string& file, const std::string& text) const {
    std::ofstream out(dir_ + file);
    out << text << std::flush;
    return out.good();
  }

  std::string dir_, limit_file_, why_not_;
  bool ok_ = false;
};

TEST(MemoryLimits, PinnedBufferBeyondTheCgroupLimitIsRefusedNamingIt) {
  const TestCgroup cgroup(64 * MiB);
  if (!cgroup.ok()) GTEST_SKIP() << cgroup.why_not();
  const ChildResult child = run_in_child([&] {
    if (!cgroup.join()) return 2;
    const CgroupMemory memory = read_cgroup_memory();
    std::fprintf(stderr, "child: cgroup %s limit %zu current %zu\n", memory.path.c_str(),
                 memory.limit_bytes, memory.current_bytes);
    if (memory.path != cgroup.dir() || memory.limit_bytes != 64 * MiB) return 3;
    {
      // Within the room: allowed, locked and filled without the OOM killer.
      PageBuffer small(16 * MiB, /*lock=*/true, "Host (pinned)");
      fill_pattern(small.data(), small.size(), 5);
    }
    try {
      // Without the check this is OOM-killed as it is locked (the test sees SIGKILL).
      PageBuffer big(256 * MiB, /*lock=*/true, "Host (pinned)");
      return 4;
    } catch (const OutOfMemoryError& e) {
      std::fprintf(stderr, "refused: %s\n", e.what());
      if (e.requested_bytes() != 256 * MiB || e.free_bytes() > 64 * MiB) return 5;
    }
    // A lazily touched reservation of the same size is allowed, with a warning.
    detail::reset_memory_limit_warnings();
    void* arena = map_pages(256 * MiB, "Device", /*reserve_only=*/true);
    static_cast<std::byte*>(arena)[0] = std::byte{1};
    unmap_pages(arena, 256 * MiB);
    return 0;
  });
  ASSERT_TRUE(child.exited_ok()) << child.describe();
  const std::string& out = child.output;
  const std::size_t refused = out.find("refused: ");
  ASSERT_NE(refused, std::string::npos) << out;
  const std::string error = out.substr(refused, out.find('\n', refused) - refused);
  for (const std::string& part :
       {std::string("out of memory on tier Host (pinned): asked for 268435456 bytes"),
        "the memory cgroup " + cgroup.dir() + " allows 67108864 bytes (64.00 MiB)",
        std::string("OOM killer"), std::string("MemoryMax=")})
    EXPECT_NE(error.find(part), std::string::npos) << "no \"" << part << "\" in " << error;
  EXPECT_NE(out.find("strata: warning: Device reserves 268435456 bytes (256.00 MiB) but the "
                     "memory cgroup " +
                     cgroup.dir() + " allows 67108864 bytes"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace strata
