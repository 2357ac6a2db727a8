// Numbers as the command line prints them.
#pragma once

#include <string>

namespace dstrain {

// Tokens per second, three significant figures at most: "812", "41.7k", "1.25M".
std::string format_rate(double tokens_per_second);

// A count and its noun: "1 step", "2 steps" (`plural`: when not noun + "s").
std::string count_of(long long count, const std::string& noun, const std::string& plural = "");

}  // namespace dstrain
