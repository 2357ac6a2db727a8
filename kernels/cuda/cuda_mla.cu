// CUDA multi-head latent attention ops (semantics in kernels/ops.h, shapes in
// kernels/mla_checks.h): mla_pack and its backward, mla_unpad and its backward. Memory-bound
// rearrangements: one thread per output element in a grid-stride loop; a rotated element reads
// its pair and applies the twin's rotation (rope's arithmetic, __fmul_rn/__fsub_rn/__fadd_rn: no
// FMA contraction), the k_rope gradient sums the heads in head order as the twin does, so the
// results are the twin's bit for bit.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/mla_checks.h"
#include "kernels/positions.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// The kernels' view of the shape.
struct Dims {
  int64_t T, H, dn, dr, dv;
  float q_scale;
  bool interleaved;
  __host__ __device__ int64_t D() const { return dn + dr; }
  __host__ __device__ int64_t q_width() const { return H * D(); }
  __host__ __device__ int64_t kv_width() const { return H * (dn + dv); }
};
Dims dims_of(const MlaShape& s, const MlaHeads& heads) {
  return Dims{s.T, s.H, s.dn, s.dr, s.dv, heads.q_scale, heads.interleaved};
}

// Element i (< dr) of the rope part x (pairs (j, j + dr/2), or (2j, 2j + 1) interleaved)
// rotated by row `row`'s angles; `at(j)` reads element j of the unrotated part. sin_sign -1:
// the transpose.
template <class At>
__device__ __forceinline__ float rotated(const At& at, int64_t i, const float* freqs,
                                         const int32_t* positions, int64_t row, const Dims& d,
                                         float sin_sign) {
  const int64_t half = d.dr / 2;
  const int64_t j = d.interleaved ? i / 2 : (i < half ? i : i - half);
  const bool first = d.interleaved ? i % 2 == 0 : i < half;
  const int64_t position = positions != nullptr ? positions[row] : row % d.T;
  const float c = freqs[(position * half + j) * 2],
              s = sin_sign * freqs[(position * half + j) * 2 + 1];
  const float x1 = d.interleaved ? at(2 * j) : at(j);
  const float x2 = d.interleaved ? at(2 * j + 1) : at(j + half);
  return first ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
               : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

__global__ void mla_pack_kernel(DeviceTensor qkv, DeviceTensor q, DeviceTensor kv,
                                DeviceTensor k_rope, const float* freqs, const int32_t* positions,
                                int64_t n, Dims d) {
  const int64_t D = d.D(), width = 3 * d.q_width();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / width, in_row = e % width;
    const int64_t part = in_row / d.q_width(), h = (in_row % d.q_width()) / D, k = in_row % D;
    const int64_t kv_head = row * d.kv_width() + h * (d.dn + d.dv);
    float value = 0.0f;
    if (part == 0) {
      const int64_t base = row * d.q_width() + h * D;
      value = k < d.dn ? load(q, base + k)
                       : rotated([&](int64_t j) { return load(q, base + d.dn + j); }, k - d.dn,
                                 freqs, positions, row, d, 1.0f);
      if (d.q_scale != 1.0f) value = __fmul_rn(value, d.q_scale);
    } else if (part == 1) {
      value = k < d.dn ? load(kv, kv_head + k)
                       : rotated([&](int64_t j) { return load(k_rope, row * d.dr + j); }, k - d.dn,
                                 freqs, positions, row, d, 1.0f);
    } else if (k < d.dv) {
      value = load(kv, kv_head + d.dn + k);
    }
    store(qkv, e, value);
  }
}

// dq and dkv: one thread per element of dq's row followed by dkv's.
__global__ void mla_pack_backward_kernel(DeviceTensor dq, DeviceTensor dkv, DeviceTensor dqkv,
                                         const float* freqs, const int32_t* positions, int64_t n,
                                         Dims d) {
  const int64_t D = d.D(), width = d.q_width() + d.kv_width();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / width, in_row = e % width;
    const int64_t qkv_row = row * 3 * d.q_width();
    if (in_row < d.q_width()) {
      const int64_t h = in_row / D, k = in_row % D, base = qkv_row + h * D;
      // Scaled first, then rotated back (the twin's order).
      const auto scaled = [&](int64_t j) {
        const float x = load(dqkv, base + j);
        return d.q_scale != 1.0f ? __fmul_rn(x, d.q_scale) : x;
      };
      const float value = k < d.dn ? scaled(k)
                                   : rotated([&](int64_t j) { return scaled(d.dn + j); }, k - d.dn,
                                             freqs, positions, row, d, -1.0f);
      store(dq, row * d.q_width() + in_row, value);
    } else {
      const int64_t i = in_row - d.q_width(), h = i / (d.dn + d.dv), k = i % (d.dn + d.dv);
      const int64_t from = k < d.dn ? qkv_row + d.q_width() + h * D + k
                                    : qkv_row + 2 * d.q_width() + h * D + (k - d.dn);
      store(dkv, row * d.kv_width() + i, load(dqkv, from));
    }
  }
}

