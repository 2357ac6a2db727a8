// Numbers as the command line prints them.
#pragma once

#include <string>

namespace dstrain {

// Tokens per second, three significant figures at most: "812", "41.7k", "1.25M".
std::string format_rate(double tokens_per_second);

}  // namespace dstrain
