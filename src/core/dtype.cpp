#include "core/dtype.h"

#include <cstring>

#include "core/check.h"

namespace dstrain {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::F8E4M3: return 1;
    case DType::F8E5M2: return 1;
  }
  DSTRAIN_CHECK(false) << "unknown dtype";
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::F8E4M3: return "F8_E4M3";
    case DType::F8E5M2: return "F8_E5M2";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  if (name == "F32" || name == "fp32" || name == "float32") return DType::F32;
  if (name == "F16" || name == "fp16" || name == "float16") return DType::F16;
  if (name == "BF16" || name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "I32" || name == "int32") return DType::I32;
  DSTRAIN_USER_ERROR() << "unknown dtype '" << name << "' (expected fp32, fp16 or bf16)";
  return DType::F32;
}

float round_through(DType dtype, float value) {
  switch (dtype) {
    case DType::F16: return fp16_bits_to_fp32(fp32_to_fp16_bits(value));
    case DType::BF16: return bf16_bits_to_fp32(fp32_to_bf16_bits(value));
    default: return value;
  }
}

}  // namespace dstrain
