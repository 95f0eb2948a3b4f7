// The compressed cache of a safetensors file (Note [The compressed cache] in
// python/strata/torch/_compress.py, the same format and name from C++): its picked tensors
// quantized once into a safetensors file of 4 KiB-padded blobs whose metadata keys it to the
// source (path, size, modification time) and holds each blob's CRC32C; opened, or built (again)
// when missing, stale or corrupt, and mapped into a Runtime as compressed tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/quant/group_quant.h"
#include "strata/runtime/safetensors.h"

namespace strata {
class Runtime;
}

namespace strata::safetensors {

struct CompressedCache {
  std::string path;
  Header header;         ///< of the cache file
  bool rebuilt = false;  ///< built by this open
  std::string why;       ///< why it was (re)built: "no cache yet", "source_mtime_ns changed", ...
  std::uint64_t stored_bytes = 0;  ///< the compressed tensors' bytes
  std::uint64_t full_bytes = 0;    ///< theirs at full width
};

/// <cache_dir>/<stem>-<CRC32C of the absolute path, hex>.<int8|int4>-g<group>.safetensors
std::string compressed_cache_path(const std::string& source, const std::string& cache_dir,
                                  const quant::Scheme& scheme);

/// Opens the cache of `names` (tensors of the file `source`, whose header is `header`), or
/// builds it when it is missing, stale (another key or selection) or, with `verify`, fails a
/// CRC32C: quantized tensor by tensor, once (the header is written again with the CRCs at the end),
/// written to a temporary file and renamed over the old one. `progress(done, total)` is called
/// as bytes are written. Throws strata::Error naming the tensor for one that cannot be
/// compressed, IoError naming the path for I/O failures.
CompressedCache open_compressed_cache(
    const std::string& source, const Header& header, const std::vector<std::string>& names,
    const quant::Scheme& scheme, const std::string& cache_dir, bool verify = true,
    const std::function<void(std::uint64_t, std::uint64_t)>& progress = {});

/// Maps the cache's tensors into `runtime` as compressed tensors (their dtype and shape the
/// source's): name -> id.
std::unordered_map<std::string, TensorId> map_compressed(Runtime& runtime,
                                                         const CompressedCache& cache);

}  // namespace strata::safetensors
