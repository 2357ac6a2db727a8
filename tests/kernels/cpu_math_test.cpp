// The CPU kernels' vectorizable float math (kernels/cpu/cpu_math.h) against double: every 61st
// float of the domain (about 35 million of tanh's, 18 million of exp's, both signs), in units
// in the last place of the float nearest the true value; and the special values.
#include "kernels/cpu/cpu_math.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>

namespace dstrain::cpu {
namespace {

// |got - want| in units of the last place of float(want).
double ulps(float got, double want) {
  const float nearest = static_cast<float>(want);
  const double ulp = std::nextafter(std::fabs(nearest), std::numeric_limits<float>::infinity()) -
                     std::fabs(nearest);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

TEST(CpuMath, TanhIsWithinOneAndAHalfUlpOfEveryFloat) {
  double worst = 0;
  float worst_at = 0;
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 61) {
    const float x = std::bit_cast<float>(bits);
    for (const float v : {x, -x}) {
      const double error = ulps(tanh_fast(v), std::tanh(static_cast<double>(v)));
      if (error > worst) worst = error, worst_at = v;
    }
  }
  std::cout << "  tanh_fast: largest error " << worst << " ulp, at " << worst_at << "\n";
  EXPECT_LE(worst, 1.5) << worst_at;
}

TEST(CpuMath, TanhOfSpecialValues) {
  EXPECT_EQ(std::bit_cast<uint32_t>(tanh_fast(0.0f)), 0u);
  EXPECT_EQ(std::bit_cast<uint32_t>(tanh_fast(-0.0f)), 0x80000000u);
  EXPECT_EQ(tanh_fast(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(tanh_fast(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_EQ(tanh_fast(std::numeric_limits<float>::max()), 1.0f);
  EXPECT_EQ(tanh_fast(-9.5f), -1.0f);
  EXPECT_TRUE(std::isnan(tanh_fast(std::numeric_limits<float>::quiet_NaN())));
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(tanh_fast(tiny), tiny);
  EXPECT_EQ(tanh_fast(-1e-20f), -1e-20f);
}

TEST(CpuMath, ExpIsWithinOneAndAHalfUlpOnItsDomain) {
  double worst = 0;
  float worst_at = 0;
  const uint32_t end = std::bit_cast<uint32_t>(19.0f);
  for (uint32_t bits = 0; bits <= end; bits += 61) {
    const float y = std::bit_cast<float>(bits);
    const double error = ulps(exp_0_19(y), std::exp(static_cast<double>(y)));
    if (error > worst) worst = error, worst_at = y;
  }
  EXPECT_EQ(exp_0_19(0.0f), 1.0f);
  std::cout << "  exp_0_19: largest error " << worst << " ulp, at " << worst_at << "\n";
  EXPECT_LE(worst, 1.5) << worst_at;
}

}  // namespace
}  // namespace dstrain::cpu
