// cuBLAS as the CUDA emulator provides it: the handle functions and cublasGemmEx, with the
// toolkit's own declarations (cublas_api.h), on host memory. The GEMM is emu_blas.h's reference,
// queued on the handle's stream. Slow, and meant for the small shapes of tests.
#include <cublas_v2.h>

#include <cstdint>

#include "kernels/cuda_emu/emu_blas.h"
#include "kernels/cuda_emu/emu_runtime.h"

namespace {

using dstrain::emu::blas_type_supported;

// A handle: the stream its calls are queued on.
struct Handle {
  cudaStream_t stream = nullptr;
};

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
  *handle = reinterpret_cast<cublasHandle_t>(new Handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasDestroy(cublasHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete reinterpret_cast<Handle*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  reinterpret_cast<Handle*>(handle)->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
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
  if (computeType != CUBLAS_COMPUTE_32F || !blas_type_supported(Atype) ||
      !blas_type_supported(Btype) || !blas_type_supported(Ctype) || Atype != Btype ||
      (Ctype != Atype && Ctype != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return CUBLAS_STATUS_INVALID_VALUE;
  // Host pointer mode: alpha and beta are read now; the GEMM runs when the stream reaches it.
  const float a_scale = *static_cast<const float*>(alpha);
  const float c_scale = *static_cast<const float*>(beta);
  const dstrain::emu::BlasMatrix a{A, Atype, lda, ta}, b{B, Btype, ldb, tb}, c{C, Ctype, ldc};
  dstrain::emu::enqueue(reinterpret_cast<Handle*>(handle)->stream, [=] {
    dstrain::emu::reference_gemm(m, n, k, a_scale, a, b, c_scale, c, C, Ctype, ldc, nullptr);
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
