// Storage dtypes. Compute is always fp32; fp16 and bf16 are storage formats converted with
// round-to-nearest-even, exactly as the GPU's __float2half_rn / __float2bfloat16_rn do. The FP8
// formats (F8E4M3, F8E5M2: core/fp8.h) hold only the operands of FP8 GEMMs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dstrain {

enum class DType : uint8_t { F32, F16, BF16, I32, F8E4M3, F8E5M2 };

size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "F16", "BF16", "I32", "F8_E4M3", "F8_E5M2".
const char* dtype_name(DType dtype);
// Accepts the safetensors spelling and the flag spelling ("fp32", "fp16", "bf16").
// REQUIRES: a known name; throws UserError otherwise.
DType parse_dtype(std::string_view name);

// Bit patterns of the 16-bit formats, distinct types so templates can dispatch on them.
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

// fp32_to_fp16_bits: RNE; overflow -> inf; NaN stays NaN. fp32_to_bf16_bits: RNE; NaN stays
// NaN (quiet). Inline: every fp16/bf16 load and store of the CPU backend goes through them.
namespace dtype_detail {
inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

}  // namespace dtype_detail

using dtype_detail::bits_float;
using dtype_detail::float_bits;

inline uint16_t fp32_to_fp16_bits(float value) {
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

inline float fp16_bits_to_fp32(uint16_t bits) {
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

inline uint16_t fp32_to_bf16_bits(float value) {
  const uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

inline float bf16_bits_to_fp32(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }



// Load a stored value as fp32 / store an fp32 value rounded to the storage type.
inline float load_f32(float v) { return v; }
inline float load_f32(half_t v) { return fp16_bits_to_fp32(v.bits); }
inline float load_f32(bf16_t v) { return bf16_bits_to_fp32(v.bits); }
template <class T>
inline T store_as(float v);
template <>
inline float store_as<float>(float v) { return v; }
template <>
inline half_t store_as<half_t>(float v) { return half_t{fp32_to_fp16_bits(v)}; }
template <>
inline bf16_t store_as<bf16_t>(float v) { return bf16_t{fp32_to_bf16_bits(v)}; }

// Round an fp32 value through a storage dtype (identity for F32).
float round_through(DType dtype, float value);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<half_t>() { return DType::F16; }
template <>
constexpr DType dtype_of<bf16_t>() { return DType::BF16; }
template <>
constexpr DType dtype_of<int32_t>() { return DType::I32; }

}  // namespace dstrain
