// Shared by cuda_attention_forward.cu and cuda_attention_backward.cu: the tiling of the
// flash-attention style kernels and the argument checks.
//
// Tiling. A block owns R = 8 * warps rows of one (b, head) -- query rows of a query head in the
// forward and dQ kernels, key rows of a kv head in the dK/dV kernel -- each warp 8 of them, kept
// in shared memory and read by broadcast. The other side streams through in tiles of 32 rows,
// one row per lane, stored with an odd row stride so that lane-per-row reads hit 32 different
// banks. Grouped-query attention: query head h reads kv head h / (NH/KV); the dK/dV kernel
// streams the query tiles of each of its kv head's query heads, heads in ascending order, into
// the same accumulators. A lane owns the
// head-dim columns d = lane + 32 k (k < kDPerLane) of each accumulator row it updates, in
// registers. Scores exist one tile row at a time, in registers: no T x T matrix anywhere.
// Every sum runs in a fixed order, and nothing is accumulated with atomics (dQ has its own
// kernel instead of atomics into dq), so forward and backward are deterministic.
#pragma once

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/qkv_checks.h"

namespace dstrain::cuda::attention {

constexpr int kStreamRows = 32;  // rows of the streamed tile: one per lane
constexpr int kRowsPerWarp = 8;  // owned rows per warp
constexpr int kMaxHeadDim = 256;

// Warps per block: 4, or 2 for head dims above 128 so that the tiles fit the 99 KiB of shared
// memory of sm_86/sm_89 blocks.
inline int warps_for(int64_t hd) { return hd > 128 ? 2 : 4; }
// Row stride of a streamed tile in shared memory: odd, so 32 lanes reading 32 rows at one column
// touch 32 banks.
__host__ __device__ inline int64_t stream_stride(int64_t hd) { return hd | 1; }

inline void check_kernel_limits(const QkvShape& s) {
  DSTRAIN_CHECK(s.hd <= kMaxHeadDim) << "attention: head dim " << s.hd << " (n_head = " << s.NH
                                     << ", n_kv_head = " << s.KV
                                     << ") is above the CUDA kernels' maximum of " << kMaxHeadDim;
  DSTRAIN_CHECK(s.B * s.NH <= 65535)
      << "attention: B * n_head = " << s.B * s.NH << " is above the grid limit of 65535";
}

// Device and dtype checks here, shapes in kernels/qkv_checks.h (shared with the CPU twin),
// then the limits of these kernels.
inline QkvShape check_attention(const CudaContext& ctx, const Tensor& qkv, const Tensor& out,
                                const Tensor& lse, int n_head, int n_kv_head) {
  check_float_tensor(ctx, qkv, "attention qkv");
  check_float_tensor(ctx, out, "attention out");
  check_tensor_dtype(ctx, lse, DType::F32, "attention lse");
  const QkvShape s = check_attention_shapes(qkv, out, lse, n_head, n_kv_head);
  check_kernel_limits(s);
  return s;
}

// Loads `rows` rows of a (T, hd) head slice into shared memory (row stride `stride`), zeros
// for rows at or past T. The slice's row t starts at element (b*T + t) * width + column.
__device__ inline void load_rows(float* dst, int64_t stride, const DeviceTensor& src, int64_t b,
                                 int64_t T, int64_t width, int64_t column, int64_t first_row,
                                 int rows, int64_t hd) {
  for (int64_t idx = threadIdx.x; idx < rows * hd; idx += blockDim.x) {
    const int64_t r = idx / hd, d = idx % hd;
    const int64_t t = first_row + r;
    dst[r * stride + d] = t < T ? load(src, (b * T + t) * width + column + d) : 0.0f;
  }
}

// dot of a broadcast row (same address in every lane) with this lane's row.
__device__ __forceinline__ float dot_rows(const float* shared_row, const float* lane_row,
                                          int64_t hd) {
  float sum = 0.0f;
  for (int64_t d = 0; d < hd; ++d) sum += shared_row[d] * lane_row[d];
  return sum;
}

// Sets the dynamic shared memory limit of `kernel` once per process (>= 48 KiB needs opt-in).
template <class Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
  }
}

}  // namespace dstrain::cuda::attention
