// FP8 conversions (core/fp8.h): the OCP specification's table of special values for E4M3 and
// E5M2; every byte decoded and 9,000 fp32 values a format encoded as ml_dtypes does
// (tests/reference/fp8_tables.json, made by make_fp8_tables.py: every FP8 value, every midpoint
// and its fp32 neighbours, the overflow and underflow edges, random values); satfinite as the
// PTX ISA states it; a nearest-value search in double, independent of both; the NaN policy;
// the power-of-two scale from a tensor's amax.
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/dtype.h"

namespace dstrain {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

float from_hex(const std::string& hex) {
  return bits_float(static_cast<uint32_t>(std::stoul(hex, nullptr, 16)));
}

const nlohmann::json& tables() {
  static const nlohmann::json json = [] {
    std::ifstream file(std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/fp8_tables.json");
    return nlohmann::json::parse(file);
  }();
  return json;
}

// The OCP 8-bit floating point specification v1.0, table 1 (the formats' special values).
TEST(Fp8, TheSpecificationsSpecialValues) {
  const auto e4m3 = [](uint8_t bits) { return fp8_bits_to_fp32(bits, Fp8Format::kE4M3); };
  EXPECT_EQ(e4m3(0x7e), 448.0f);                                  // S.1111.110: max normal
  EXPECT_EQ(e4m3(0x08), std::ldexp(1.0f, -6));                    // S.0001.000: min normal
  EXPECT_EQ(e4m3(0x07), 0.875f * std::ldexp(1.0f, -6));           // S.0000.111: max subnormal
  EXPECT_EQ(e4m3(0x01), std::ldexp(1.0f, -9));                    // S.0000.001: min subnormal
  EXPECT_TRUE(std::isnan(e4m3(0x7f)) && std::isnan(e4m3(0xff)));  // S.1111.111: NaN
  EXPECT_EQ(e4m3(0x78), 256.0f);  // S.1111.000: a number, not infinity
  EXPECT_EQ(e4m3(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3(0x80)));
  const auto e5m2 = [](uint8_t bits) { return fp8_bits_to_fp32(bits, Fp8Format::kE5M2); };
  EXPECT_EQ(e5m2(0x7b), 57344.0f);                                // S.11110.11: max normal
  EXPECT_EQ(e5m2(0x04), std::ldexp(1.0f, -14));                   // S.00001.00: min normal
  EXPECT_EQ(e5m2(0x03), 0.75f * std::ldexp(1.0f, -14));           // S.00000.11: max subnormal
  EXPECT_EQ(e5m2(0x01), std::ldexp(1.0f, -16));                   // S.00000.01: min subnormal
  EXPECT_EQ(e5m2(0x7c), std::numeric_limits<float>::infinity());  // S.11111.00
  EXPECT_EQ(e5m2(0xfc), -std::numeric_limits<float>::infinity());
  for (uint8_t nan : {0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff}) EXPECT_TRUE(std::isnan(e5m2(nan)));
  EXPECT_EQ(fp8_layout(Fp8Format::kE4M3).max, 448.0f);
  EXPECT_EQ(fp8_layout(Fp8Format::kE5M2).max, 57344.0f);
}

TEST(Fp8, EveryByteDecodesAsMlDtypes) {
  for (Fp8Format format : kFormats) {
    const nlohmann::json& decode = tables()[fp8_name(format)]["decode"];
    ASSERT_EQ(decode.size(), 256u);
    for (int byte = 0; byte < 256; ++byte) {
      const float value = fp8_bits_to_fp32(static_cast<uint8_t>(byte), format);
      const std::string expected = decode[static_cast<size_t>(byte)];
      if (expected == "nan" || expected == "-nan") {
        EXPECT_TRUE(std::isnan(value)) << fp8_name(format) << " " << byte;
        EXPECT_EQ(std::signbit(value), expected == "-nan") << fp8_name(format) << " " << byte;
      } else {
        EXPECT_EQ(float_bits(value), float_bits(from_hex(expected)))
            << fp8_name(format) << " " << byte;
      }
    }
  }
}

// What satfinite gives where the non-saturating mode overflows (NaN from a number in E4M3,
// infinity in E5M2): the largest finite value of the input's sign.
int saturated(int non_saturating, float input, Fp8Format format) {
  const Fp8Layout f = fp8_layout(format);
  const int sign = std::signbit(input) ? 0x80 : 0;
  if (std::isnan(input)) return non_saturating;
  if ((non_saturating & 0x7f) == f.overflow) return sign | f.max_bits;
  return non_saturating;
}

TEST(Fp8, EncodingMatchesMlDtypesAndSatfiniteClampsItsOverflows) {
  for (Fp8Format format : kFormats) {
    const nlohmann::json& encode = tables()[fp8_name(format)]["encode"];
    ASSERT_GT(encode.size(), 9000u);
    size_t overflows = 0;
    for (const nlohmann::json& entry : encode) {
      const float input = from_hex(entry[0].get<std::string>());
      const uint8_t plain = fp32_to_fp8_bits(input, format, false);
      const uint8_t satfinite = fp32_to_fp8_bits(input, format, true);
      if (entry[1].is_string()) {  // NaN, of the sign given
        EXPECT_TRUE(std::isnan(fp8_bits_to_fp32(plain, format))) << entry.dump();
        EXPECT_EQ((plain & 0x80) != 0, entry[1] == "-nan") << entry.dump();
        if (!std::isnan(input)) {
          ++overflows;
          EXPECT_EQ(satfinite, saturated(plain, input, format)) << entry.dump();
        }
        continue;
      }
      const int expected = entry[1].get<int>();
      EXPECT_EQ(plain, expected) << fp8_name(format) << " " << entry.dump();
      EXPECT_EQ(satfinite, saturated(expected, input, format)) << entry.dump();
      if ((expected & 0x7f) == fp8_layout(format).overflow) ++overflows;
    }
    EXPECT_GT(overflows, 20u) << "the tables reach past the largest finite value";
  }
}

// The nearest FP8 value by a search in double over every finite value (ties: the even
// mantissa); beyond the largest finite value plus half its ulp (or at it, when the largest is
// odd): overflow.
uint8_t nearest_in_double(float input, Fp8Format format) {
  const Fp8Layout f = fp8_layout(format);
  const double x = std::fabs(static_cast<double>(input));
  int best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int byte = 0; byte <= f.max_bits; ++byte) {
    const double distance = std::fabs(fp8_bits_to_fp32(static_cast<uint8_t>(byte), format) - x);
    if (distance < best_distance || (distance == best_distance && (byte & 1) == 0)) {
      best = byte;
      best_distance = distance;
    }
  }
  const double max = f.max;
  const double ulp = max - fp8_bits_to_fp32(static_cast<uint8_t>(f.max_bits - 1), format);
  const bool odd_max = (f.max_bits & 1) != 0;
  if (x > max + ulp / 2 || (odd_max && x == max + ulp / 2)) best = f.overflow;
  return static_cast<uint8_t>((std::signbit(input) ? 0x80 : 0) | best);
}

TEST(Fp8, EncodingIsTheNearestValueFoundInDouble) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> log2_magnitude(-20.0, 18.0);
  for (Fp8Format format : kFormats) {
    for (int i = 0; i < 20000; ++i) {
      float input = static_cast<float>(std::exp2(log2_magnitude(rng)));
      if (i % 2) input = -input;
      ASSERT_EQ(fp32_to_fp8_bits(input, format, false), nearest_in_double(input, format))
          << fp8_name(format) << " " << input;
    }
  }
}

