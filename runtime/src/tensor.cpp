#include "strata/runtime/tensor.h"

#include <cctype>

#include "strata/base/error.h"

namespace strata {

std::string_view to_string(DType d) noexcept {
  switch (d) {
    case DType::F32:
      return "f32";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    case DType::F64:
      return "f64";
    case DType::I64:
      return "i64";
    case DType::I32:
      return "i32";
    case DType::I16:
      return "i16";
    case DType::I8:
      return "i8";
    case DType::U8:
      return "u8";
    case DType::Bool:
      return "bool";
  }
  return "?";
}

std::size_t dtype_bytes(DType d) noexcept {
  switch (d) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::Bool:
      return 1;
  }
  return 1;
}

DType parse_dtype(std::string_view text, std::string_view key) {
  std::string t(text);
  for (char& c : t)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "f32" || t == "float32") return DType::F32;
  if (t == "f16" || t == "float16") return DType::F16;
  if (t == "bf16" || t == "bfloat16") return DType::BF16;
  if (t == "f64" || t == "float64") return DType::F64;
  if (t == "i64" || t == "int64") return DType::I64;
  if (t == "i32" || t == "int32") return DType::I32;
  if (t == "i16" || t == "int16") return DType::I16;
  if (t == "i8" || t == "int8") return DType::I8;
  if (t == "u8" || t == "uint8") return DType::U8;
  if (t == "bool") return DType::Bool;
  STRATA_FAIL(Errc::invalid_argument, key, ": unknown dtype \"", text, "\"");
}

std::string_view to_string(Codec codec) noexcept {
  switch (codec) {
    case Codec::Int8:
      return "int8";
    case Codec::Int4:
      return "int4";
    case Codec::None:
      break;
  }
  return "none";
}

std::string_view to_string(TensorKind k) noexcept {
  switch (k) {
    case TensorKind::Param:
      return "param";
    case TensorKind::Grad:
      return "grad";
    case TensorKind::OptimizerState:
      return "optimizer_state";
    case TensorKind::Activation:
      return "activation";
    case TensorKind::Other:
      return "other";
  }
  return "?";
}

}  // namespace strata
