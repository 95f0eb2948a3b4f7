// libFuzzer target: any bytes as a safetensors file image. The parser must either accept it with
// every invariant holding, or throw strata::Error; nothing else (no crash, no sanitizer report).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/base/error.h"
#include "strata/runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view image(reinterpret_cast<const char*>(data), size);
  try {
    const auto h = strata::safetensors::parse_image(image, "fuzz");
    const std::uint64_t data_bytes = h.file_bytes - h.data_offset;
    std::uint64_t covered = 0;
    for (const auto& t : h.tensors) {
      std::uint64_t elements = strata::dtype_bytes(t.dtype);
      for (std::int64_t d : t.shape)
        elements *= static_cast<std::uint64_t>(d);
      // Accepted means: tiled in order, inside the data, sized by dtype and shape.
      if (t.begin != covered || t.end < t.begin || t.end > data_bytes || t.bytes() != elements ||
          t.offset != h.data_offset + t.begin)
        __builtin_trap();
      covered = t.end;
    }
    if (covered != data_bytes) __builtin_trap();
  } catch (const strata::Error&) {
    // A named error is the right answer to a malformed file.
  }
  return 0;
}