TEST(Fp8, EveryValueEncodesToItselfAndNaNsKeepTheirSign) {
  for (Fp8Format format : kFormats) {
    for (int byte = 0; byte < 256; ++byte) {
      const float value = fp8_bits_to_fp32(static_cast<uint8_t>(byte), format);
      if (!std::isfinite(value)) continue;
      EXPECT_EQ(fp32_to_fp8_bits(value, format, false), byte) << fp8_name(format);
      EXPECT_EQ(fp32_to_fp8_bits(value, format, true), byte) << fp8_name(format);
    }
  }
  const float quiet = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(fp32_to_fp8_bits(quiet, Fp8Format::kE4M3, true), 0x7f);
  EXPECT_EQ(fp32_to_fp8_bits(-quiet, Fp8Format::kE4M3, false), 0xff);
  // E5M2: a quiet NaN stays quiet (S.11111.1x, x the input's second mantissa bit).
  EXPECT_EQ(fp32_to_fp8_bits(quiet, Fp8Format::kE5M2, true), 0x7e);
  EXPECT_EQ(fp32_to_fp8_bits(bits_float(0xffe00000u), Fp8Format::kE5M2, false), 0xff);
  // Infinities: satfinite gives the largest finite value; otherwise E4M3 NaN, E5M2 infinity.
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp32_to_fp8_bits(inf, Fp8Format::kE4M3, true), 0x7e);
  EXPECT_EQ(fp32_to_fp8_bits(-inf, Fp8Format::kE4M3, false), 0xff);
  EXPECT_EQ(fp32_to_fp8_bits(-inf, Fp8Format::kE5M2, true), 0xfb);
  EXPECT_EQ(fp32_to_fp8_bits(inf, Fp8Format::kE5M2, false), 0x7c);
  // The edges of overflow: 464 ties to 448 (even), 61440 ties to 2^16 (overflow).
  EXPECT_EQ(fp32_to_fp8_bits(464.0f, Fp8Format::kE4M3, false), 0x7e);
  EXPECT_EQ(fp32_to_fp8_bits(std::nextafter(464.0f, 1e9f), Fp8Format::kE4M3, false), 0x7f);
  EXPECT_EQ(fp32_to_fp8_bits(61440.0f, Fp8Format::kE5M2, false), 0x7c);
  EXPECT_EQ(fp32_to_fp8_bits(std::nextafter(61440.0f, 0.0f), Fp8Format::kE5M2, false), 0x7b);
  // Half the smallest subnormal ties to zero; a little more is the smallest subnormal.
  EXPECT_EQ(fp32_to_fp8_bits(std::ldexp(1.0f, -10), Fp8Format::kE4M3, false), 0x00);
  EXPECT_EQ(fp32_to_fp8_bits(-std::ldexp(1.0f, -10), Fp8Format::kE4M3, false), 0x80);
  EXPECT_EQ(fp32_to_fp8_bits(std::ldexp(1.0001f, -10), Fp8Format::kE4M3, false), 0x01);
  EXPECT_EQ(fp32_to_fp8_bits(std::ldexp(3.0f, -17), Fp8Format::kE5M2, false), 0x02);  // 1.5 ties up
}

