// A tensor's amax (max |x|, kernels/ops.h fp8_amax) found by the kernels that write or read it:
// each thread's running maximum of the magnitudes' bits, then the block's by warp butterflies
// and one atomicMax on the word. Magnitudes are non-negative floats, whose order is their bits'
// order, and a NaN's bits are above infinity's, so a NaN wins as the CPU twin's does; a maximum
// is the same in any order, so the word is the same bits run to run. The word starts at 0 (the
// host clears it before the launch).
#pragma once

#include <cstring>

namespace dstrain::cuda {

__device__ __forceinline__ unsigned float_bits_of(float value) {
  unsigned bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

__device__ __forceinline__ float float_of_bits(unsigned bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// The bits of |value|.
__device__ __forceinline__ unsigned magnitude_bits(float value) {
  return float_bits_of(value) & 0x7fffffffu;
}

// The block's maximum of every thread's `local` into *amax_bits (skipped when 0). Every thread
// of the block calls it; kThreads is the block's size, a multiple of 32.
template <int kThreads>
__device__ __forceinline__ void block_amax(unsigned local, unsigned* amax_bits) {
  for (int offset = 16; offset > 0; offset /= 2) {
    local = max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ unsigned warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned block = 0;
    for (int w = 0; w < kThreads / 32; ++w) block = max(block, warp_max[w]);
    if (block != 0) atomicMax(amax_bits, block);
  }
}

}  // namespace dstrain::cuda
