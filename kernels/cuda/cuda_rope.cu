// CUDA rotary position embedding (rotate-half), in place on the q and k heads of a qkv buffer.
// Memory-bound: one thread per rotated pair (x[i], x[i + hd/2]) in a grid-stride loop; the
// thread reads both elements before writing either, and no two threads share an element, so
// in place is safe. Consecutive threads take consecutive i: both halves' loads coalesce.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/qkv_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// qkv (B,T,width): rotates the first `heads` heads (hd = 2 * half) of every row, row r at
// position r % T; freqs (maxT,half,2) F32. sin_sign -1: the transposed rotation (backward).
// __fmul_rn/__fsub_rn/__fadd_rn: no FMA contraction, so the same roundings as the CPU twin's
// x1*c - x2*s (compiled without contraction): bitwise equal.
__global__ void rope_kernel(DeviceTensor qkv, const float* freqs, int64_t pairs, int64_t T,
                            int64_t width, int64_t heads, int64_t half, float sin_sign) {
  const int64_t pairs_per_row = heads * half;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < pairs;
       p += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = p / pairs_per_row, in_row = p % pairs_per_row;
    const int64_t head = in_row / half, i = in_row % half;
    const int64_t first = row * width + head * 2 * half + i, second = first + half;
    const float* cos_sin = freqs + ((row % T) * half + i) * 2;
    const float c = cos_sin[0], s = sin_sign * cos_sin[1];
    const float x1 = load(qkv, first), x2 = load(qkv, second);
    store(qkv, first, __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    store(qkv, second, __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

}  // namespace

void rope(const CudaContext& ctx, Tensor qkv, Tensor freqs, int n_head, int n_kv_head,
          bool transposed, cudaStream_t stream) {
  check_float_tensor(ctx, qkv, "rope qkv");
  check_tensor_dtype(ctx, freqs, DType::F32, "rope freqs");
  const QkvShape s = check_rope_shapes(qkv, freqs, n_head, n_kv_head);
  const int64_t half = s.hd / 2, heads = s.NH + s.KV;  // v is not rotated
  const int64_t pairs = s.B * s.T * heads * half;
  if (pairs == 0) return;
  DSTRAIN_LAUNCH(rope_kernel, grid_for(ctx, pairs, kThreads), kThreads, 0, stream)
  (device_tensor(qkv), freqs.f32(), pairs, s.T, s.width(), heads, half,
   transposed ? -1.0f : 1.0f);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
