// Every tunable default of strata, named and explained once. The options structs
// (IoOptions, SwapOptions, RuntimeOptions, PipelineOptions) take their defaults from here, and
// the fixed sizes the code uses are these names, not numbers written where they are used. It
// lives in base, below every layer, so that every layer can read it; it includes nothing.
#pragma once

#include <cstddef>

namespace strata::tunables {

// ---- the I/O engines (IoOptions) ----
/// A request is split into chunks of this many bytes (capped where the device would split them).
inline constexpr std::size_t kBlockBytes = std::size_t{1} << 20;
/// Chunks in flight per io_uring ring.
inline constexpr unsigned kQueueDepth = 16;
/// Workers of the POSIX (pread/pwrite) engine.
inline constexpr unsigned kPosixThreads = 4;
/// O_DIRECT where the filesystem allows it.
inline constexpr bool kDirect = true;
/// Fixed-buffer and fixed-file table sizes registered with each ring (sparse tables).
inline constexpr unsigned kFixedBuffers = 64;
inline constexpr unsigned kFixedFiles = 256;
/// After an unexpected ring error, how long the engine waits for operations in the kernel
/// before failing them (Note [A broken ring]).
inline constexpr int kBrokenRingDrainSeconds = 5;

// ---- the swap space (SwapOptions) ----
/// RAID-0 stripe unit across the NVMe paths; also the unit checksums and torn state are kept per.
inline constexpr std::size_t kStripeBytes = std::size_t{1} << 20;
/// Page-aligned buffers for unaligned transfers are kept for reuse up to this many bytes, and
/// made in multiples of kStagingRoundBytes so that they fit the next transfers of about the same
/// size (Note [Staging for unaligned transfers]).
inline constexpr std::size_t kStagingPoolBytes = std::size_t{32} << 20;
inline constexpr std::size_t kStagingRoundBytes = std::size_t{64} << 10;

// ---- the runtime (RuntimeOptions) ----
/// The pinned host tier (one slab, staging slots at its start).
inline constexpr std::size_t kHostBudgetBytes = std::size_t{1} << 30;
/// NVMe <-> device pipeline chunk and staging slots (Note [Chunk pipeline]).
inline constexpr std::size_t kStagingChunkBytes = std::size_t{4} << 20;
inline constexpr unsigned kStagingChunks = 4;
/// A staging area too large for the host budget shrinks: its chunk halves down to
/// kStagingShrinkChunkBytes, then its slots drop to kMinStagingChunks, then the chunk halves down
/// to kMinStagingChunkBytes (Note [Staging fits the budget]).
inline constexpr std::size_t kStagingShrinkChunkBytes = std::size_t{256} << 10;
inline constexpr std::size_t kMinStagingChunkBytes = std::size_t{64} << 10;
inline constexpr unsigned kMinStagingChunks = 2;
/// Alignment of every device allocation (CUDA's own for cudaMalloc).
inline constexpr std::size_t kDeviceAlignment = 256;
/// Events the telemetry ring keeps (the Chrome trace's length).
inline constexpr std::size_t kTraceEvents = std::size_t{1} << 16;

// ---- the scheduler (PipelineOptions) ----
/// Iterations whose prefetch logs PrefetchPipeline keeps (a ring).
inline constexpr std::size_t kPrefetchLogIterations = 64;

// ---- measurements (MeasureRule: the benchmarks and the examples' figures) ----
/// A figure's runs add up to at least this much wall time before its median is taken, and at
/// most this many rounds are run (Note [Measuring until the figures hold]).
inline constexpr double kMinMeasureSeconds = 1.0;
inline constexpr int kMaxMeasureRounds = 500;

}  // namespace strata::tunables
