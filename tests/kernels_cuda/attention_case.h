// The shape of an attention test case, shared by the tensor-core attention tests
// (attention_mma_test.cpp, attention_mma_backward_test.cpp), and their random inputs.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_test_util.h"

namespace dstrain::test {

struct AttentionCase {
  int64_t B, T, NH, KV, hd;
  int64_t C() const { return NH * hd; }             // an out row
  int64_t W() const { return (NH + 2 * KV) * hd; }  // a qkv row
  int nh() const { return static_cast<int>(NH); }
  int kv() const { return static_cast<int>(KV); }
};

// Values of magnitude in [lo, hi) and random sign: never zero.
inline HostTensor nonzero_tensor(Random& rng, DType dtype, const std::vector<int64_t>& dims,
                                 double lo, double hi) {
  HostTensor t(dtype, dims);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double magnitude = rng.uniform(lo, hi);
    t.set(i, rng.uniform(0.0, 1.0) < 0.5 ? -magnitude : magnitude);
  }
  return t;
}

}  // namespace dstrain::test
