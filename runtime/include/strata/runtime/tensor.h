// Tensor descriptors: what a tensor is (name, size, type, shape, role). Residency is elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/base/ids.h"

namespace strata {

enum class DType : std::uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U8, Bool };
std::string_view to_string(DType dtype) noexcept;
std::size_t dtype_bytes(DType dtype) noexcept;
/// Parses "f32", "F32", "bf16", ... (safetensors spellings included); throws naming `key`.
DType parse_dtype(std::string_view text, std::string_view key = "dtype");

enum class TensorKind : std::uint8_t { Param, Grad, OptimizerState, Activation, Other };
std::string_view to_string(TensorKind kind) noexcept;

/// How a lease uses a tensor's bytes. Values match the C API's strata_access.
/// Write is write-discard: the holder overwrites every byte, so the old bytes are not brought to
/// the lease's tier (no copy); only space is made. Read and ReadWrite see the newest bytes.
enum class Access : std::uint8_t { Read = 1, Write = 2, ReadWrite = 3 };
constexpr bool writes(Access a) noexcept {
  return (static_cast<unsigned>(a) & static_cast<unsigned>(Access::Write)) != 0;
}

/// How a tensor's copies on the Host and Nvme tiers are stored (Note [Compressed copies] in
/// strata/quant/group_quant.h): in full, or as int8 / int4 codes with an fp16 min and step per
/// group of `group` elements along the last dimension. Its Device copy is always its dtype,
/// dequantized on arrival. A compressed tensor is read-only (weights): F32, BF16 or F16, leased
/// on the Device tier only.
enum class Codec : std::uint8_t { None, Int8, Int4 };
std::string_view to_string(Codec codec) noexcept;
struct Compression {
  Codec codec = Codec::None;
  std::uint32_t group = 64;
};

struct TensorDesc {
  std::string name;
  std::uint64_t bytes = 0;  ///< when 0, derived from dtype and shape; always the full width
  DType dtype = DType::U8;
  std::vector<std::int64_t> shape;
  TensorKind kind = TensorKind::Other;
  Compression compression;  ///< of its Host and Nvme copies
};

}  // namespace strata
