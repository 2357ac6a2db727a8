// The arithmetic of the CUDA emulator's library shims: fp32 loads and round-to-nearest-even
// stores of F32/F16/BF16 elements (and loads of FP8 ones) (also NCCL's reductions, emu_nccl_calls.cpp), and the reference
// GEMM of emu_cublas.cpp and emu_cublaslt.cpp: operands widened to fp32 (exact for F16/BF16),
// products summed in fp32 in k order, then alpha * sum + beta * C + bias in fp32, rounded once to
// D's dtype -- what cuBLAS's fp32-compute GEMMs and cuBLASLt's BIAS epilogue do up to the order of
// the sum. Column-major, host memory (the emulator's device memory). Slow: for the small shapes
// of tests.
#pragma once

#include <cublas_api.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <vector>

namespace dstrain::emu {

// The storage types the shims compute with (the FP8 ones as cuBLASLt's FP8 GEMM operands only).
inline bool blas_type_supported(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16F || type == CUDA_R_16BF;
}
inline bool blas_type_fp8(cudaDataType type) {
  return type == CUDA_R_8F_E4M3 || type == CUDA_R_8F_E5M2;
}

inline float blas_load(const void* data, cudaDataType type, int64_t i) {
  switch (type) {
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(data)[i]);
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2:  // exact: every FP8 value is a half (the toolkit's own conversion)
      return __half2float(__half(__nv_cvt_fp8_to_halfraw(
          static_cast<const __nv_fp8_storage_t*>(data)[i],
          type == CUDA_R_8F_E4M3 ? __NV_E4M3 : __NV_E5M2)));
    default:
      return static_cast<const float*>(data)[i];
  }
}

// Rounds to nearest even, as the GPU's conversions do.
inline void blas_store(void* data, cudaDataType type, int64_t i, float value) {
  switch (type) {
    case CUDA_R_16F:
      static_cast<__half*>(data)[i] = __float2half_rn(value);
      break;
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value);
      break;
    default:
      static_cast<float*>(data)[i] = value;
  }
}

// A column-major matrix operand: element (row, col) at data[col * ld + row], or, when
// `transposed`, the operand is the transpose of that stored matrix.
struct BlasMatrix {
  const void* data;
  cudaDataType type;
  int64_t ld;
  bool transposed = false;
  float at(int64_t row, int64_t col) const {
    return blas_load(data, type, transposed ? row * ld + col : col * ld + row);
  }
};

// d (m,n) = alpha * op(a) (m,k) @ op(b) (k,n) + beta * c [+ bias (m), one value per row].
// beta == 0: c is not read (it may hold NaN), as in cuBLAS. c may be d (in place).
inline void reference_gemm(int64_t m, int64_t n, int64_t k, float alpha, const BlasMatrix& a,
                           const BlasMatrix& b, float beta, const BlasMatrix& c, void* d,
                           cudaDataType d_type, int64_t ldd, const BlasMatrix* bias) {
  std::vector<float> a_row(static_cast<size_t>(k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) a_row[p] = a.at(i, p);
    const float row_bias = bias ? blas_load(bias->data, bias->type, i) : 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t p = 0; p < k; ++p) sum += a_row[p] * b.at(p, j);
      float value = alpha * sum;
      if (beta != 0.0f) value += beta * c.at(i, j);
      if (bias) value += row_bias;
      blas_store(d, d_type, j * ldd + i, value);
    }
  }
}

}  // namespace dstrain::emu