// dk_rope: the k heads' rope parts summed over the heads (head order), then rotated back.
__global__ void mla_k_rope_backward_kernel(DeviceTensor dk_rope, DeviceTensor dqkv,
                                           const float* freqs, const int32_t* positions, int64_t n,
                                           Dims d) {
  const int64_t D = d.D();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / d.dr, i = e % d.dr;
    const int64_t k_heads = row * 3 * d.q_width() + d.q_width() + d.dn;
    const auto summed = [&](int64_t j) {
      float sum = 0.0f;
      for (int64_t h = 0; h < d.H; ++h) sum = __fadd_rn(sum, load(dqkv, k_heads + h * D + j));
      return sum;
    };
    store(dk_rope, e, rotated(summed, i, freqs, positions, row, d, -1.0f));
  }
}

__global__ void mla_unpad_kernel(DeviceTensor out, DeviceTensor atty, int64_t n, Dims d) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / (d.H * d.dv), h = (e / d.dv) % d.H, k = e % d.dv;
    store(out, e, load(atty, row * d.q_width() + h * d.D() + k));
  }
}

__global__ void mla_unpad_backward_kernel(DeviceTensor datty, DeviceTensor dout, int64_t n,
                                          Dims d) {
  const int64_t D = d.D();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / d.q_width(), h = (e / D) % d.H, k = e % D;
    store(datty, e, k < d.dv ? load(dout, row * d.H * d.dv + h * d.dv + k) : 0.0f);
  }
}

}  // namespace

void mla_pack(const CudaContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs,
              Tensor positions, const MlaHeads& heads, cudaStream_t stream) {
  check_float_tensor(ctx, qkv, "mla qkv");
  const MlaShape s = check_mla_pack_shapes(qkv, q, kv, k_rope, freqs, heads, "mla_pack");
  check_positions_shape(positions, s.B, s.T, "mla_pack");
  const int64_t n = s.rows() * 3 * s.q_width();
  if (n == 0) return;
  DSTRAIN_LAUNCH(mla_pack_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(qkv), device_tensor(q), device_tensor(kv), device_tensor(k_rope), freqs.f32(),
   positions.empty() ? nullptr : positions.i32(), n, dims_of(s, heads));
  CUDA_CHECK_LAUNCH();
}

void mla_pack_backward(const CudaContext& ctx, Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv,
                       Tensor freqs, Tensor positions, const MlaHeads& heads, cudaStream_t stream) {
  check_float_tensor(ctx, dqkv, "mla dqkv");
  const MlaShape s =
      check_mla_pack_shapes(dqkv, dq, dkv, dk_rope, freqs, heads, "mla_pack_backward");
  check_positions_shape(positions, s.B, s.T, "mla_pack_backward");
  const int32_t* position = positions.empty() ? nullptr : positions.i32();
  const int64_t n = s.rows() * (s.q_width() + s.kv_width()), n_rope = s.rows() * s.dr;
  if (n == 0) return;
  DSTRAIN_LAUNCH(mla_pack_backward_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(dq), device_tensor(dkv), device_tensor(dqkv), freqs.f32(), position, n,
   dims_of(s, heads));
  CUDA_CHECK_LAUNCH();
  DSTRAIN_LAUNCH(mla_k_rope_backward_kernel, grid_for(ctx, n_rope, kThreads), kThreads, 0, stream)
  (device_tensor(dk_rope), device_tensor(dqkv), freqs.f32(), position, n_rope, dims_of(s, heads));
  CUDA_CHECK_LAUNCH();
}

void mla_unpad(const CudaContext& ctx, Tensor out, Tensor atty, const MlaHeads& heads,
               cudaStream_t stream) {
  check_float_tensor(ctx, atty, "mla atty");
  const MlaShape s = check_mla_unpad_shapes(out, atty, heads, "mla_unpad");
  const int64_t n = s.rows() * s.H * s.dv;
  if (n == 0) return;
  DSTRAIN_LAUNCH(mla_unpad_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(out), device_tensor(atty), n, dims_of(s, heads));
  CUDA_CHECK_LAUNCH();
}

void mla_unpad_backward(const CudaContext& ctx, Tensor datty, Tensor dout, const MlaHeads& heads,
                        cudaStream_t stream) {
  check_float_tensor(ctx, dout, "mla dout");
  const MlaShape s = check_mla_unpad_shapes(dout, datty, heads, "mla_unpad_backward");
  const int64_t n = s.rows() * s.q_width();
  if (n == 0) return;
  DSTRAIN_LAUNCH(mla_unpad_backward_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(datty), device_tensor(dout), n, dims_of(s, heads));
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
