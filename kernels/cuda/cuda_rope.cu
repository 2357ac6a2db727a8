// CUDA rotary position embedding (rotate-half), in place on the q and k heads of a qkv buffer.
// Memory-bound: one thread per rotated pair (x[i], x[i + hd/2]) in a grid-stride loop, or per 8
// pairs (i .. i + 7, 128-bit loads and stores of both halves and of the table's cos/sin) where
// hd/2 % 8 == 0 and qkv and the table are 16-byte aligned; the same arithmetic per pair. A
// thread reads its elements before writing them, and no two threads share an element, so in
// place is safe. Consecutive threads take consecutive i: both halves' loads coalesce.
#include "kernels/cuda/cuda_vector.cuh"
#include "kernels/positions.h"
#include "kernels/qkv_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// qkv (B,T,width): rotates the first `heads` heads (hd = 2 * half) of every row, row r at
// position r % T; freqs (maxT,half,2) F32. sin_sign -1: the transposed rotation (backward).
// __fmul_rn/__fsub_rn/__fadd_rn: no FMA contraction, so the same roundings as the CPU twin's
// x1*c - x2*s (compiled without contraction): bitwise equal.
// The rotated pair (x1, x2) by the angle of (c, s).
// The position of qkv row `row` (b * T + t): positions[row], or t without positions.
__device__ __forceinline__ int64_t row_position(const int32_t* positions, int64_t row, int64_t T) {
  return positions != nullptr ? positions[row] : row % T;
}

__device__ __forceinline__ void rotate(float& x1, float& x2, float c, float s) {
  const float y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  x2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  x1 = y1;
}

__global__ void rope_kernel(DeviceTensor qkv, const float* freqs, const int32_t* positions,
                            int64_t pairs, int64_t T, int64_t width, int64_t heads, int64_t half,
                            float sin_sign) {
  const int64_t pairs_per_row = heads * half;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < pairs;
       p += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = p / pairs_per_row, in_row = p % pairs_per_row;
    const int64_t head = in_row / half, i = in_row % half;
    const int64_t first = row * width + head * 2 * half + i, second = first + half;
    const float* cos_sin = freqs + (row_position(positions, row, T) * half + i) * 2;
    float x1 = load(qkv, first), x2 = load(qkv, second);
    rotate(x1, x2, cos_sin[0], sin_sign * cos_sin[1]);
    store(qkv, first, x1);
    store(qkv, second, x2);
  }
}

// The same, 8 pairs per thread per step: `packs` = pairs / 8. REQUIRES: half % 8 == 0; qkv of
// storage type T and freqs 16-byte aligned.
template <class T>
__global__ void rope_vector_kernel(T* qkv, const float* freqs, const int32_t* positions,
                                   int64_t packs, int64_t T_len, int64_t width, int64_t heads,
                                   int64_t half, float sin_sign) {
  const int64_t half_packs = half / kVectorElements, packs_per_row = heads * half_packs;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < packs;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = v / packs_per_row, in_row = v % packs_per_row;
    const int64_t head = in_row / half_packs, i = in_row % half_packs * kVectorElements;
    T* first = qkv + row * width + head * 2 * half + i;
    const float* cos_sin = freqs + (row_position(positions, row, T_len) * half + i) * 2;
    float x1[kVectorElements], x2[kVectorElements], cs[2][kVectorElements];
    load_vector(first, x1);
    load_vector(first + half, x2);
    load_vector(cos_sin, cs[0]);  // (cos, sin) of pairs i .. i + 3
    load_vector(cos_sin + kVectorElements, cs[1]);  // of i + 4 .. i + 7
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      const float* angle = &cs[j / 4][(j % 4) * 2];
      rotate(x1[j], x2[j], angle[0], sin_sign * angle[1]);
    }
    store_vector(first, x1);
    store_vector(first + half, x2);
  }
}

}  // namespace

void rope(const CudaContext& ctx, Tensor qkv, Tensor freqs, Tensor positions, int n_head,
          int n_kv_head, bool transposed, cudaStream_t stream) {
  check_float_tensor(ctx, qkv, "rope qkv");
  check_tensor_dtype(ctx, freqs, DType::F32, "rope freqs");
  const QkvShape s = check_rope_shapes(qkv, freqs, n_head, n_kv_head);
  check_positions_shape(positions, s.B, s.T, "rope");
  const int32_t* position = positions.empty() ? nullptr : positions.i32();
  const int64_t half = s.hd / 2, heads = s.NH + s.KV;  // v is not rotated
  const int64_t pairs = s.B * s.T * heads * half;
  if (pairs == 0) return;
  const float sin_sign = transposed ? -1.0f : 1.0f;
  if (half % kVectorElements == 0 && vector_aligned(qkv.data) && vector_aligned(freqs.data)) {
    with_storage_type(qkv.dtype, [&](auto tag) {
      using T = decltype(tag);
      const int64_t packs = pairs / kVectorElements;
      DSTRAIN_LAUNCH(rope_vector_kernel<T>, grid_for(ctx, packs, kThreads), kThreads, 0, stream)
      (static_cast<T*>(qkv.data), freqs.f32(), position, packs, s.T, s.width(), heads, half,
       sin_sign);
    });
  } else {
    DSTRAIN_LAUNCH(rope_kernel, grid_for(ctx, pairs, kThreads), kThreads, 0, stream)
    (device_tensor(qkv), freqs.f32(), position, pairs, s.T, s.width(), heads, half, sin_sign);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
