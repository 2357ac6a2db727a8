// Float math the CPU kernels' loops vectorize: plain arithmetic and bit moves, no call into
// libm (glibc's tanhf is a scalar call per element: in the GELU of a 64-wide GPT-2 it was a
// third of the training step, benchmarks/RESULTS.md). Each function states its accuracy,
// checked against double over every float it is defined on, sampled (tests/kernels/
// cpu_math_test.cpp).
#pragma once

#include <bit>
#include <cstdint>

namespace dstrain::cpu {

// e^y for y in [0, 19], to within 1.5 ulp (measured 1.32): y = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts,
// so k ln 2 is exact), e^r by a degree-6 polynomial fitted for relative error on that interval,
// times 2^k built in the exponent bits.
inline float exp_0_19(float y) {
  constexpr float kLog2e = 1.44269504f, kLn2High = 0.693145751953125f,
                  kLn2Low = 1.42860682e-06f;
  // Round to the nearest integer by the float adder (round to nearest even: exact below 2^22).
  constexpr float kRound = 12582912.0f;  // 1.5 x 2^23
  const float k = (y * kLog2e + kRound) - kRound;
  const float r = (y - k * kLn2High) - k * kLn2Low;
  float p = 0.00138294208f;
  p = p * r + 0.00837477110f;
  p = p * r + 0.0416683592f;
  p = p * r + 0.166664213f;
  p = p * r + 0.499999911f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const auto scale = std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  return p * scale;
}

// tanh(x) to within 1.5 ulp for every float (measured 1.30), with tanh(+-0) = +-0, tanh(+-inf)
// = +-1 and NaN in, NaN out. |x| < 0.625: |x| + |x|^3 P(x^2), P of degree 4 fitted for relative
// error; above: 1 - 2 / (e^{2|x|} + 1) with |x| clamped at 9.5, where tanh rounds to 1; x's sign
// put back. Both branches are computed and one is chosen by integer masks on the bits (an FP
// select may not be if-converted under -ftrapping-math, a branch stops the vectorizer).
inline float tanh_fast(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto magnitude = static_cast<int32_t>(bits & 0x7fffffffu);  // NaNs above +inf's bits
  const float a = std::bit_cast<float>(magnitude);
  const float z = a * a;
  float p = -0.00571896276f;
  p = p * z + 0.0206531249f;
  p = p * z - 0.0537446588f;
  p = p * z + 0.133315131f;
  p = p * z - 0.333332866f;
  const float small = a + a * z * p;
  constexpr int32_t kClampBits = 0x41180000;  // 9.5f
  const int32_t over = magnitude - kClampBits;  // min(magnitude, kClampBits) without a branch
  const float clamped = std::bit_cast<float>(kClampBits + (over & (over >> 31)));
  const float large = 1.0f - 2.0f / (exp_0_19(clamped + clamped) + 1.0f);
  constexpr int32_t kSmallBits = 0x3f200000;  // 0.625f
  const uint32_t use_small = 0u - static_cast<uint32_t>(magnitude < kSmallBits);  // all ones
  const uint32_t chosen = (std::bit_cast<uint32_t>(small) & use_small) |
                          (std::bit_cast<uint32_t>(large) & ~use_small);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude > 0x7f800000);
  return std::bit_cast<float>((bits & is_nan) | ((chosen | (bits & 0x80000000u)) & ~is_nan));
}

}  // namespace dstrain::cpu
