// Shape checks of the row ops, written once for every backend (the ggml habit: an op's shapes
// are checked where the op is defined, not again in each backend). A backend adds its own
// device and dtype checks; these look only at shapes and scalar arguments. The qkv ops
// (attention, rope) have theirs in kernels/qkv_checks.h. Throw dstrain::Error.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"

namespace dstrain {

// A tensor seen as (rows, cols), cols = its last dimension (row ops accept any leading dims).
struct RowShape {
  int64_t rows, cols;
};

inline RowShape row_shape(const Tensor& t) {
  const int64_t cols = t.ndim == 0 ? 1 : t.shape[t.ndim - 1];
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

inline bool same_rows(const Tensor& a, const Tensor& b) {
  const RowShape x = row_shape(a), y = row_shape(b);
  return x.rows == y.rows && x.cols == y.cols;
}

// The residual add fused into a norm (residual_layernorm_forward, residual_rmsnorm_forward):
// residual, a, b alike (N,C).
inline void check_residual_shapes(const Tensor& residual, const Tensor& a, const Tensor& b) {
  DSTRAIN_CHECK(same_rows(residual, a) && same_rows(b, a))
      << "residual " << residual.shape_str() << ", a " << a.shape_str() << " and b "
      << b.shape_str() << " must have the same rows";
}

// rmsnorm_forward: inp (N,C) with C > 0, out like inp, rstd (N), weight (C), eps >= 0 finite.
// Returns (N, C).
inline RowShape check_rmsnorm_shapes(const Tensor& out, const Tensor& rstd, const Tensor& inp,
                                     const Tensor& weight, float eps) {
  const RowShape s = row_shape(inp);
  DSTRAIN_CHECK(s.cols > 0) << "rmsnorm inp " << inp.shape_str() << " must be (N, C) with C > 0";
  DSTRAIN_CHECK(same_rows(out, inp))
      << "rmsnorm out " << out.shape_str() << " must match inp " << inp.shape_str();
  DSTRAIN_CHECK(rstd.numel() == s.rows)
      << "rmsnorm rstd " << rstd.shape_str() << " must have " << s.rows << " elements";
  DSTRAIN_CHECK(weight.numel() == s.cols)
      << "rmsnorm weight " << weight.shape_str() << " must have " << s.cols << " elements";
  DSTRAIN_CHECK(std::isfinite(eps) && eps >= 0.0f) << "rmsnorm eps " << eps << " must be >= 0";
  return s;
}

// rmsnorm_backward: the forward's shapes (inp, weight, rstd), dinp and dout like inp,
// dweight like weight. Returns (N, C).
inline RowShape check_rmsnorm_backward_shapes(const Tensor& dinp, const Tensor& dweight,
                                              const Tensor& dout, const Tensor& inp,
                                              const Tensor& weight, const Tensor& rstd) {
  const RowShape s = check_rmsnorm_shapes(inp, rstd, inp, weight, 0.0f);
  DSTRAIN_CHECK(same_rows(dinp, inp) && same_rows(dout, inp))
      << "rmsnorm dinp " << dinp.shape_str() << " and dout " << dout.shape_str()
      << " must match inp " << inp.shape_str();
  DSTRAIN_CHECK(dweight.numel() == s.cols)
      << "rmsnorm dweight " << dweight.shape_str() << " must have " << s.cols << " elements";
  return s;
}

// swiglu_forward: inp (N, 2I) with I > 0, out (N, I). Returns (N, I).
inline RowShape check_swiglu_shapes(const Tensor& out, const Tensor& inp) {
  const RowShape in = row_shape(inp), o = row_shape(out);
  DSTRAIN_CHECK(o.cols > 0 && in.cols == 2 * o.cols && in.rows == o.rows)
      << "swiglu inp " << inp.shape_str() << " must be (N, 2I) = [gate | up] for out "
      << out.shape_str() << " (N, I), I > 0";
  return o;
}

// An op's optional amax output (kernels/ops.h swiglu_forward): empty or one F32.
inline void check_amax_output(const Tensor& amax, const char* op) {
  DSTRAIN_CHECK(amax.empty() || (amax.dtype == DType::F32 && amax.numel() == 1))
      << op << " amax " << amax.shape_str() << " must be empty or one F32";
}

// swiglu_backward: dinp like inp (N, 2I), dout like out (N, I). Returns (N, I).
inline RowShape check_swiglu_backward_shapes(const Tensor& dinp, const Tensor& dout,
                                             const Tensor& inp) {
  const RowShape s = check_swiglu_shapes(dout, inp);
  DSTRAIN_CHECK(same_rows(dinp, inp))
      << "swiglu dinp " << dinp.shape_str() << " must match inp " << inp.shape_str();
  return s;
}

}  // namespace dstrain
