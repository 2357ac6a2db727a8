// Shape and dtype checks of the FP8 ops (kernels/ops.h: fp8_quantize, matmul_fp8), written once
// for every backend. Throw dstrain::Error.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/fp8.h"
#include "core/tensor.h"
#include "kernels/op_checks.h"

namespace dstrain {

// fp8_quantize: inp (R, C) float, out F8 of inp's shape and/or out_t F8 (C, R), at least one,
// of one format; scale_inv (1) F32; amax empty or (1) F32. Returns (R, C).
inline RowShape check_fp8_quantize(const Tensor& out, const Tensor& out_t, const Tensor& scale_inv,
                                   const Tensor& inp, const Tensor& amax) {
  DSTRAIN_CHECK(amax.empty() || (amax.dtype == DType::F32 && amax.numel() == 1))
      << "fp8_quantize amax " << amax.shape_str() << " must be empty or one F32";
  DSTRAIN_CHECK(inp.dtype == DType::F32 || inp.dtype == DType::F16 || inp.dtype == DType::BF16)
      << "fp8_quantize inp must be F32, F16 or BF16, not " << dtype_name(inp.dtype);
  DSTRAIN_CHECK(!out.empty() || !out_t.empty()) << "fp8_quantize needs out, out_t or both";
  for (const Tensor* copy : {&out, &out_t}) {
    DSTRAIN_CHECK(copy->empty() || is_fp8(copy->dtype))
        << "fp8_quantize out must be F8E4M3 or F8E5M2, not " << dtype_name(copy->dtype);
  }
  DSTRAIN_CHECK(out.empty() || out_t.empty() || out.dtype == out_t.dtype)
      << "fp8_quantize out " << dtype_name(out.dtype) << " and out_t " << dtype_name(out_t.dtype)
      << " must be one format";
  DSTRAIN_CHECK(scale_inv.dtype == DType::F32 && scale_inv.numel() == 1)
      << "fp8_quantize scale_inv " << scale_inv.shape_str() << " must be one F32";
  const RowShape s = row_shape(inp);
  DSTRAIN_CHECK(out.empty() || same_rows(out, inp))
      << "fp8_quantize out " << out.shape_str() << " must be inp's shape, inp " << inp.shape_str();
  const RowShape t = out_t.empty() ? RowShape{} : row_shape(out_t);
  DSTRAIN_CHECK(out_t.empty() || (t.rows == s.cols && t.cols == s.rows && out_t.ndim == 2))
      << "fp8_quantize out_t " << out_t.shape_str() << " must be inp's transpose, inp "
      << inp.shape_str();
  return s;
}

// fp8_amax: amax (1) F32, inp float.
inline void check_fp8_amax(const Tensor& amax, const Tensor& inp) {
  DSTRAIN_CHECK(inp.dtype == DType::F32 || inp.dtype == DType::F16 || inp.dtype == DType::BF16)
      << "fp8_amax inp must be F32, F16 or BF16, not " << dtype_name(inp.dtype);
  DSTRAIN_CHECK(amax.dtype == DType::F32 && amax.numel() == 1)
      << "fp8_amax amax " << amax.shape_str() << " must be one F32";
}

struct Fp8MatmulShape {
  int64_t M, N, K;
};

// matmul_fp8: a (M, K), b (N, K) F8 not both E5M2, out (M, N) float, scale_invs one F32 each,
// bias empty or (N) and not with `accumulate`, K and N multiples of 16.
inline Fp8MatmulShape check_matmul_fp8(const Tensor& out, const Tensor& a,
                                       const Tensor& a_scale_inv, const Tensor& b,
                                       const Tensor& b_scale_inv, const Tensor& bias,
                                       bool accumulate) {
  DSTRAIN_CHECK(is_fp8(a.dtype) && is_fp8(b.dtype) &&
                !(a.dtype == DType::F8E5M2 && b.dtype == DType::F8E5M2))
      << "matmul_fp8 takes F8E4M3 x F8E4M3, F8E4M3 x F8E5M2 or F8E5M2 x F8E4M3, not "
      << dtype_name(a.dtype) << " x " << dtype_name(b.dtype);
  DSTRAIN_CHECK(out.dtype == DType::F32 || out.dtype == DType::F16 || out.dtype == DType::BF16)
      << "matmul_fp8 out must be F32, F16 or BF16, not " << dtype_name(out.dtype);
  for (const Tensor* scale : {&a_scale_inv, &b_scale_inv}) {
    DSTRAIN_CHECK(scale->dtype == DType::F32 && scale->numel() == 1)
        << "matmul_fp8 scale_inv " << scale->shape_str() << " must be one F32";
  }
  const RowShape as = row_shape(a), bs = row_shape(b), os = row_shape(out);
  DSTRAIN_CHECK(as.cols == bs.cols && os.rows == as.rows && os.cols == bs.rows && b.ndim == 2)
      << "matmul_fp8 a " << a.shape_str() << " (M, K), b " << b.shape_str() << " (N, K) and out "
      << out.shape_str() << " (M, N) do not match";
  DSTRAIN_CHECK(as.cols % 16 == 0 && bs.rows % 16 == 0)
      << "matmul_fp8 needs K and N multiples of 16, not K " << as.cols << ", N " << bs.rows;
  DSTRAIN_CHECK(bias.numel() == 0 ||
                (bias.numel() == bs.rows && bias.dtype == out.dtype && !accumulate))
      << "matmul_fp8 bias " << bias.shape_str() << " must be empty or (" << bs.rows
      << ") of out's dtype, without accumulate";
  return {as.rows, bs.rows, as.cols};
}

}  // namespace dstrain
