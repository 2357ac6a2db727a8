#include "core/format.h"

#include <cstdio>

namespace dstrain {

std::string format_rate(double tokens_per_second) {
  char text[32];
  if (tokens_per_second >= 1e6)
    std::snprintf(text, sizeof text, "%.2fM", tokens_per_second / 1e6);
  else if (tokens_per_second >= 1e3)
    std::snprintf(text, sizeof text, "%.1fk", tokens_per_second / 1e3);
  else
    std::snprintf(text, sizeof text, "%.0f", tokens_per_second);
  return text;
}

}  // namespace dstrain
