// The block device behind a file, as the I/O engines need it: the request limits that decide how
// large a chunk reaches the device whole (Note [Request sizes]) and the counters that show what
// the device really received. Read from sysfs; knows nothing of engines or tensors.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace strata {

// Note [Request sizes]
// ~~~~~~~~~~~~~~~~~~~~
// The block layer splits an O_DIRECT request it cannot pass whole (queue limits in
// /sys/dev/block/MAJ:MIN/queue, a partition's in its disk's):
//  - max_sectors_kb: the largest request, in KiB (4096 on a virtio disk; the drive's MDTS,
//    often 128 KiB-2 MiB, on NVMe);
//  - max_segments: the most physically contiguous runs of memory one request may gather (254 on
//    virtio, 127-128 on many NVMe drives), each at most max_segment_size bytes.
// A buffer of 4 KiB pages is one segment per page, so from it a request reaches the device whole
// only up to max_segments x 4 KiB (1016 KiB on virtio: a 1 MiB read became two 512 KiB device
// requests, 4 MiB averaged 819 KiB). A buffer in 2 MiB pages needs one segment per 2 MiB (and
// one more where a chunk starts inside a page), so max_sectors_kb is the only bound.
//
// So a request is cut into chunks of
//     min(io.block_size, the largest power of two <= min(max_sectors_kb KiB,
//                                                        usable segments x segment bytes))
// where a segment is min(the buffer's contiguous run, max_segment_size) and the usable segments
// are max_segments, less one when the run is larger than 4 KiB (a chunk may start inside it).
// The run is 2 MiB for a buffer registered as being in huge pages (the pinned slab, when
// huge_page_bytes() says all of it is), else 4 KiB. A power of two keeps chunks of a 2 MiB
// aligned request 2 MiB aligned. io.block_size stays the user's upper bound (default 1 MiB:
// 16 in flight is 16 MiB, enough for the drives measured); a file whose device is unknown
// (tmpfs, overlayfs: no /sys/dev/block entry) is cut at io.block_size alone.
struct DeviceLimits {
  std::string name;                   ///< "vda", "nvme0n1p2"; empty when unknown
  std::filesystem::path sysfs;        ///< /sys/dev/block/MAJ:MIN resolved (the partition's)
  std::size_t max_request_bytes = 0;  ///< max_sectors_kb x 1 KiB; 0 when unknown
  unsigned max_segments = 0;          ///< 0 when unknown
  std::size_t max_segment_bytes = 0;  ///< 0 when unknown (treated as unbounded)

  [[nodiscard]] bool known() const noexcept { return max_request_bytes != 0 && max_segments != 0; }
  /// The largest request, a power of two of 4 KiB or more, that reaches the device whole from a
  /// buffer of physically contiguous runs of `run_bytes` (Note [Request sizes]); 0 when unknown.
  [[nodiscard]] std::size_t whole_request_bytes(std::size_t run_bytes) const noexcept;
  /// The chunk a request is cut into: min(block_size, whole_request_bytes(run_bytes)), or
  /// block_size when the device is unknown.
  [[nodiscard]] std::size_t chunk_bytes(std::size_t block_size,
                                        std::size_t run_bytes) const noexcept;
};

/// Reads the limits of the device whose sysfs directory is `dir` (a disk, or a partition whose
/// queue is its parent's). Missing files leave fields at 0 (unknown); never throws.
DeviceLimits read_device_limits(const std::filesystem::path& dir);
/// The limits of the block device `dev` (a file's st_dev), read once per device and cached;
/// unknown for a device without a /sys/dev/block entry. Thread-safe; never throws.
const DeviceLimits& device_limits(dev_t dev);

/// What a device has completed since boot, from its sysfs `stat` (fields 1, 3, 5 and 7).
struct DeviceCounters {
  std::uint64_t reads = 0, read_bytes = 0, writes = 0, write_bytes = 0;
};
/// Reads `dir`/stat; all zero when absent. The difference of two readings divided out gives the
/// average size of the requests the device received.
DeviceCounters read_device_counters(const std::filesystem::path& dir);

/// The contiguous run of the buffer [data, data + bytes) as Note [Request sizes] counts it:
/// 2 MiB when every byte of it is in huge pages now (huge_page_bytes), else 4 KiB. Reads
/// /proc/self/smaps: call it at registration, not per request.
std::size_t contiguous_run_bytes(const void* data, std::size_t bytes);

}  // namespace strata
