// strata-bench io: sequential or random reads or writes through strata's I/O engines, measured
// the way fio measures (same block size, queue depth and size, a laid-out file, its page cache
// dropped first, random data), with what the device received (its request sizes) beside the
// bandwidth; with --vs-fio, against fio itself on the same file, in alternating runs.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "fio_peer.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/device_limits.h"
#include "strata/io/io_engine.h"
#include "strata/io/pages.h"

namespace strata::bench {
namespace {

struct Args {
  std::string rw = "read";
  std::string bs = "1MiB";
  unsigned qd = 16;
  std::string size = "1GiB";
  std::string paths;
  std::string engine = "uring";
  int direct = 1;
  unsigned threads = 4;
  std::string huge_pages;  // empty: default_huge_pages()
  bool cleanup = false;
  bool json = false;
  bool vs_fio = false;  // Note [Against fio]
  unsigned runs = 3;
  std::string fio = "fio";
};

std::vector<std::string> split_paths(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Stamps each 4 KiB page of a written block with its offset (Note [Written data]).
void stamp(std::byte* block, std::size_t bytes, std::uint64_t offset) {
  for (std::size_t i = 0; i + sizeof offset <= bytes; i += 4096)
    std::memcpy(block + i, &offset, sizeof offset);
}

// Note [Submitting from completions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pass keeps `slots` requests at the engine, and each completion submits the next block into
// the slot it frees, from the completion callback, on the engine thread: in the steady state no
// other thread runs, as in fio, one thread woken only by completions. The engine takes a request
// submitted from its own thread without a wake-up (Note [Waking the engine] in uring_engine.cpp),
// so a chained submission costs a push under an uncontended lock.
//
// A pass has `qd` buffers, one per request in flight, as fio has. The bench thread used to keep
// a window of 2 x qd requests (and buffers) at the engine, woken when a quarter of it was free;
// on a 2-vCPU VM (Firecracker, virtio disk) reads stayed at 0.83-0.95 of fio for the same request
// sizes and the same kernel work (perf stat: equal io_uring and block events). Chaining from
// completions alone left 512 KiB at qd 8 at 0.87 (median of 7 alternating runs); one buffer per
// request in flight brought it to 0.97-1.17 (medians of 5-7). Block traces (perf record of
// block_rq_issue/complete) showed why: the guest's turnaround was fio's (30-40 us from a batch's
// last completion to the next issue), while the host served each batch of qd requests slower,
// 1.7-1.95 ms against fio's 1.15-1.6 ms for the same 4 MiB: the host writes the data into guest
// memory, and (our reading) 8 MiB of rotating destinations stays in its caches less than 4 MiB.
class Feeder {
 public:
  using Target = std::function<std::pair<const File*, std::uint64_t>(std::uint64_t)>;
  Feeder(IoEngine& engine, IoOp op, std::byte* buffers, std::size_t bs, std::uint64_t count,
         Target target)
      : engine_(engine),
        op_(op),
        buffers_(buffers),
        bs_(bs),
        count_(count),
        target_(std::move(target)) {}

  // Submits the first `slots` blocks and waits until every block is done or one failed (then
  // rethrows, once every request in flight is back). `tick` runs about twice a second.
  void run(std::size_t slots, const std::function<void(std::uint64_t)>& tick) {
    const std::size_t first = static_cast<std::size_t>(std::min<std::uint64_t>(slots, count_));
    {
      std::lock_guard lock(mutex_);
      busy_ = first;
    }
    next_.store(first, std::memory_order_relaxed);
    for (std::size_t slot = 0; slot < first; ++slot)
      submit(slot, slot);
    std::unique_lock lock(mutex_);
    while (!done_.wait_for(lock, std::chrono::milliseconds(500), [this] { return busy_ == 0; }))
      tick(completed_.load(std::memory_order_relaxed) * bs_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void submit(std::size_t slot, std::uint64_t block) {
    const auto [file, offset] = target_(block);
    std::byte* buffer = buffers_ + slot * bs_;
    if (op_ == IoOp::Write) stamp(buffer, bs_, offset);
    engine_.submit(IoRequest{op_, file, offset, bs_, buffer},
                   [this, slot](std::exception_ptr e) { completed(slot, e); });
  }

  // On the engine thread: the next block goes into `slot`, or the slot retires.
  void completed(std::size_t slot, std::exception_ptr error) {
    if (!error) {
      completed_.fetch_add(1, std::memory_order_relaxed);
      if (!failed_.load(std::memory_order_relaxed)) {
        const std::uint64_t block = next_.fetch_add(1, std::memory_order_relaxed);
        if (block < count_) {
          submit(slot, block);
          return;
        }
      }
    }
    bool last = false;
    {
      std::lock_guard lock(mutex_);
      if (error && !error_) {
        error_ = error;
        failed_.store(true, std::memory_order_relaxed);
      }
      last = --busy_ == 0;
    }
    if (last) done_.notify_one();
  }

  IoEngine& engine_;
  const IoOp op_;
  std::byte* const buffers_;
  const std::size_t bs_;
  const std::uint64_t count_;
  const Target target_;
  std::atomic<std::uint64_t> next_{0}, completed_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::condition_variable done_;
  std::size_t busy_ = 0;  // slots with a request at the engine
  std::exception_ptr error_;
};

// Note [Data files]: the measured pass runs on files that already hold data, as fio's do.
// A file is laid out (written in full, fsync'd) only when it is missing or of the wrong size,
// into "<name>.part" renamed when complete, so an interrupted layout never passes for a laid-out
// file. Reads therefore read written blocks, and writes overwrite written blocks: no run pays
// ext4's unwritten-extent conversion or block allocation (fio, by default, fallocates a missing
// file for a write job and writes into it, then overwrites it on later runs; fio --overwrite=1
// lays it out first as this does). Before the pass, each file's page cache is dropped with
// posix_fadvise(POSIX_FADV_DONTNEED), which is what fio does by default (invalidate=1).

// Whether `path` holds a laid-out data file of `bytes` bytes (see Note [Data files]).
bool is_laid_out(const std::string& path, std::uint64_t bytes) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  return !ec && size == bytes;
}

// Note [Written data]: a disk or a host that compresses or deduplicates would write and read
// zeros or repeated blocks faster than data, so the buffers hold pseudo-random bytes and every
// written block carries its offset in each 4 KiB page, as fio's random buffers with
// scramble_buffers=1 (its default) do.
void fill_random(std::byte* data, std::size_t bytes) {
  std::mt19937_64 rng(0x5eed);
  for (std::size_t i = 0; i + sizeof(std::uint64_t) <= bytes; i += sizeof(std::uint64_t)) {
    const std::uint64_t word = rng();
    std::memcpy(data + i, &word, sizeof word);
  }
}

void drop_page_cache(const File& file) {
  const int rc = ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0) throw IoError(Errc::io_error, file.path(), 0, 0, rc, "posix_fadvise");
}

void run(const Args& args) {
  const bool is_read = args.rw == "read" || args.rw == "randread";
  const bool is_random = args.rw == "randread" || args.rw == "randwrite";
  if (!is_read && args.rw != "write" && args.rw != "randwrite")
    STRATA_FAIL(Errc::invalid_argument, "--rw: \"", args.rw,
                "\" is not read, write, randread or randwrite");
  const std::size_t bs = parse_bytes(args.bs, "--bs");
  const std::uint64_t size = parse_bytes(args.size, "--size");
  std::vector<std::string> dirs = split_paths(args.paths);
  if (dirs.empty()) STRATA_FAIL(Errc::invalid_argument, "--path: give one or more directories");
  for (const auto& d : dirs)
    if (!std::filesystem::is_directory(d))
      STRATA_FAIL(Errc::invalid_argument, "--path: \"", d, "\" is not a directory");
  STRATA_EXPECTS(size >= bs * dirs.size(), "--size: ", size, " bytes is less than one block (", bs,
                 " bytes) per path");

  IoOptions options;
  options.engine = parse_engine_kind(args.engine, "--engine");
  options.block_size = bs;
  options.queue_depth = args.qd;
  options.threads = args.threads;
  options.direct = args.direct != 0;
  options.quiet = true;
  auto engine = make_io_engine(options);

  // One buffer per request in flight, as fio has (Note [Submitting from completions]).
  const std::size_t slots = args.qd;
  const HugePages huge = args.huge_pages.empty()
                             ? default_huge_pages()
                             : parse_huge_pages(args.huge_pages, "--huge-pages");
  PageBuffer slab(slots * bs, /*lock=*/true, "Host (bench buffers)", huge);
  fill_random(slab.data(), slab.size());
  // What the buffers really got (Note [Huge pages]): on a disk with a low segment limit, 4 KiB
  // pages split each request and cap the bandwidth measured here.
  const std::size_t buffer_huge_bytes = huge_page_bytes(slab.data(), slab.size());
  const std::size_t run_bytes = contiguous_run_bytes(slab.data(), slab.size());
  engine->register_buffer(slab.data(), slab.size(), run_bytes);

  // Runs `count` requests of `op`, the i-th on target(i) = {file, offset}, `slots` in flight.
  const bool progress = !args.json && stderr_is_terminal();
  auto pass = [&](IoOp op, std::uint64_t count, Feeder::Target target) {
    Feeder feeder(*engine, op, slab.data(), bs, count, std::move(target));
    const auto start = Clock::now();
    feeder.run(slots, [&](std::uint64_t done) {
      if (!progress) return;
      std::fprintf(stderr, "\r  %s / %s  %.0f MB/s   ", format_bytes(done).c_str(),
                   format_bytes(count * bs).c_str(),
                   static_cast<double>(done) / seconds_since(start) / 1e6);
    });
    const double seconds = seconds_since(start);
    if (progress) std::fprintf(stderr, "\r%60s\r", "");
    return seconds;
  };

  // One file per directory; block i lives in file i % P at offset (i / P) * bs (striping).
  const std::uint64_t blocks = size / bs;
  const std::uint64_t per_file = (blocks + dirs.size() - 1) / dirs.size() * bs;
  std::vector<std::string> names;
  bool laid_out = false;
  for (std::size_t i = 0; i < dirs.size(); ++i) {
    names.push_back(dirs[i] + "/strata-bench-io-" + std::to_string(i) + ".dat");
    if (is_laid_out(names.back(), per_file)) continue;
    if (progress)
      std::fprintf(stderr, "  laying out %s (%s)...\n", names.back().c_str(),
                   format_bytes(per_file).c_str());
    const std::string part = names.back() + ".part";
    {
      File file(part, File::Mode::Create, options.direct);
      file.allocate(per_file);
      engine->register_file(file);
      pass(IoOp::Write, per_file / bs,
           [&](std::uint64_t b) { return std::pair<const File*, std::uint64_t>(&file, b * bs); });
      engine->unregister_file(file);
      if (::fsync(file.fd()) != 0) throw IoError(Errc::io_error, part, 0, per_file, errno, "fsync");
    }
    std::filesystem::rename(part, names.back());
    laid_out = true;
  }

  std::vector<File> files;
  files.reserve(names.size());
  for (const auto& name : names) {
    files.emplace_back(name, File::Mode::ReadWrite, options.direct);
    drop_page_cache(files.back());
    engine->register_file(files.back());
  }
  // What was in effect, not what was asked: a filesystem that refuses O_DIRECT (ramfs) gets
  // buffered I/O (File's fallback).
  const bool direct =
      std::all_of(files.begin(), files.end(), [](const File& f) { return f.direct(); });

  std::vector<std::uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (is_random) std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
  const IoOp op = is_read ? IoOp::Read : IoOp::Write;
  const std::uint64_t bytes = blocks * bs;

  // What the device received during `body` (Note [Request sizes]): its average request, from
  // the sysfs counters of the device behind the first path (0 when unknown; other traffic on
  // the device counts too, so an idle device gives the true figure).
  const DeviceLimits& device = files.front().device();
  auto device_request_bytes = [&](auto&& body) {
    const DeviceCounters before = read_device_counters(device.sysfs);
    body();
    const DeviceCounters after = read_device_counters(device.sysfs);
    const std::uint64_t n = is_read ? after.reads - before.reads : after.writes - before.writes;
    const std::uint64_t b =
        is_read ? after.read_bytes - before.read_bytes : after.write_bytes - before.write_bytes;
    return n == 0 ? 0.0 : static_cast<double>(b) / static_cast<double>(n);
  };
  struct Sample {
    double mb_per_s = 0, request_bytes = 0;
  };
  auto strata_pass = [&] {
    double seconds = 0;
    const double request = device_request_bytes([&] {
      for (const File& f : files)
        drop_page_cache(f);
      seconds = pass(op, blocks, [&](std::uint64_t i) {
        const std::uint64_t block = order[i];
        return std::pair<const File*, std::uint64_t>(&files[block % files.size()],
                                                     block / files.size() * bs);
      });
    });
    return Sample{static_cast<double>(bytes) / seconds / 1e6, request};
  };

  // Note [Against fio]: with --vs-fio, each round runs strata and fio with default buffers and
  // fio with huge-page buffers (--iomem=shmhuge) on the same laid-out file, with the same block
  // size, queue depth and direction; the order rotates from round to round so that none of the
  // three always runs first on a disk whose speed drifts; after a write pass the file is fsync'd,
  // untimed, so that every write pass starts from a flushed device. Figures are medians over the
  // rounds, the ratios medians of each round's ratio. The huge pages fio needs are reserved for the
  // run and given back (HugePageReservation); where they cannot be, fio's huge-page figures are
  // left out and the JSON says why.
  // Between write passes (untimed): fsync sends the written data and a cache flush down, so
  // that no pass starts behind the previous one's writes still draining from a cache below
  // (a virtual disk's host cache took runs from 0.8 to 3.7 GB/s depending on what ran before).
  auto settle = [&] {
    if (is_read || !args.vs_fio) return;
    for (const File& f : files)
      if (::fsync(f.fd()) != 0) throw IoError(Errc::io_error, f.path(), 0, 0, errno, "fsync");
  };
  std::vector<Sample> strata_runs, fio_runs, fio_huge_runs;
  std::string fio_version_text, fio_huge_why_not;
  std::size_t fio_huge_pages_added = 0;
  FioJob job;
  if (args.vs_fio) {
    STRATA_EXPECTS(dirs.size() == 1, "--vs-fio: give one --path (fio runs on one file), not ",
                   dirs.size());
    fio_version_text = fio_version(args.fio);
    STRATA_EXPECTS(!fio_version_text.empty(), "--vs-fio: cannot run \"", args.fio,
                   "\" (install fio, e.g. apt-get install fio, or name it with --fio)");
    job.fio = args.fio;
    job.file = names.front();
    job.bytes = per_file;
    job.block = bs;
    job.queue_depth = args.qd;
    job.read = is_read;
    job.random = is_random;
  }
  {
    // fio's buffers: queue depth x block size, rounded to huge pages, with room for alignment.
    std::unique_ptr<HugePageReservation> reservation;
    if (args.vs_fio) {
      reservation = std::make_unique<HugePageReservation>(args.qd * bs + 2 * kHugePageBytes);
      fio_huge_pages_added = reservation->added_pages();
      if (!reservation->ok()) fio_huge_why_not = reservation->why_not();
    }
    const unsigned runs = args.vs_fio ? args.runs : 1;
    for (unsigned round = 0; round < runs; ++round) {
      for (unsigned k = 0; k < 3; ++k) {
        switch ((round + k) % 3) {
          case 0:
            strata_runs.push_back(strata_pass());
            break;
          case 1:
            if (!args.vs_fio) break;
            job.huge_buffers = false;
            fio_runs.push_back({});
            fio_runs.back().request_bytes =
                device_request_bytes([&] { fio_runs.back().mb_per_s = run_fio(job).mb_per_s; });
            break;
          case 2:
            if (!args.vs_fio || !fio_huge_why_not.empty()) break;
            job.huge_buffers = true;
            fio_huge_runs.push_back({});
            fio_huge_runs.back().request_bytes = device_request_bytes(
                [&] { fio_huge_runs.back().mb_per_s = run_fio(job).mb_per_s; });
            break;
        }
        settle();
      }
    }
  }

  engine->unregister_buffer(slab.data());
  for (File& f : files)
    engine->unregister_file(f);
  files.clear();
  if (args.cleanup)
    for (const auto& n : names)
      std::filesystem::remove(n);

  auto field = [](const std::vector<Sample>& runs, double Sample::*f) {
    std::vector<double> out;
    for (const Sample& r : runs)
      out.push_back(r.*f);
    return out;
  };
  auto ratios = [&](const std::vector<Sample>& peer) {
    std::vector<double> out;
    for (std::size_t i = 0; i < peer.size() && i < strata_runs.size(); ++i)
      out.push_back(strata_runs[i].mb_per_s / peer[i].mb_per_s);
    return out;
  };
  const double mb_per_s = median(field(strata_runs, &Sample::mb_per_s));
  const double seconds = static_cast<double>(bytes) / (mb_per_s * 1e6);
  const std::size_t chunk = device.chunk_bytes(bs, run_bytes);

  nlohmann::json out{{"bench", "io"},
                     {"engine", std::string(to_string(engine->kind()))},
                     {"engine_detail", engine->describe()},
                     {"rw", args.rw},
                     {"bs", bs},
                     {"qd", args.qd},
                     {"threads", engine->kind() == EngineKind::Posix ? args.threads : 1},
                     {"paths", dirs},
                     {"direct", direct},
                     {"direct_requested", options.direct},
                     {"laid_out", laid_out},
                     {"huge_pages", to_string(huge)},
                     {"huge_pages_used", to_string(slab.huge_pages())},
                     {"buffer_bytes", slab.size()},
                     {"buffer_huge_page_bytes", buffer_huge_bytes},
                     {"device", device.name},
                     {"device_max_request_bytes", device.max_request_bytes},
                     {"device_max_segments", device.max_segments},
                     {"chunk_bytes", chunk},
                     {"device_request_bytes", median(field(strata_runs, &Sample::request_bytes))},
                     {"bytes", bytes},
                     {"seconds", seconds},
                     {"mb_per_s", mb_per_s},
                     {"iops", static_cast<double>(blocks) / seconds}};
  if (args.vs_fio) {
    out["runs"] = args.runs;
    out["strata_runs_mb_per_s"] = field(strata_runs, &Sample::mb_per_s);
    out["fio"] = fio_version_text;
    job.huge_buffers = false;
    out["fio_command"] = fio_command(job);  // --iomem=shmhuge for the huge-page runs
    out["fio_mb_per_s"] = median(field(fio_runs, &Sample::mb_per_s));
    out["fio_runs_mb_per_s"] = field(fio_runs, &Sample::mb_per_s);
    out["fio_device_request_bytes"] = median(field(fio_runs, &Sample::request_bytes));
    out["ratio_vs_fio"] = median(ratios(fio_runs));
    out["fio_huge_pages_added"] = fio_huge_pages_added;
    if (fio_huge_why_not.empty()) {
      out["fio_huge_mb_per_s"] = median(field(fio_huge_runs, &Sample::mb_per_s));
      out["fio_huge_runs_mb_per_s"] = field(fio_huge_runs, &Sample::mb_per_s);
      out["fio_huge_device_request_bytes"] = median(field(fio_huge_runs, &Sample::request_bytes));
      out["ratio_vs_fio_huge"] = median(ratios(fio_huge_runs));
    } else {
      out["fio_huge_mb_per_s"] = nullptr;
      out["ratio_vs_fio_huge"] = nullptr;
      out["fio_huge_not_run"] = fio_huge_why_not;
    }
  }
  if (args.json) {
    print_json(out);
    return;
  }
  std::printf(
      "io %s: %s in %.2f s = %.1f MB/s, %.0f IOPS (bs %s, qd %u, %zu path%s, %s, %s, "
      "buffers %s in huge pages of %s, %s asked)\n",
      args.rw.c_str(), format_bytes(bytes).c_str(), seconds, mb_per_s,
      static_cast<double>(blocks) / seconds, format_bytes(bs).c_str(), args.qd, dirs.size(),
      dirs.size() == 1 ? "" : "s",
      direct ? "O_DIRECT" : (options.direct ? "buffered: O_DIRECT refused" : "buffered"),
      engine->describe().c_str(), format_bytes(buffer_huge_bytes).c_str(),
      format_bytes(slab.size()).c_str(), to_string(huge));
  auto kib = [](double b) { return b / 1024.0; };
  if (device.known()) {
    std::printf(
        "  device %s: requests up to %s, %u segments; chunks of %s; it received %.0f KiB "
        "requests on average\n",
        device.name.c_str(), format_bytes(device.max_request_bytes).c_str(), device.max_segments,
        format_bytes(chunk).c_str(), kib(out["device_request_bytes"].get<double>()));
  }
  if (args.vs_fio) {
    std::printf(
        "  fio (%s), default buffers: %.1f MB/s (device requests %.0f KiB); strata / fio "
        "= %.3f\n",
        fio_version_text.c_str(), out["fio_mb_per_s"].get<double>(),
        kib(out["fio_device_request_bytes"].get<double>()), out["ratio_vs_fio"].get<double>());
    if (fio_huge_why_not.empty()) {
      std::printf(
          "  fio, huge-page buffers: %.1f MB/s (device requests %.0f KiB); strata / fio "
          "= %.3f\n",
          out["fio_huge_mb_per_s"].get<double>(),
          kib(out["fio_huge_device_request_bytes"].get<double>()),
          out["ratio_vs_fio_huge"].get<double>());
    } else {
      std::printf("  fio, huge-page buffers: not run: %s\n", fio_huge_why_not.c_str());
    }
  }
}

}  // namespace

void register_io(CLI::App& app) {
  auto* cmd = app.add_subcommand("io", "NVMe read/write bandwidth through strata's I/O engines");
  auto args = std::make_shared<Args>();
  cmd->add_option("--rw", args->rw, "read | write | randread | randwrite");
  cmd->add_option("--bs", args->bs, "block size (units allowed, multiple of 4 KiB)");
  cmd->add_option("--qd", args->qd, "operations in flight")->check(CLI::Range(1, 4096));
  cmd->add_option("--size", args->size, "bytes to transfer (units allowed)");
  cmd->add_option("--path", args->paths, "directory, or comma-separated directories to stripe")
      ->required();
  cmd->add_option("--engine", args->engine, "uring | posix | auto");
  cmd->add_option("--direct", args->direct, "1 = O_DIRECT, 0 = buffered")->check(CLI::Range(0, 1));
  cmd->add_option("--threads", args->threads, "POSIX engine threads")->check(CLI::Range(1, 256));
  cmd->add_option("--huge-pages", args->huge_pages,
                  "transparent | hugetlb | off: what backs the I/O buffers (default: "
                  "$STRATA_HUGE_PAGES, else transparent)");
  cmd->add_flag("--cleanup", args->cleanup,
                "remove the data files at the end (by default they stay for the next run, as "
                "fio's do)");
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->add_flag("--vs-fio", args->vs_fio,
                "also run fio on the same file, with default and with huge-page buffers, in "
                "alternating rounds (one --path; huge pages reserved for fio as root)");
  cmd->add_option("--runs", args->runs, "rounds with --vs-fio (medians are reported)")
      ->check(CLI::Range(1, 100));
  cmd->add_option("--fio", args->fio, "the fio executable for --vs-fio");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
