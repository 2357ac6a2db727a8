// The CUDA members of the check family (see core/check.h):
//
//   CUDA_CHECK(cudaMemcpyAsync(...));   throws dstrain::Error naming the statement, the CUDA
//                                       error, file:line, the device and the rank
//   CUBLAS_CHECK(cublasGemmEx(...));    the same for a cuBLAS / cuBLASLt status
//   CUDA_CHECK_LAUNCH();                after every kernel launch: the launch's own error
//
// Out of device memory (cudaErrorMemoryAllocation) throws dstrain::UserError whose sentence
// points to `dstrain plan`, like the Allocator's out-of-memory message.
// Only CUDA code (kernels/cuda/, tests/kernels_cuda/) includes this header: it pulls in the
// CUDA runtime and cuBLAS headers, which the CPU-only build never sees.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "core/check.h"

namespace dstrain::cuda {

// Throw with the statement, where it failed, and who was running. Never return.
[[noreturn]] void raise_cuda_error(cudaError_t error, const char* statement, const char* file,
                                   int line);
[[noreturn]] void raise_cublas_error(cublasStatus_t status, const char* statement, const char* file,
                                     int line);

// "cuda:3 (rank 1)" or "cuda:3": the current device of this thread and, inside a rank, its
// rank. Used by the messages above; never throws.
std::string where_running();

}  // namespace dstrain::cuda

#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t dstrain_cuda_status_ = (expr);                                      \
    if (dstrain_cuda_status_ != cudaSuccess)                                              \
      ::dstrain::cuda::raise_cuda_error(dstrain_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                        \
    const cublasStatus_t dstrain_cublas_status_ = (expr);                                     \
    if (dstrain_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                      \
      ::dstrain::cuda::raise_cublas_error(dstrain_cublas_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// A launch reports a bad configuration only through cudaGetLastError (which also clears it).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
