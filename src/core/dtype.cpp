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

static uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

static float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

uint16_t fp32_to_fp16_bits(float value) {
  const uint32_t x = float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN -> quiet NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // rounds to >= 65520: inf
  const int32_t exponent = static_cast<int32_t>(abs >> 23) - 127;
  if (exponent >= -14) {
    // Normal half: keep 10 mantissa bits, round the dropped 13 to nearest even.
    uint32_t mantissa = abs & 0x7fffffu;
    uint32_t half = (static_cast<uint32_t>(exponent + 15) << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1;  // may carry into exponent
    return static_cast<uint16_t>(sign | half);
  }
  if (exponent < -25) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: value = m * 2^-24 with m < 1024.
  const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;  // implicit 1
  const int shift = -exponent - 14 + 13;                     // 14..24
  uint32_t half = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (half & 1u))) half += 1;
  return static_cast<uint16_t>(sign | half);
}

float fp16_bits_to_fp32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // Subnormal: exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t fp32_to_bf16_bits(float value) {
  const uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float bf16_bits_to_fp32(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

float round_through(DType dtype, float value) {
  switch (dtype) {
    case DType::F16: return fp16_bits_to_fp32(fp32_to_fp16_bits(value));
    case DType::BF16: return bf16_bits_to_fp32(fp32_to_bf16_bits(value));
    default: return value;
  }
}

}  // namespace dstrain
