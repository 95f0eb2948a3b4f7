// Mapping a safetensors file's tensors into a Runtime (kept apart from the parser, which the fuzz
// target builds alone).
#include "strata/runtime/runtime.h"
#include "strata/runtime/safetensors.h"

namespace strata::safetensors {

std::unordered_map<std::string, TensorId> map_file(Runtime& runtime, const std::string& path,
                                                   const Header& header) {
  std::unordered_map<std::string, TensorId> ids;
  for (const TensorInfo& t : header.tensors) {
    if (t.bytes() == 0) continue;  // nothing to map
    ids.emplace(t.name, runtime.map_tensor(t.desc(), path, t.offset));
  }
  return ids;
}

}  // namespace strata::safetensors
