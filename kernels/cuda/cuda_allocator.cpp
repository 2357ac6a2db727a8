#include "kernels/cuda/cuda_allocator.h"

#include <sys/resource.h>

#include <cstdio>

#include "kernels/cuda/cuda_check.h"

namespace dstrain {
namespace {

// Selects `device` for the scope, restores the thread's previous device after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
  }
  ~ScopedDevice() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

// Release runs from Buffer's destructor, which must not throw: a failed free is reported on
// stderr (it means the context is already broken, and the next checked call will say so).
void report_free_error(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "dstrain: %s failed: %s\n", what, cudaGetErrorString(error));
  }
}

class CudaDeviceAllocator final : public Allocator {
 public:
  explicit CudaDeviceAllocator(int device) : Allocator(Device{Device::Kind::CUDA, device}) {
    int count = 0;
    CUDA_CHECK(cudaGetDeviceCount(&count));
    DSTRAIN_CHECK(device >= 0 && device < count)
        << "CUDA device " << device << " does not exist (" << count << " devices)";
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    ScopedDevice scoped(device().index);
    void* pointer = nullptr;
    // cudaMalloc aligns to at least 256 bytes (the Allocator asks for 64).
    const cudaError_t error = cudaMalloc(&pointer, bytes);
    if (error == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: the Allocator reports which category did not fit
      return nullptr;
    }
    CUDA_CHECK(error);
    return pointer;
  }
  void raw_free(void* pointer) override {
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device().index &&
                          cudaSetDevice(device().index) == cudaSuccess;
    report_free_error(cudaFree(pointer), "cudaFree");
    if (switched) cudaSetDevice(previous);
  }
};

class PinnedHostAllocator final : public Allocator {
 public:
  PinnedHostAllocator() : Allocator(Device{Device::Kind::CPU, 0}) {}

 protected:
  void* raw_allocate(size_t bytes) override {
    void* pointer = nullptr;
    // Portable: page-locked for every device, so any rank's stream copies it asynchronously.
    const cudaError_t error = cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable);
    if (error == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    CUDA_CHECK(error);
    return pointer;
  }
  void raw_free(void* pointer) override {
    report_free_error(cudaFreeHost(pointer), "cudaFreeHost");
  }
  std::string out_of_memory_advice() const override {
    rlimit limit{};
    if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "";
    return "; this is pinned (page-locked) host memory, and this process may lock " +
           format_bytes(limit.rlim_cur) +
           " (ulimit -l): raise it (ulimit -l unlimited; in a container, docker run --ulimit "
           "memlock=-1)";
  }
};

}  // namespace

std::unique_ptr<Allocator> make_cuda_allocator(int device) {
  return std::make_unique<CudaDeviceAllocator>(device);
}

std::unique_ptr<Allocator> make_pinned_host_allocator() {
  return std::make_unique<PinnedHostAllocator>();
}

}  // namespace dstrain
