// FP8, the two 8-bit floating-point formats of the OCP specification (OCP 8-bit Floating Point
// Specification (OFP8), v1.0; the formats of Hopper's and Ada's tensor cores):
//
//   E4M3 ("e4m3fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; one NaN
//        per sign, S.1111.111. Largest finite 448 (S.1111.110); smallest normal 2^-6; smallest
//        subnormal 2^-9.
//   E5M2: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE 754's conventions: infinities
//        S.11111.00, NaNs S.11111.{01,10,11}. Largest finite 57344 (S.11110.11); smallest normal
//        2^-14; smallest subnormal 2^-16.
//
// fp32 -> FP8 rounds to nearest, ties to even, with subnormals. What happens beyond the largest
// finite value is the caller's choice:
//   satfinite (PTX's cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, what dstrain's casts use): the
//     largest finite value of the input's sign, infinities included;
//   otherwise (the OCP spec's non-saturating mode): E4M3 NaN, E5M2 infinity.
// A value that rounds past the largest finite value is beyond it: E4M3 above 464 (464 itself
// ties to 448, the even neighbour), E5M2 from 61440 (that tie goes to the even neighbour, 2^16).
// NaN gives NaN of the input's sign: E4M3's S.1111.111; E5M2's S.11111.1x, x the input's second
// mantissa bit (as the CUDA toolkit's own host conversion does: a quiet NaN stays quiet).
// FP8 -> fp32 is exact.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace dstrain {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };

struct Fp8Layout {
  int mantissa_bits;  // 3 or 2
  int bias;           // 7 or 15
  uint8_t max_bits;   // the largest finite value's bits, sign clear
  float max;          // its value: 448 or 57344
  uint8_t overflow;   // what an overflow gives without satfinite: E4M3's NaN, E5M2's infinity
};

constexpr Fp8Layout fp8_layout(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? Fp8Layout{3, 7, 0x7e, 448.0f, 0x7f}
                                    : Fp8Layout{2, 15, 0x7b, 57344.0f, 0x7c};
}

const char* fp8_name(Fp8Format format);  // "e4m3", "e5m2"

inline uint8_t fp32_to_fp8_bits(float value, Fp8Format format, bool satfinite) {
  const Fp8Layout f = fp8_layout(format);
  const uint32_t x = float_bits(value);
  const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN
    return static_cast<uint8_t>(sign |
                                (format == Fp8Format::kE4M3 ? 0x7fu : 0x7eu | ((abs >> 21) & 1u)));
  }
  if (abs == 0x7f800000u) return static_cast<uint8_t>(sign | (satfinite ? f.max_bits : f.overflow));
  // value = significand * 2^(exponent - 23); fp32 subnormals are far below FP8's range.
  const int exponent = static_cast<int>(abs >> 23) - 127;
  const uint32_t significand = (abs & 0x7fffffu) | 0x800000u;
  const int min_exponent = 1 - f.bias;  // of a normal FP8 value
  // The FP8 quantum at this magnitude is 2^(max(exponent, min_exponent) - mantissa_bits).
  const int shift = 23 - f.mantissa_bits + (exponent < min_exponent ? min_exponent - exponent : 0);
  if (abs == 0 || shift >= 25) return sign;  // below half the smallest subnormal (or a tie): 0
  uint32_t n = significand >> shift;         // the value in quanta, rounded to nearest even
  const uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (n & 1u))) ++n;
  // Subnormal: the quanta are the bits (2^m of them carry into the smallest normal's bits).
  // Normal: the biased exponent above the mantissa; a carry of n to 2^(m+1) moves it up one.
  const uint32_t bits = exponent < min_exponent
                            ? n
                            : (static_cast<uint32_t>(exponent + f.bias) << f.mantissa_bits) + n -
                                  (1u << f.mantissa_bits);
  if (bits > f.max_bits) return static_cast<uint8_t>(sign | (satfinite ? f.max_bits : f.overflow));
  return static_cast<uint8_t>(sign | bits);
}

inline float fp8_bits_to_fp32(uint8_t bits, Fp8Format format) {
  const Fp8Layout f = fp8_layout(format);
  const bool negative = (bits & 0x80u) != 0;
  const uint32_t magnitude = bits & 0x7fu;
  const uint32_t exponent = magnitude >> f.mantissa_bits;
  const uint32_t mantissa = magnitude & ((1u << f.mantissa_bits) - 1u);
  float value;
  if (format == Fp8Format::kE4M3 && magnitude == 0x7fu) {
    value = NAN;
  } else if (format == Fp8Format::kE5M2 && exponent == 0x1fu) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent == 0) {  // subnormal: mantissa quanta of 2^(1 - bias - m)
    value = std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.mantissa_bits);
  } else {
    value = std::ldexp(static_cast<float>(mantissa + (1u << f.mantissa_bits)),
                       static_cast<int>(exponent) - f.bias - f.mantissa_bits);
  }
  return negative ? -value : value;
}

// The FP8 dtypes' formats. REQUIRES for fp8_format: is_fp8(dtype).
inline bool is_fp8(DType dtype) { return dtype == DType::F8E4M3 || dtype == DType::F8E5M2; }
inline Fp8Format fp8_format(DType dtype) {
  return dtype == DType::F8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
}

// Bit patterns of the FP8 dtypes, distinct types for the templates of dtype.h (load_f32,
// store_as, dtype_of); store_as rounds with satfinite, as dstrain's casts do.
struct fp8e4m3_t {
  uint8_t bits;
};
struct fp8e5m2_t {
  uint8_t bits;
};
inline float load_f32(fp8e4m3_t v) { return fp8_bits_to_fp32(v.bits, Fp8Format::kE4M3); }
inline float load_f32(fp8e5m2_t v) { return fp8_bits_to_fp32(v.bits, Fp8Format::kE5M2); }
template <>
inline fp8e4m3_t store_as<fp8e4m3_t>(float v) {
  return fp8e4m3_t{fp32_to_fp8_bits(v, Fp8Format::kE4M3, true)};
}
template <>
inline fp8e5m2_t store_as<fp8e5m2_t>(float v) {
  return fp8e5m2_t{fp32_to_fp8_bits(v, Fp8Format::kE5M2, true)};
}
template <>
constexpr DType dtype_of<fp8e4m3_t>() {
  return DType::F8E4M3;
}
template <>
constexpr DType dtype_of<fp8e5m2_t>() {
  return DType::F8E5M2;
}

// The per-tensor scale of a tensor whose largest magnitude is `amax`, for the current-amax
// scaling dstrain uses: the largest power of two s with amax * s <= the format's largest finite
// value (1 when amax is 0 or not finite; at most 2^126). A power of two so that scaling and
// unscaling are exact: the only rounding is the FP8 cast's, wherever the scale is applied.
float fp8_scale_for_amax(float amax, Fp8Format format);

}  // namespace dstrain
