// Helpers shared by the data tests: a scratch directory and a UserError expectation.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/check.h"

namespace dstrain::testing {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string test = info ? std::string(info->test_suite_name()) + "_" + info->name()
                                  : std::string("none");
    path_ = std::filesystem::temp_directory_path() /
            ("dstrain_data_" + test + "_" + std::to_string(::getpid()) + "_" +
             std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }
  size_t entry_count() const {
    size_t n = 0;
    for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(path_)) ++n;
    return n;
  }

 private:
  std::filesystem::path path_;
};

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
