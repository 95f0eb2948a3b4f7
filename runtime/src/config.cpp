#include "strata/runtime/config.h"

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/pages.h"

namespace strata {

std::string_view to_string(EvictionKind kind) noexcept {
  return kind == EvictionKind::Lru ? "lru" : "farthest_next_use";
}

void RuntimeOptions::validate() const {
  STRATA_EXPECTS(backend.link_gbps >= 0, "link_gbps: must be >= 0, got ", backend.link_gbps);
  STRATA_EXPECTS(backend.device_budget_bytes == 0 || backend.device_budget_bytes >= kPageBytes,
                 "device_budget: ", backend.device_budget_bytes,
                 " bytes is smaller than one 4 KiB page");
  io.validate();
  STRATA_EXPECTS(staging_chunk_bytes >= kPageBytes && staging_chunk_bytes % kPageBytes == 0,
                 "staging_chunk: ", staging_chunk_bytes, " is not a positive multiple of 4 KiB");
  STRATA_EXPECTS(staging_chunks >= 1 && staging_chunks <= 64, "staging_chunks: ", staging_chunks,
                 " is outside 1..64");
  // Note [Staging fits the budget]: a larger staging area is shrunk to fit; only a budget that
  // cannot hold the smallest one is refused.
  const std::size_t min_chunk = std::min(staging_chunk_bytes, kMinStagingChunkBytes);
  const unsigned min_slots = std::min(staging_chunks, kMinStagingChunks);
  const std::size_t min_block = std::min(io.block_size, kMinStagingChunkBytes);
  STRATA_EXPECTS(host_budget_bytes >= min_chunk * min_slots + min_block, "host_budget: ",
                 host_budget_bytes, " bytes (", format_bytes(host_budget_bytes),
                 ") is smaller than the smallest staging area (", min_slots, " x ",
                 format_bytes(min_chunk), ") plus the smallest I/O block (",
                 format_bytes(min_block), ")");
  STRATA_EXPECTS(trace_events >= 16, "trace_events: ", trace_events, " is below 16");
  if (!nvme.paths.empty()) {
    nvme.validate();
    STRATA_EXPECTS(
        nvme.stripe_bytes <= staging_chunk_bytes || nvme.stripe_bytes % staging_chunk_bytes == 0,
        "nvme.stripe: ", nvme.stripe_bytes, " must divide, or be a multiple of, staging_chunk (",
        staging_chunk_bytes, ")");
  }
}

// Note [Staging fits the budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The staging area (staging_chunks slots of staging_chunk bytes at the start of the pinned slab)
// and one I/O block must fit the host budget. When the configured area does not, it is shrunk
// until it takes at most half of what the budget leaves after the block: the chunk halves down
// to 256 KiB, then the slots drop to 2, then the chunk halves down to 64 KiB. The I/O block
// (the bounce buffer a request may need) first halves, down to 64 KiB, until it takes at most a
// quarter of the budget. A small host budget then runs, with smaller transfers (slower, and
// correct); validate() refuses only a budget that cannot hold two 64 KiB slots and a 64 KiB
// block. Areas that fit are left as they are.
std::string RuntimeOptions::fit_staging_to_budget() {
  if (staging_chunk_bytes * staging_chunks + io.block_size <= host_budget_bytes) return {};
  const std::size_t was_chunk = staging_chunk_bytes;
  const unsigned was_slots = staging_chunks;
  const std::size_t was_block = io.block_size;
  while (io.block_size > kMinStagingChunkBytes && io.block_size * 4 > host_budget_bytes)
    io.block_size =
        std::max(kMinStagingChunkBytes, io.block_size / 2 / kPageBytes * kPageBytes);
  const std::size_t limit =
      host_budget_bytes > io.block_size ? (host_budget_bytes - io.block_size) / 2 : 0;
  const auto halve = [&] {  // stays a multiple of 4 KiB (validate() refuses anything else)
    staging_chunk_bytes =
        std::max(kMinStagingChunkBytes, staging_chunk_bytes / 2 / kPageBytes * kPageBytes);
  };
  while (staging_chunk_bytes * staging_chunks > limit) {
    if (staging_chunk_bytes > tunables::kStagingShrinkChunkBytes)
      halve();
    else if (staging_chunks > kMinStagingChunks)
      staging_chunks = kMinStagingChunks;
    else if (staging_chunk_bytes > kMinStagingChunkBytes)
      halve();
    else
      break;
  }
  // Still too large (a budget between the smallest area and half of it): the smallest area.
  return detail::concat("the staging area (", was_slots, " x ", format_bytes(was_chunk),
                        ") plus one I/O block (", format_bytes(was_block),
                        ") does not fit host_budget ", format_bytes(host_budget_bytes), ": using ",
                        staging_chunks, " x ", format_bytes(staging_chunk_bytes), " and ",
                        format_bytes(io.block_size),
                        " I/O blocks (smaller NVMe <-> device transfers)");
}

namespace {

using nlohmann::json;

// A key renamed to follow the naming rule (README, Configuration): refused, naming the new one.
[[noreturn]] void renamed(const std::string& key, const char* now) {
  STRATA_FAIL(Errc::invalid_argument, key, ": renamed ", now,
              " (a size is named for what it sizes; its value carries the unit)");
}

std::uint64_t size_of(const json& v, const std::string& key) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer())
    STRATA_FAIL(Errc::invalid_argument, key, ": ", v.get<std::int64_t>(),
                " is negative; sizes are >= 0");
  if (v.is_number_float()) {
    const double d = v.get<double>();
    STRATA_EXPECTS(d >= 0, key, ": ", d, " is negative; sizes are >= 0");
    return static_cast<std::uint64_t>(d);
  }
  if (v.is_string()) return parse_bytes(v.get<std::string>(), key);
  STRATA_FAIL(Errc::invalid_argument, key, ": expected a size (a number or a string such as ",
              "\"512MiB\"), got ", v.type_name());
}

