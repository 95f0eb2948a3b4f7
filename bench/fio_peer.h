// fio as strata-bench io's peer: runs one fio job on the same file, block size, queue depth and
// direction as strata's pass, with fio's default buffers or with 2 MiB huge-page buffers
// (--iomem=shmhuge, from pages this reserves and gives back), and reads fio's JSON figures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::bench {

struct FioJob {
  std::string fio = "fio";  ///< the executable, found on PATH
  std::string file;         ///< an existing, laid-out data file
  std::uint64_t bytes = 0;  ///< of the file, from offset 0
  std::size_t block = 0;
  unsigned queue_depth = 1;
  bool read = true;
  bool random = false;
  bool huge_buffers = false;  ///< --iomem=shmhuge (needs reserved huge pages)
};

struct FioResult {
  double mb_per_s = 0;  ///< 10^6 bytes/s, as strata-bench reports
  std::uint64_t bytes = 0;
};

/// fio's version ("fio-3.33"), or empty when `fio` cannot be run.
std::string fio_version(const std::string& fio);
/// The command line run_fio uses, for people and the JSON.
std::string fio_command(const FioJob& job);
/// Runs the job. @throws strata::Error naming the command and the end of fio's stderr when fio
/// fails or prints no figures.
FioResult run_fio(const FioJob& job);

/// Makes sure `bytes` of 2 MiB hugetlb pages are free for fio's --iomem=shmhuge, raising
/// vm.nr_hugepages as needed (root), and restores the old value when destroyed. Never throws:
/// ok() says whether the pages are there, why_not() why not.
class HugePageReservation {
 public:
  explicit HugePageReservation(std::size_t bytes);
  ~HugePageReservation();
  HugePageReservation(const HugePageReservation&) = delete;
  HugePageReservation& operator=(const HugePageReservation&) = delete;

  [[nodiscard]] bool ok() const noexcept { return ok_; }
  [[nodiscard]] const std::string& why_not() const noexcept { return why_not_; }
  /// Pages added to vm.nr_hugepages (0 when enough were free already).
  [[nodiscard]] std::size_t added_pages() const noexcept { return added_; }

 private:
  bool ok_ = false;
  std::string why_not_;
  bool raised_ = false;  // vm.nr_hugepages was written: restore old_total_
  std::size_t old_total_ = 0;
  std::size_t added_ = 0;
};

}  // namespace strata::bench
