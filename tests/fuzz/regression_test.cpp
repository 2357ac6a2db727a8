// Every committed input of tests/fuzz/corpus/<format>/ (the seeds: real files) and
// tests/fuzz/regressions/<format>/ (what the fuzzers found, fixed since) through the fuzz entry
// of that format: each parses or is refused with dstrain's user error (fuzz_entries.h), in
// every build, sanitized or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_entries.h"

namespace dstrain::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = fs::path(DSTRAIN_SOURCE_DIR) / "tests/fuzz";

// The inputs of `format` under tests/fuzz/<kind>/ (READMEs are not inputs), sorted.
std::vector<fs::path> inputs_of(const std::string& kind, const std::string& format) {
  std::vector<fs::path> files;
  const fs::path dir = kFuzzDir / kind / format;
  if (!fs::is_directory(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().filename() != "README.md") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

// The number of inputs run; each failure names its file.
size_t run_inputs(const FuzzEntry& entry, const std::string& kind) {
  const std::vector<fs::path> files = inputs_of(kind, entry.name);
  for (const fs::path& file : files) {
    const std::vector<uint8_t> bytes = read_bytes(file);
    try {
      entry.run(bytes);
    } catch (const std::exception& error) {
      ADD_FAILURE() << file.string() << " neither parsed nor was refused with a UserError: "
                    << error.what();
    }
  }
  return files.size();
}

class FuzzInputs : public ::testing::TestWithParam<FuzzEntry> {};

TEST_P(FuzzInputs, SeedCorpusParsesOrIsRefused) {
  // Every format has real files to start from.
  EXPECT_GT(run_inputs(GetParam(), "corpus"), 0u) << "no seeds in tests/fuzz/corpus/"
                                                  << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(Formats, FuzzInputs, ::testing::ValuesIn(fuzz_entries()),
                         [](const ::testing::TestParamInfo<FuzzEntry>& info) {
                           return info.param.name;
                         });

// What the fuzzers found (tests/fuzz/regressions/README.md), every format's, all still fixed.
TEST(FuzzFindings, StayFixed) {
  size_t count = 0;
  for (const FuzzEntry& entry : fuzz_entries()) count += run_inputs(entry, "regressions");
  EXPECT_GE(count, 4u) << "the four findings of the first runs are committed inputs";
}

}  // namespace
}  // namespace dstrain::fuzz
