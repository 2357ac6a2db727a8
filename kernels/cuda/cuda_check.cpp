#include "kernels/cuda/cuda_check.h"

#include <sstream>

namespace dstrain::cuda {

std::string where_running() {
  std::ostringstream out;
  int device = -1;
  // cudaGetDevice fails only without a usable driver; then say what the thread context knows.
  if (cudaGetDevice(&device) == cudaSuccess) {
    out << "cuda:" << device;
  } else {
    cudaGetLastError();  // do not leave the probe's error for the next CUDA_CHECK_LAUNCH
    const ErrorContext& context = thread_error_context();
    out << (context.device.empty() ? std::string("no CUDA device") : context.device);
  }
  const int rank = thread_error_context().rank;
  if (rank >= 0) out << " (rank " << rank << ")";
  return out.str();
}

void raise_cuda_error(cudaError_t error, const char* statement, const char* file, int line) {
  const std::string where = where_running();
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it and report
    std::ostringstream sentence;
    sentence << "out of GPU memory on " << where << " in `" << statement << "` (" << file << ":"
             << line << "); run `dstrain plan` to see what fits, or lower the micro-batch";
    throw UserError(sentence.str());
  }
  std::ostringstream full;
  full << "CUDA error " << cudaGetErrorName(error) << " (" << cudaGetErrorString(error) << ") in `"
       << statement << "` at " << file << ":" << line << " [" << where << "]";
  throw Error(full.str());
}

void raise_cublas_error(cublasStatus_t status, const char* statement, const char* file, int line) {
  std::ostringstream full;
  full << "cuBLAS error " << cublasGetStatusName(status) << " (" << cublasGetStatusString(status)
       << ") in `" << statement << "` at " << file << ":" << line << " [" << where_running() << "]";
  throw Error(full.str());
}

}  // namespace dstrain::cuda
