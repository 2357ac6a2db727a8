#include "core/fp8.h"

#include <algorithm>
#include <cmath>

namespace dstrain {

const char* fp8_name(Fp8Format format) { return format == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

float fp8_scale_for_amax(float amax, Fp8Format format) {
  const float max = fp8_layout(format).max;
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  // 2^floor(log2(max / amax)), from the exponents (no division to round): then one step down
  // where amax's significand is above max's.
  int max_exponent = 0, amax_exponent = 0;
  const float max_significand = std::frexp(max, &max_exponent);
  const float amax_significand = std::frexp(amax, &amax_exponent);
  int power = max_exponent - amax_exponent - (amax_significand > max_significand ? 1 : 0);
  power = std::min(power, 126);
  return std::ldexp(1.0f, power);
}

}  // namespace dstrain
