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

std::string count_of(long long count, const std::string& noun, const std::string& plural) {
  return std::to_string(count) + " " +
         (count == 1 ? noun : plural.empty() ? noun + "s" : plural);
}

}  // namespace dstrain