TEST(Fp8, TheScaleIsTheLargestPowerOfTwoThatFits) {
  for (Fp8Format format : kFormats) {
    const float max = fp8_layout(format).max;
    EXPECT_EQ(fp8_scale_for_amax(max, format), 1.0f);
    EXPECT_EQ(fp8_scale_for_amax(std::nextafter(max, 1e30f), format), 0.5f);
    EXPECT_EQ(fp8_scale_for_amax(0.0f, format), 1.0f);
    EXPECT_EQ(fp8_scale_for_amax(std::numeric_limits<float>::infinity(), format), 1.0f);
    EXPECT_EQ(fp8_scale_for_amax(std::numeric_limits<float>::quiet_NaN(), format), 1.0f);
    EXPECT_EQ(fp8_scale_for_amax(1e-45f, format), std::ldexp(1.0f, 126));
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> log2_amax(-40.0, 40.0);
    for (int i = 0; i < 5000; ++i) {
      const float amax = static_cast<float>(std::exp2(log2_amax(rng)));
      const float scale = fp8_scale_for_amax(amax, format);
      int exponent = 0;
      EXPECT_EQ(std::frexp(scale, &exponent), 0.5f) << "a power of two: " << scale;
      EXPECT_LE(static_cast<double>(amax) * scale, max) << amax;
      EXPECT_GT(static_cast<double>(amax) * scale * 2, max) << amax;
    }
  }
  EXPECT_EQ(fp8_scale_for_amax(1.0f, Fp8Format::kE4M3), 256.0f);  // 448 / 1: 2^8
  EXPECT_EQ(fp8_scale_for_amax(1.0f, Fp8Format::kE5M2), 32768.0f);
}

}  // namespace
}  // namespace dstrain
