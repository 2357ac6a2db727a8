// Storage dtypes. Compute is always fp32; fp16 and bf16 are storage formats converted with
// round-to-nearest-even, exactly as the GPU's __float2half_rn / __float2bfloat16_rn do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dstrain {

enum class DType : uint8_t { F32, F16, BF16, I32 };

size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "F16", "BF16", "I32".
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

uint16_t fp32_to_fp16_bits(float value);   // RNE; overflow -> inf; NaN stays NaN
float fp16_bits_to_fp32(uint16_t bits);
uint16_t fp32_to_bf16_bits(float value);   // RNE; NaN stays NaN (quiet)
float bf16_bits_to_fp32(uint16_t bits);

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
