// Reading the committed reference fixtures (tests/reference/): whole files and llm.c token
// shards.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace dstrain::test {

inline std::string slurp(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  EXPECT_TRUE(file.good()) << path;
  return std::string(std::istreambuf_iterator<char>(file), {});
}

// An llm.c uint16 shard: 256 int32 header (magic, version, count), then the tokens.
inline std::vector<int32_t> read_llmc_u16(const std::string& path) {
  const std::string bytes = slurp(path);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  std::vector<int32_t> tokens(static_cast<size_t>(header[2]));
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint16_t token;
    std::memcpy(&token, bytes.data() + 1024 + 2 * i, 2);
    tokens[i] = token;
  }
  return tokens;
}

}  // namespace dstrain::test
