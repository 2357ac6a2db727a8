// The main of a benchmark program: a user's mistake (a bad flag) is one line and exit 2, an
// internal error one line and exit 1, like dstrain itself.
#pragma once

#include <cstdio>
#include <exception>

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

}  // namespace dstrain
