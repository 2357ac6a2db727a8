// The shape of an attention test case, shared by the tensor-core attention tests
// (attention_mma_test.cpp, attention_mma_backward_test.cpp), and their random inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
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

// positions (B, T) with every row one sequence, 0..T-1: the case no positions stand for.
inline HostTensor counting_positions(int64_t B, int64_t T) {
  HostTensor t(DType::I32, {B, T});
  for (int64_t i = 0; i < B * T; ++i) t.i32()[i] = static_cast<int32_t>(i % T);
  return t;
}

// Row b of positions (B, T): sequences of the given lengths from the start, the last one cut at
// T or, where they end before T, one more sequence to T.
inline void set_sequences(HostTensor& positions, int64_t b, const std::vector<int64_t>& lengths) {
  const int64_t T = positions.shape()[1];
  int64_t t = 0;
  for (int64_t length : lengths) {
    for (int64_t p = 0; p < length && t < T; ++p)
      positions.i32()[b * T + t++] = static_cast<int32_t>(p);
  }
  for (int64_t p = 0; t < T; ++p) positions.i32()[b * T + t++] = static_cast<int32_t>(p);
}

// positions (3, T) of packed sequences (kernels/ops.h) that meet the mma tiles (16 to 128 rows or
// keys) every way. Row 0: random sequences of 1 to 24 tokens (random_positions): many tiles
// wholly before a row's sequence or after a key's. Row 1: sequences of 1, 1, 61, 5, 59 and 80
// tokens, then one to T: single tokens, a sequence longer than any tile, sequences that start
// on the last key of a 64- and a 128-key block (63, 127) and go on into the next query tile,
// and rows 64-79 (a warp's 16 rows) whose starts lie in two key tiles: rows 68-79 see nothing of
// the first (their running max stays -inf there). Row 2: one sequence (0..T-1).
inline HostTensor packed_positions(Random& rng, int64_t T) {
  HostTensor positions = random_positions(rng, 3, T, 12);
  set_sequences(positions, 1, {1, 1, 61, 5, 59, 80});
  set_sequences(positions, 2, {});
  return positions;
}

// Columns [first, first + count) of every head of lse (1, NH, T): (1, NH, count), the part of a
// packed row's that belongs to one sequence.
inline HostTensor column_slice(const HostTensor& lse, int64_t first, int64_t count) {
  const std::vector<int64_t> dims = lse.shape();
  const int64_t heads = dims[1], T = dims[2], element = dtype_size(lse.dtype());
  HostTensor slice(lse.dtype(), {1, heads, count});
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(static_cast<char*>(slice.t().data) + h * count * element,
                static_cast<const char*>(lse.t().data) + (h * T + first) * element,
                static_cast<size_t>(count * element));
  }
  return slice;
}

// Rows [first, first + count) of a (1, T, width) tensor: (1, count, width). Of qkv, out, dout,
// dqkv: the part of a packed row that belongs to one sequence.
inline HostTensor row_slice(const HostTensor& t, int64_t first, int64_t count) {
  const std::vector<int64_t> dims = t.shape();
  const int64_t width = dims[2], element = dtype_size(t.dtype());
  HostTensor slice(t.dtype(), {1, count, width});
  std::memcpy(slice.t().data, static_cast<const char*>(t.t().data) + first * width * element,
              static_cast<size_t>(count * width * element));
  return slice;
}

// A copy of t, (1, T, width) (qkv, out, dout), with NaN in rows [first, first + count): the
// tokens of one sequence of a packed row poisoned.
inline HostTensor with_nan_rows(const HostTensor& t, int64_t first, int64_t count) {
  HostTensor copy = t.clone();
  const int64_t width = t.shape()[2];
  for (int64_t k = first * width; k < (first + count) * width; ++k) copy.set(k, std::nan(""));
  return copy;
}

// A copy of lse (1, NH, T) with NaN in columns [first, first + count) of every head.
inline HostTensor with_nan_columns(const HostTensor& lse, int64_t first, int64_t count) {
  HostTensor copy = lse.clone();
  const std::vector<int64_t> dims = lse.shape();
  for (int64_t h = 0; h < dims[1]; ++h) {
    for (int64_t t = first; t < first + count; ++t) copy.set(h * dims[2] + t, std::nan(""));
  }
  return copy;
}

}  // namespace dstrain::test
