// A user's mistake as a library call reports it: a UserError of one line naming a path.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/check.h"

namespace dstrain::testing {

// Runs `action`, requires a UserError of one line whose message names `path`; returns it.
template <class Action>
std::string expect_user_error_naming(const std::filesystem::path& path, Action action) {
  try {
    action();
    ADD_FAILURE() << "no error for " << path;
  } catch (const UserError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(path.string()), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "not a UserError: " << error.what();
  }
  return "";
}

// The UserError message of `action`, or "" when it throws none.
template <class Action>
std::string user_error_of(Action action) {
  try {
    action();
  } catch (const UserError& error) {
    return std::string(error.what());
  }
  return std::string();
}

}  // namespace dstrain::testing
