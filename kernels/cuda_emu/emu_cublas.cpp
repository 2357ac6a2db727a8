// cuBLAS as the CUDA emulator provides it: the handle functions and cublasGemmEx, with the
// toolkit's own declarations (cublas_api.h), on host memory. The GEMM is a reference loop:
// operands widened to fp32 (exact for F16/BF16), products and sums in fp32 in k order, then
// alpha * sum + beta * C in fp32, rounded once to C's dtype -- what cuBLAS's fp32-compute GEMMs
// do up to the order of the sum. Slow, and meant for the small shapes of tests.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

std::atomic<uintptr_t> g_next_handle{1};

bool supported(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16F || type == CUDA_R_16BF;
}

float load(const void* data, cudaDataType type, int64_t i) {
  switch (type) {
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(data)[i]);
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

void store(void* data, cudaDataType type, int64_t i, float value) {
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

// The statuses the emulated cuBLAS returns, with cuBLAS's names and sentences.
struct StatusText {
  cublasStatus_t status;
  const char* name;
  const char* text;
};
constexpr StatusText kStatuses[] = {
    {CUBLAS_STATUS_SUCCESS, "CUBLAS_STATUS_SUCCESS", "success"},
    {CUBLAS_STATUS_NOT_INITIALIZED, "CUBLAS_STATUS_NOT_INITIALIZED",
     "the library was not initialized"},
    {CUBLAS_STATUS_INVALID_VALUE, "CUBLAS_STATUS_INVALID_VALUE",
     "an invalid numeric value was used as an argument"},
    {CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_STATUS_NOT_SUPPORTED",
     "the functionality requested is not supported"},
};
const StatusText& describe(cublasStatus_t status) {
  static constexpr StatusText kUnknown{CUBLAS_STATUS_INTERNAL_ERROR, "CUBLAS_STATUS_UNKNOWN",
                                       "unknown error"};
  for (const StatusText& s : kStatuses) {
    if (s.status == status) return s;
  }
  return kUnknown;
}

}  // namespace

extern "C" {

cublasStatus_t CUBLASWINAPI cublasCreate(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = reinterpret_cast<cublasHandle_t>(g_next_handle.fetch_add(1));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasDestroy(cublasHandle_t handle) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t CUBLASWINAPI cublasSetStream(cublasHandle_t handle, cudaStream_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t CUBLASWINAPI cublasSetWorkspace(cublasHandle_t handle, void*, size_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t CUBLASWINAPI cublasSetMathMode(cublasHandle_t handle, cublasMath_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* CUBLASWINAPI cublasGetStatusName(cublasStatus_t status) {
  return describe(status).name;
}
const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  return describe(status).text;
}

// C (m,n) = alpha * op(A) (m,k) @ op(B) (k,n) + beta * C, column-major.
cublasStatus_t CUBLASWINAPI cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const void* alpha, const void* A, cudaDataType Atype,
                                         int lda, const void* B, cudaDataType Btype, int ldb,
                                         const void* beta, void* C, cudaDataType Ctype, int ldc,
                                         cublasComputeType_t computeType, cublasGemmAlgo_t) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (computeType != CUBLAS_COMPUTE_32F || !supported(Atype) || !supported(Btype) ||
      !supported(Ctype) || Atype != Btype || (Ctype != Atype && Ctype != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return CUBLAS_STATUS_INVALID_VALUE;
  const float a_scale = *static_cast<const float*>(alpha);
  const float c_scale = *static_cast<const float*>(beta);
  std::vector<float> a_row(static_cast<size_t>(k));
  for (int i = 0; i < m; ++i) {
    for (int p = 0; p < k; ++p) {
      a_row[p] = load(A, Atype, ta ? int64_t{i} * lda + p : int64_t{p} * lda + i);
    }
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int p = 0; p < k; ++p) {
        sum += a_row[p] * load(B, Btype, tb ? int64_t{p} * ldb + j : int64_t{j} * ldb + p);
      }
      const int64_t c = int64_t{j} * ldc + i;
      // beta == 0: C is not read (it may hold NaN), as in cuBLAS.
      const float old = c_scale == 0.0f ? 0.0f : c_scale * load(C, Ctype, c);
      store(C, Ctype, c, a_scale * sum + old);
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
