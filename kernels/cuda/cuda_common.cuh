// Device-side helpers shared by the .cu files of the CUDA backend: typed loads and stores
// through fp32, deterministic warp and block reductions, launch geometry.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda/cuda_ops.h"

// A kernel launch, `DSTRAIN_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...)`, and the
// block's dynamic shared memory, `DSTRAIN_DYNAMIC_SHARED(float, name);`: the CUDA syntax for
// nvcc; the CUDA emulator's build (kernels/cuda_emu/emu_device.h, included before this header)
// runs the same kernels on the host and defines both its own way.
#ifndef DSTRAIN_CUDA_EMULATION
#define DSTRAIN_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<grid, block, shared_bytes, stream>>>
#define DSTRAIN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace dstrain::cuda {

// A float tensor as a kernel sees it: where, and in which storage dtype.
struct DeviceTensor {
  void* data;
  DType dtype;
};
inline DeviceTensor device_tensor(const Tensor& t) { return {t.data, t.dtype}; }

// Element i as fp32.
__device__ __forceinline__ float load(const DeviceTensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::F16:
      return __half2float(static_cast<const __half*>(t.data)[i]);
    case DType::BF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[i]);
    default:
      return static_cast<const float*>(t.data)[i];
  }
}

// Element i = value rounded to the storage dtype (RNE, like core/dtype.h's store_as).
__device__ __forceinline__ void store(const DeviceTensor& t, int64_t i, float value) {
  switch (t.dtype) {
    case DType::F16:
      static_cast<__half*>(t.data)[i] = __float2half_rn(value);
      break;
    case DType::BF16:
      static_cast<__nv_bfloat16*>(t.data)[i] = __float2bfloat16_rn(value);
      break;
    default:
      static_cast<float*>(t.data)[i] = value;
  }
}

// Butterfly reductions: every lane ends with the same value, summed in the same order on
// every run.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
__device__ __forceinline__ double warp_sum(double value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Sum over a 1-D block (blockDim.x a multiple of 32, <= 1024): warps reduce, then warp 0 adds
// the warp sums in warp order. `shared` holds >= 32 values. Every thread gets the result.
template <class T>
__device__ T block_sum(T value, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  value = warp_sum(value);
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  if (warp == 0) {
    T total = lane < warps ? shared[lane] : T(0);
    total = warp_sum(total);
    if (lane == 0) shared[0] = total;
  }
  __syncthreads();
  return shared[0];
}

// Grid for a grid-stride loop over n elements: enough blocks to fill the GPU, no more.
inline unsigned grid_for(const CudaContext& ctx, int64_t n, int threads) {
  const int64_t needed = (n + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(ctx.sm_count) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap)));
}

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace dstrain::cuda
