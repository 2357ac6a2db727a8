// The shape of an attention test case, shared by the tensor-core attention tests
// (attention_mma_test.cpp, attention_mma_backward_test.cpp).
#pragma once

#include <cstdint>

namespace dstrain::test {

struct AttentionCase {
  int64_t B, T, NH, KV, hd;
  int64_t C() const { return NH * hd; }             // an out row
  int64_t W() const { return (NH + 2 * KV) * hd; }  // a qkv row
  int nh() const { return static_cast<int>(NH); }
  int kv() const { return static_cast<int>(KV); }
};

}  // namespace dstrain::test
