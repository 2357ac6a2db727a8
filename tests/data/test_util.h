// Helpers shared by the data tests: a scratch directory and a UserError expectation.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/check.h"
#include "tests/common/temp_dir.h"

namespace dstrain::testing {

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace dstrain::testing

// Expects `statement` to throw dstrain::UserError whose message contains every listed piece.
#define EXPECT_USER_ERROR(statement, ...)                                              \
  do {                                                                                 \
    try {                                                                              \
      statement;                                                                       \
      ADD_FAILURE() << "expected a UserError from: " #statement;                       \
    } catch (const ::dstrain::UserError& error) {                                      \
      const std::string message = error.what();                                        \
      for (const std::string& piece : std::initializer_list<std::string>{__VA_ARGS__})   \
        EXPECT_NE(message.find(piece), std::string::npos)                              \
            << "message \"" << message << "\" lacks \"" << piece << "\"";               \
    }                                                                                  \
  } while (0)
