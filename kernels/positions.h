// The positions of packed sequences (kernels/ops.h, "positions"), written once for every
// backend: the shape check, the check of the values a host can read, and the lookup.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"

namespace dstrain {

// positions: empty, or (B,T) I32 (any device). Throws dstrain::Error otherwise.
inline void check_positions_shape(const Tensor& positions, int64_t B, int64_t T, const char* op) {
  if (positions.empty()) return;
  DSTRAIN_CHECK(positions.dtype == DType::I32 && positions.numel() == B * T)
      << op << " positions " << positions.shape_str() << " must be (" << B << ", " << T
      << ") I32 or empty";
}

// Host memory: each row starts a sequence at 0, and each position is 0 or the one before + 1.
inline void check_positions_values(const int32_t* positions, int64_t B, int64_t T, const char* op) {
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = positions + b * T;
    for (int64_t t = 0; t < T; ++t) {
      DSTRAIN_CHECK(row[t] == 0 || (t > 0 && row[t] == row[t - 1] + 1))
          << op << " positions[" << b << ", " << t << "] = " << row[t] << " after "
          << (t > 0 ? row[t - 1] : -1) << ": a sequence starts at 0 and counts up by 1";
    }
  }
}

// The position of token t of row b: positions[b,t], or t without positions.
inline int64_t position_at(const int32_t* positions, int64_t b, int64_t t, int64_t T) {
  return positions != nullptr ? positions[b * T + t] : t;
}

// CPU backend: the checked positions' data, or nullptr when empty.
inline const int32_t* checked_host_positions(const Tensor& positions, int64_t B, int64_t T,
                                             const char* op) {
  check_positions_shape(positions, B, T, op);
  if (positions.empty()) return nullptr;
  const int32_t* data = static_cast<const int32_t*>(positions.data);
  check_positions_values(data, B, T, op);
  return data;
}

}  // namespace dstrain
