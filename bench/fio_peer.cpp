#include "fio_peer.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/base/error.h"
#include "strata/io/memory_limits.h"
#include "strata/io/pages.h"

extern char** environ;

namespace strata::bench {
namespace {

constexpr const char* kNrHugepages = "/proc/sys/vm/nr_hugepages";

std::vector<std::string> fio_args(const FioJob& job) {
  const char* rw =
      job.read ? (job.random ? "randread" : "read") : (job.random ? "randwrite" : "write");
  // Sizes in bytes: fio reads "1MiB" as 10^6 bytes (its IEC suffixes are inverted).
  return {job.fio,
          "--name=strata-peer",
          "--filename=" + job.file,
          "--size=" + std::to_string(job.bytes),
          std::string("--rw=") + rw,
          "--bs=" + std::to_string(job.block),
          "--iodepth=" + std::to_string(job.queue_depth),
          "--ioengine=io_uring",
          "--direct=1",
          std::string("--iomem=") + (job.huge_buffers ? "shmhuge" : "malloc"),
          "--output-format=json"};
}

struct Captured {
  int status = -1;  // exit status, or -1 when it did not exit normally
  std::string out, err;
};

// Runs argv with stdout captured through a pipe and stderr through a temporary file.
Captured capture(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  char err_path[] = "/tmp/strata-bench-fio-XXXXXX";
  const int err_fd = ::mkstemp(err_path);
  Captured c;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  if (err_fd >= 0) posix_spawn_file_actions_adddup2(&actions, err_fd, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  if (rc == 0) {
    char buf[65536];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      c.out.append(buf, static_cast<std::size_t>(n));
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    c.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  } else {
    c.err = std::strerror(rc);
  }
  ::close(out[0]);
  if (err_fd >= 0) {
    std::ifstream in(err_path);
    std::stringstream text;
    text << in.rdbuf();
    c.err += text.str();
    ::close(err_fd);
    ::unlink(err_path);
  }
  return c;
}

std::size_t read_count(const char* path) {
  std::ifstream in(path);
  std::size_t value = 0;
  return in >> value ? value : 0;
}

// 2 MiB hugetlb pages free for a new mapping (HugePages_Free less HugePages_Rsvd).
std::size_t hugepages_free() {
  return read_memory_limits().hugetlb_free_bytes / kHugePageBytes;
}

bool write_count(std::size_t value) {
  std::ofstream out(kNrHugepages);
  out << value << '\n';
  out.flush();
  return static_cast<bool>(out);
}

}  // namespace

std::string fio_version(const std::string& fio) {
  try {
    const Captured c = capture({fio, "--version"});
    if (c.status != 0) return {};
    std::string v = c.out;
    while (!v.empty() && (v.back() == '\n' || v.back() == ' '))
      v.pop_back();
    return v;
  } catch (const std::exception&) {
    return {};
  }
}

std::string fio_command(const FioJob& job) {
  std::string line;
  for (const auto& a : fio_args(job))
    line += (line.empty() ? "" : " ") + a;
  return line;
}

FioResult run_fio(const FioJob& job) {
  const Captured c = capture(fio_args(job));
  auto tail = [&] {
    const std::string& e = c.err;
    return e.size() > 600 ? e.substr(e.size() - 600) : e;
  };
  if (c.status != 0)
    STRATA_FAIL(Errc::io_error, "fio failed (exit ", c.status, "): ", fio_command(job), ": ",
                tail());
  const std::size_t at = c.out.find('{');
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(at == std::string::npos ? c.out : c.out.substr(at));
    const auto& side = doc.at("jobs").at(0).at(job.read ? "read" : "write");
    FioResult r;
    r.mb_per_s = side.at("bw_bytes").get<double>() / 1e6;
    r.bytes = side.at("io_bytes").get<std::uint64_t>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    STRATA_FAIL(Errc::io_error, "fio printed no figures (", e.what(), "): ", fio_command(job), ": ",
                tail());
  }
}

HugePageReservation::HugePageReservation(std::size_t bytes) {
  const std::size_t need = (bytes + kHugePageBytes - 1) / kHugePageBytes;
  const std::size_t free_pages = hugepages_free();
  if (free_pages >= need) {
    ok_ = true;
    return;
  }
  old_total_ = read_count(kNrHugepages);
  const std::size_t want = old_total_ + (need - free_pages);
  if (!write_count(want)) {
    why_not_ = detail::concat("could not raise ", kNrHugepages, " from ", old_total_, " to ", want,
                              " (", std::strerror(errno), "; root is needed)");
    return;
  }
  raised_ = true;
  added_ = read_count(kNrHugepages) - old_total_;
  if (hugepages_free() < need) {
    why_not_ = detail::concat("asked for ", need, " huge pages of 2 MiB, the kernel gave ", added_,
                              " of the ", need - free_pages,
                              " missing (memory too fragmented; try again after "
                              "'echo 1 > /proc/sys/vm/compact_memory')");
    return;
  }
  ok_ = true;
}

HugePageReservation::~HugePageReservation() {
  if (raised_) write_count(old_total_);
}

}  // namespace strata::bench
