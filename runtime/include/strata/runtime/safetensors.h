// safetensors: the format's reader (validating everything), a streaming writer, and the mapping of
// a file's tensors into a Runtime with the file itself as their NVMe home.
//
// Format: an 8-byte little-endian header length N, N bytes of JSON, then the data section. The
// JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data section), plus an optional "__metadata__" map of strings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "strata/runtime/tensor.h"

namespace strata {
class Runtime;
}

namespace strata::safetensors {

/// The largest header the reader accepts (the format's own limit is 100 MB).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;   ///< data_offsets[0], relative to the data section
  std::uint64_t end = 0;     ///< data_offsets[1]
  std::uint64_t offset = 0;  ///< absolute offset in the file: 8 + header length + begin
  [[nodiscard]] std::uint64_t bytes() const noexcept { return end - begin; }
  [[nodiscard]] TensorDesc desc(TensorKind kind = TensorKind::Param) const;
};

struct Header {
  std::uint64_t header_bytes = 0;  ///< N
  std::uint64_t data_offset = 0;   ///< 8 + N
  std::uint64_t file_bytes = 0;
  std::vector<TensorInfo> tensors;  ///< in data-section order
  std::map<std::string, std::string> metadata;
  /// Null when absent.
  [[nodiscard]] const TensorInfo* find(std::string_view name) const;
  [[nodiscard]] const TensorInfo& at(std::string_view name) const;  ///< throws not_found
};

/// Validates the JSON header `json` of a file of `file_bytes` bytes. Checks: a JSON object with
/// unique keys; every entry has a known dtype, a shape of non-negative integers and data_offsets
/// [begin, end] with begin <= end inside the data section; bytes = dtype size x the shape's
/// product (no overflow); tensors do not overlap and cover the data section with no hole;
/// __metadata__ maps strings to strings. Throws strata::Error (corrupt_data) naming `source`,
/// the tensor and the problem. Never crashes, whatever the input (fuzzed).
Header parse_header(std::string_view json, std::uint64_t file_bytes, std::string_view source = "");
/// Parses a whole file image held in memory (tests, the fuzz target): length, header, sizes.
Header parse_image(std::string_view image, std::string_view source = "");
/// Reads and validates the header of the file at `path` (throws IoError for I/O failures).
Header read_header(const std::string& path);

/// One tensor to write: name, dtype and shape (its bytes follow from them).
struct TensorSpec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
};

/// Writes a safetensors file tensor by tensor, in the order given, never holding more than the
/// caller's buffer: the header first (padded with spaces so the data starts `data_alignment`
/// aligned: 8 bytes as the safetensors library writes, or 4 KiB so that O_DIRECT reads of a
/// mapped tensor whose size is a page multiple land in place instead of through a bounce
/// buffer), then each tensor's bytes as they come. Throws IoError naming the path on failure.
class Writer {
 public:
  Writer(const std::string& path, std::vector<TensorSpec> tensors,
         const std::map<std::string, std::string>& metadata = {}, std::uint64_t data_alignment = 8);
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  ~Writer();
  /// Appends bytes of the current tensor (any number of calls per tensor, in order).
  void write(const void* data, std::size_t bytes);
  /// Checks every tensor got all its bytes, flushes and closes.
  void finish();
  /// The same, with metadata known only at the end (checksums of the data) written over the
  /// constructor's: it must make a header of the same length (give fixed-width values).
  void finish(const std::map<std::string, std::string>& metadata);
  [[nodiscard]] std::uint64_t file_bytes() const noexcept { return total_; }

 private:
  [[nodiscard]] std::string header_text(const std::map<std::string, std::string>& metadata) const;

  std::string path_;
  int fd_ = -1;
  std::vector<TensorSpec> specs_;
  std::uint64_t alignment_ = 8;
  std::uint64_t data_offset_ = 0;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::string> names_;
  std::size_t current_ = 0;
  std::uint64_t written_in_current_ = 0;
  std::uint64_t total_ = 0;
};

/// Registers every tensor of the file with `runtime` (Runtime::map_tensor: read-only extents of
/// the file at their real offsets; nothing is copied or ever written back). Name -> id.
std::unordered_map<std::string, TensorId> map_file(Runtime& runtime, const std::string& path,
                                                   const Header& header);

}  // namespace strata::safetensors
