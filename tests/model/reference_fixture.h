// Reading the committed reference fixtures (tests/reference/): whole files, llm.c token
// shards, and a fixture's gradients against a model's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "model/layout.h"
#include "model/param_provider.h"

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

// Every gradient tensor in `params` against the fixture file `path` (grads0.safetensors, the
// layout's tensors by name, file shapes): the normalized error mse(ours, ref) / mse(ref, 0)
// below 1e-10, and every element within 1e-6 + 1e-4 * max|ref|.
// `buffers`: tensors the model reads but never trains (DeepSeek-V3's selection bias): the file
// has no gradient for them and ours must be exactly zero.
inline void expect_gradients_match_fixture(const ParamLayout& layout, ParamProvider& params,
                                           const std::string& path,
                                           const std::set<std::string>& buffers = {}) {
  const SafetensorsFile grads = SafetensorsFile::open(path);
  ASSERT_EQ(grads.names().size(), layout.params().size() - buffers.size());
  for (const ParamSpec& spec : layout.params()) {
    const float* ours = ParamLayout::view(spec, params.acquire_grads(spec.block)).f32();
    if (buffers.count(spec.name)) {
      for (int64_t i = 0; i < spec.numel(); ++i) ASSERT_EQ(ours[i], 0.0f) << spec.name;
      continue;
    }
    const std::vector<float> ref = grads.read_f32(spec.name);
    ASSERT_EQ(static_cast<int64_t>(ref.size()), spec.file_numel()) << spec.name;
    double error = 0.0, norm = 0.0, max_error = 0.0, max_ref = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double diff = double(ours[i]) - ref[i];
      error += diff * diff;
      norm += double(ref[i]) * ref[i];
      max_error = std::max(max_error, std::abs(diff));
      max_ref = std::max(max_ref, std::abs(double(ref[i])));
    }
    ASSERT_GT(norm, 0.0) << spec.name << ": the reference gradient is all zeros";
    EXPECT_LT(error / norm, 1e-10) << spec.name;
    EXPECT_LT(max_error, 1e-6 + 1e-4 * max_ref) << spec.name;
  }
}

}  // namespace dstrain::test
