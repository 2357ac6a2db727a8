// What the benchmark programs share. The main of a benchmark program: a user's mistake (a bad flag) is one line and exit 2, an
// internal error one line and exit 1, like dstrain itself.
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"

namespace dstrain {

template <class Body>
int benchmark_main(const char* program, Body&& body) {
  try {
    body();
  } catch (const UserError& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", program, e.what());
    return 1;
  }
  return 0;
}

// The items of a comma-separated flag value ("fp16,bf16"), empty ones dropped.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// A flag's integer value, at least `min`; UserError naming the flag otherwise.
inline int64_t parse_int(const std::string& flag, const std::string& text, int64_t min) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DSTRAIN_USER_CHECK(used == text.size() && !text.empty() && value >= min)
      << flag << " takes an integer of at least " << min << ", not '" << text << "'";
  return value;
}

}  // namespace dstrain
