// fp16 / bf16 storage conversions: round-to-nearest-even, subnormals, inf, NaN, overflow.
// References: GCC's _Float16 (libgcc's conversion, an independent implementation) for fp16,
// and a nearest-of-two-candidates search in double for bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace dstrain {
namespace {

uint16_t reference_fp16_bits(float value) {
  const _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, 2);
  return bits;
}

float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

uint16_t reference_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t lower = bits & 0xffff0000u;
  const uint32_t upper = lower + 0x10000u;  // next bf16 away from zero (same sign)
  const double x = value, a = bits_to_float(lower);
  // Past the largest finite bf16 the next candidate is inf, standing for 2^128 when rounding.
  const double b = std::isinf(bits_to_float(upper)) ? std::copysign(std::ldexp(1.0, 128), x)
                                                    : double(bits_to_float(upper));
  const double da = std::abs(x - a), db = std::abs(b - x);
  if (da < db) return static_cast<uint16_t>(lower >> 16);
  if (db < da) return static_cast<uint16_t>(upper >> 16);
  return static_cast<uint16_t>(((lower >> 16) & 1u) ? upper >> 16 : lower >> 16);  // tie: even
}

TEST(Dtype, Fp16KnownValues) {
  EXPECT_EQ(fp32_to_fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(fp32_to_fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(fp32_to_fp16_bits(65504.0f), 0x7bff);           // the largest half
  EXPECT_EQ(fp32_to_fp16_bits(65519.99f), 0x7bff);          // below the midpoint: stays finite
  EXPECT_EQ(fp32_to_fp16_bits(65520.0f), 0x7c00);           // the midpoint ties to even: inf
  EXPECT_EQ(fp32_to_fp16_bits(1e6f), 0x7c00);               // over 65504: inf
  EXPECT_EQ(fp32_to_fp16_bits(-1e6f), 0xfc00);
  EXPECT_EQ(fp32_to_fp16_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(fp32_to_fp16_bits(0x1p-24f), 0x0001);           // smallest subnormal
  EXPECT_EQ(fp32_to_fp16_bits(0x1p-25f), 0x0000);           // half of it: tie to even (0)
  EXPECT_EQ(fp32_to_fp16_bits(0x1.8p-25f), 0x0001);         // above the tie: rounds up
  EXPECT_EQ(fp32_to_fp16_bits(0x1p-14f), 0x0400);           // smallest normal
  EXPECT_EQ(fp32_to_fp16_bits(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_fp16_bits(1.0f + 0x1p-11f), 0x3c00);    // tie between 1 and 1+2^-10: even
  EXPECT_EQ(fp32_to_fp16_bits(1.0f + 0x1.8p-11f), 0x3c01);
  const uint16_t nan = fp32_to_fp16_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(fp16_bits_to_fp32(nan)));
  EXPECT_EQ(fp16_bits_to_fp32(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_bits_to_fp32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_bits_to_fp32(0xfc00)));
}

TEST(Dtype, Fp16EveryHalfRoundTrips) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float value = fp16_bits_to_fp32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(fp32_to_fp16_bits(value), bits) << std::hex << bits;
    ASSERT_EQ(reference_fp16_bits(value), bits) << std::hex << bits;
  }
}

TEST(Dtype, Fp16MatchesReferenceOnRandomFloats) {
  Rng rng(3);
  int checked = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    // Random bit patterns over the interesting exponent range (subnormal to overflow).
    uint32_t bits = static_cast<uint32_t>(rng.next_u64());
    const uint32_t exponent = 100 + static_cast<uint32_t>(rng.below(50));  // 2^-27 .. 2^22
    bits = (bits & 0x807fffffu) | (exponent << 23);
    const float value = bits_to_float(bits);
    ASSERT_EQ(fp32_to_fp16_bits(value), reference_fp16_bits(value)) << value;
    ++checked;
  }
  EXPECT_EQ(checked, 2'000'000);
}

TEST(Dtype, Bf16KnownValuesAndRandom) {
  EXPECT_EQ(fp32_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(fp32_to_bf16_bits(1.0f + 0x1p-8f), 0x3f80);   // tie: even
  EXPECT_EQ(fp32_to_bf16_bits(1.0f + 0x1.8p-8f), 0x3f81);
  EXPECT_EQ(fp32_to_bf16_bits(1e6f), fp32_to_bf16_bits(1e6f));
  EXPECT_EQ(fp32_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(fp32_to_bf16_bits(3.4e38f), 0x7f80);           // rounds past the largest: inf
  EXPECT_EQ(fp32_to_bf16_bits(1e-40f), reference_bf16_bits(1e-40f));  // subnormal
  const uint16_t nan = fp32_to_bf16_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_bits_to_fp32(nan)));
  // A signalling-looking NaN whose payload sits only in the low bits must stay NaN.
  EXPECT_TRUE(std::isnan(bf16_bits_to_fp32(fp32_to_bf16_bits(bits_to_float(0x7f800001u)))));
  Rng rng(4);
  for (int i = 0; i < 1'000'000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng.next_u64());
    const float value = bits_to_float(bits);
    if (std::isnan(value) || std::isinf(value)) continue;
    ASSERT_EQ(fp32_to_bf16_bits(value), reference_bf16_bits(value)) << std::hex << bits;
  }
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float value = bf16_bits_to_fp32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(fp32_to_bf16_bits(value), bits);
  }
}

TEST(Dtype, NamesAndParsing) {
  EXPECT_EQ(parse_dtype("fp16"), DType::F16);
  EXPECT_EQ(parse_dtype("BF16"), DType::BF16);
  EXPECT_EQ(std::string(dtype_name(DType::F32)), "F32");
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_THROW(parse_dtype("fp8"), UserError);
  EXPECT_EQ(round_through(DType::F16, 70000.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_through(DType::F32, 70000.0f), 70000.0f);
}

}  // namespace
}  // namespace dstrain
