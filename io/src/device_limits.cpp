#include "strata/io/device_limits.h"

#include <sys/sysmacros.h>

#include <algorithm>
#include <bit>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>

#include "strata/io/pages.h"
#include "strata/base/units.h"

namespace strata {
namespace {

// The first number in `path`, or 0 when the file is missing or holds none.
std::uint64_t read_number(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::uint64_t value = 0;
  return in >> value ? value : 0;
}

}  // namespace

std::size_t DeviceLimits::whole_request_bytes(std::size_t run_bytes) const noexcept {
  if (!known()) return 0;
  std::size_t segment = std::max(run_bytes, kPageBytes);
  if (max_segment_bytes != 0) segment = std::min(segment, max_segment_bytes);
  segment = std::max(segment, kPageBytes);
  // A chunk may start inside a run larger than a page and so touch one run more.
  const unsigned usable =
      run_bytes > kPageBytes && max_segments > 1 ? max_segments - 1 : max_segments;
  // Saturating: usable x segment can exceed size_t only on absurd inputs.
  const std::size_t by_segments =
      segment > SIZE_MAX / usable ? SIZE_MAX : static_cast<std::size_t>(usable) * segment;
  const std::size_t whole = std::min(max_request_bytes, by_segments);
  return std::max(std::bit_floor(whole), kPageBytes);
}

std::size_t DeviceLimits::chunk_bytes(std::size_t block_size,
                                      std::size_t run_bytes) const noexcept {
  const std::size_t whole = whole_request_bytes(run_bytes);
  return whole == 0 ? block_size : std::min(block_size, whole);
}

DeviceLimits read_device_limits(const std::filesystem::path& dir) {
  DeviceLimits limits;
  std::error_code ec;
  limits.sysfs = std::filesystem::canonical(dir, ec);
  if (ec) return limits;
  limits.name = limits.sysfs.filename().string();
  // A partition has no queue of its own: its disk's is the one above it.
  std::filesystem::path queue = limits.sysfs / "queue";
  if (std::filesystem::exists(limits.sysfs / "partition", ec))
    queue = limits.sysfs.parent_path() / "queue";
  limits.max_request_bytes = read_number(queue / "max_sectors_kb") * KiB;
  limits.max_segments = static_cast<unsigned>(read_number(queue / "max_segments"));
  limits.max_segment_bytes = read_number(queue / "max_segment_size");
  return limits;
}

const DeviceLimits& device_limits(dev_t dev) {
  // Devices are few and their limits fixed for the process's purposes; entries are never erased,
  // so the references handed out stay valid.
  static std::mutex mutex;
  static std::map<dev_t, std::unique_ptr<DeviceLimits>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[dev];
  if (!slot) {
    const std::string id = std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
    slot = std::make_unique<DeviceLimits>(read_device_limits("/sys/dev/block/" + id));
  }
  return *slot;
}

DeviceCounters read_device_counters(const std::filesystem::path& dir) {
  std::ifstream in(dir / "stat");
  std::uint64_t f[7] = {};
  for (auto& v : f)
    if (!(in >> v)) return {};
  constexpr std::uint64_t kSector = 512;  // the stat file counts 512-byte sectors on any device
  return {f[0], f[2] * kSector, f[4], f[6] * kSector};
}

std::size_t contiguous_run_bytes(const void* data, std::size_t bytes) {
  if (data == nullptr || bytes < kHugePageBytes) return kPageBytes;
  return huge_page_bytes(data, bytes) >= bytes ? kHugePageBytes : kPageBytes;
}

}  // namespace strata
