// Helpers shared by the topology tests.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "core/check.h"

namespace dstrain::testing {

inline std::string fixture_path(const std::string& name) {
  return std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/" + name;
}

inline std::string read_fixture(const std::string& name) {
  std::ifstream in(fixture_path(name), std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing fixture " << fixture_path(name);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs `body`, expects a UserError, and returns its message ("" when none was thrown).
inline std::string user_error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected UserError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected UserError, nothing was thrown";
  return "";
}

}  // namespace dstrain::testing