bool bool_of(const json& v, const std::string& key) {
  STRATA_EXPECTS(v.is_boolean(), key, ": expected true or false, got ", v.dump());
  return v.get<bool>();
}

std::string string_of(const json& v, const std::string& key) {
  STRATA_EXPECTS(v.is_string(), key, ": expected a string, got ", v.dump());
  return v.get<std::string>();
}

unsigned count_of(const json& v, const std::string& key) {
  STRATA_EXPECTS(v.is_number_unsigned() && v.get<std::uint64_t>() <= 1u << 20, key,
                 ": expected a non-negative integer, got ", v.dump());
  return v.get<unsigned>();
}

void expect_object(const json& v, const std::string& key) {
  STRATA_EXPECTS(v.is_object(), key.empty() ? "configuration" : key,
                 ": expected a JSON object, got ", v.type_name());
}

}  // namespace

RuntimeOptions RuntimeOptions::from_json(std::string_view text) {
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    STRATA_FAIL(Errc::invalid_argument, "configuration is not valid JSON: ", e.what());
  }
  expect_object(doc, "");
  RuntimeOptions o;
  for (const auto& [key, v] : doc.items()) {
    if (key == "backend") {
      o.backend.kind = parse_backend_kind(string_of(v, key), key);
    } else if (key == "device_budget") {
      o.backend.device_budget_bytes = size_of(v, key);
      STRATA_EXPECTS(o.backend.device_budget_bytes > 0, key, ": must be > 0");
    } else if (key == "host_budget") {
      o.host_budget_bytes = size_of(v, key);
    } else if (key == "link_gbps") {
      STRATA_EXPECTS(v.is_number() && v.get<double>() >= 0, key, ": expected a number >= 0, got ",
                     v.dump());
      o.backend.link_gbps = v.get<double>();
    } else if (key == "device_ordinal") {
      o.backend.device_ordinal = static_cast<int>(count_of(v, key));
    } else if (key == "checksums") {
      o.checksums = bool_of(v, key);
    } else if (key == "eviction") {
      const std::string e = string_of(v, key);
      if (e == "lru")
        o.eviction = EvictionKind::Lru;
      else if (e == "farthest_next_use")
        o.eviction = EvictionKind::FarthestNextUse;
      else
        STRATA_FAIL(Errc::invalid_argument, key, ": unknown policy \"", e,
                    "\" (expected lru or farthest_next_use)");
    } else if (key == "trace_events") {
      o.trace_events = count_of(v, key);
    } else if (key == "staging_chunk") {
      o.staging_chunk_bytes = size_of(v, key);
    } else if (key == "staging_chunks") {
      o.staging_chunks = count_of(v, key);
    } else if (key == "host_copy_on_the_way") {
      o.host_copy_on_the_way = bool_of(v, key);
    } else if (key == "quiet") {
      o.quiet = bool_of(v, key);
    } else if (key == "nvme") {
      expect_object(v, key);
      for (const auto& [k, x] : v.items()) {
        const std::string name = "nvme." + k;
        if (k == "paths") {
          STRATA_EXPECTS(x.is_array() && !x.empty(), name,
                         ": expected a non-empty array of directories");
          for (const auto& p : x)
            o.nvme.paths.push_back(string_of(p, name));
        } else if (k == "capacity") {
          o.nvme.capacity_bytes = size_of(x, name);
        } else if (k == "stripe") {
          o.nvme.stripe_bytes = size_of(x, name);
        } else if (k == "stripe_bytes") {
          renamed(name, "nvme.stripe");
        } else if (k == "keep_files") {
          o.nvme.keep_files = bool_of(x, name);
        } else {
          STRATA_FAIL(Errc::invalid_argument, name,
                      ": unknown key (known: paths, capacity, stripe, keep_files)");
        }
      }
    } else if (key == "io") {
      expect_object(v, key);
      for (const auto& [k, x] : v.items()) {
        const std::string name = "io." + k;
        if (k == "engine")
          o.io.engine = parse_engine_kind(string_of(x, name), name);
        else if (k == "block")
          o.io.block_size = size_of(x, name);
        else if (k == "block_size")
          renamed(name, "io.block");
        else if (k == "queue_depth")
          o.io.queue_depth = count_of(x, name);
        else if (k == "threads")
          o.io.threads = count_of(x, name);
        else if (k == "direct")
          o.io.direct = bool_of(x, name);
        else if (k == "sqpoll")
          o.io.sqpoll = bool_of(x, name);
        else if (k == "faults") {
          STRATA_EXPECTS(x.is_array(), name, ": expected an array such as [\"read:3:eio\"]");
          for (const auto& f : x)
            o.io.faults.push_back(parse_fault(string_of(f, name), name));
        } else {
          STRATA_FAIL(Errc::invalid_argument, name,
                      ": unknown key (known: engine, block, queue_depth, threads, direct, "
                      "sqpoll, faults)");
        }
      }
    } else {
      STRATA_FAIL(Errc::invalid_argument, key,
                  ": unknown key (known: backend, device_budget, host_budget, link_gbps, "
                  "device_ordinal, nvme, io, checksums, eviction, trace_events, staging_chunk, "
                  "staging_chunks, host_copy_on_the_way, quiet)");
    }
  }
  if (!o.nvme.paths.empty() && o.nvme.capacity_bytes == 0)
    STRATA_FAIL(Errc::invalid_argument, "nvme.capacity: required when nvme.paths is given");
  o.nvme.checksums = o.checksums;
  o.nvme.direct = o.io.direct;
  o.validate();
  return o;
}

}  // namespace strata
