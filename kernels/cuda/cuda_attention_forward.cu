// CUDA causal self-attention forward, flash-attention style (see cuda_attention.cuh for the
// tiling): each block owns query rows of one (b, query head); its kv head's key/value tiles
// stream through shared memory; per query row a running max, a running sum and the output row
// (in registers) are rescaled as each tile arrives (online softmax). Saves lse = max + log(sum)
// per row. With positions (packed sequences), query i sees keys [i - positions[b, i], i]: the
// tiles before its sequence are skipped, the keys before it in a tile masked. BF16/F16 at head
// dims 64, 128, 192, 256 run on the tensor-core kernel instead (cuda_attention_mma.cu), packed
// rows too; this kernel takes the rest (F32, other head dims, unaligned views).
#include <cmath>

#include "kernels/cuda/cuda_attention.cuh"
#include "kernels/cuda/cuda_attention_mma.cuh"
#include "kernels/positions.h"

namespace dstrain::cuda {

namespace {

using namespace attention;

// out (B,T,NH*hd), lse (B,NH,T), qkv (B,T,(NH+2KV)*hd). Grid (query blocks, B*NH), block
// 32*warps.
template <int kDPerLane>
__global__ void attention_forward_kernel(DeviceTensor out, float* lse, DeviceTensor qkv,
                                         const int32_t* positions, int64_t T, int64_t NH,
                                         int64_t KV, int64_t hd, float scale) {
  DSTRAIN_DYNAMIC_SHARED(float, shared);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int owned = (blockDim.x / 32) * kRowsPerWarp;  // query rows of this block
  const int64_t b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t q0 = blockIdx.x * int64_t{owned};
  const int64_t stride = stream_stride(hd);
  float* q_tile = shared;                         // (owned, hd)
  float* k_tile = q_tile + owned * hd;            // (32, stride)
  float* v_tile = k_tile + kStreamRows * stride;  // (32, hd)
  const int64_t C = NH * hd, width = (NH + 2 * KV) * hd;  // out row, qkv row
  const int64_t k_column = (NH + kv_head) * hd, v_column = (NH + KV + kv_head) * hd;

  load_rows(q_tile, hd, qkv, b, T, width, h * hd, q0, owned, hd);

  float o[kRowsPerWarp][kDPerLane];
  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    row_max[rr] = -INFINITY;
    row_sum[rr] = 0.0f;
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) o[rr][k] = 0.0f;
  }

  const int64_t last_query = min(q0 + owned, T) - 1;
  for (int64_t k0 = 0; k0 <= last_query; k0 += kStreamRows) {
    __syncthreads();  // the previous tile (and the q tile load) is complete
    load_rows(k_tile, stride, qkv, b, T, width, k_column, k0, kStreamRows, hd);
    load_rows(v_tile, hd, qkv, b, T, width, v_column, k0, kStreamRows, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int64_t i = q0 + r;
      if (i >= T || k0 > i) continue;  // warp-uniform
      const int64_t first = positions != nullptr ? i - positions[b * T + i] : 0;
      if (k0 + kStreamRows <= first) continue;  // a tile before its sequence: warp-uniform
      const int64_t j = k0 + lane;
      const bool visible = j <= i && j >= first;
      const float score =
          visible ? dot_rows(q_tile + r * hd, k_tile + lane * stride, hd) * scale : -INFINITY;
      // Finite: the first tile processed holds key `first`, which the row sees.
      const float new_max = fmaxf(row_max[rr], warp_max(score));
      const float p = visible ? expf(score - new_max) : 0.0f;
      const float correction = expf(row_max[rr] - new_max);  // 0 on the first tile
      row_sum[rr] = row_sum[rr] * correction + warp_sum(p);
      row_max[rr] = new_max;
#pragma unroll
      for (int k = 0; k < kDPerLane; ++k) o[rr][k] *= correction;
      const int keys = static_cast<int>(min(int64_t{kStreamRows}, i - k0 + 1));
      for (int jj = 0; jj < keys; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const float* v_row = v_tile + jj * hd;
#pragma unroll
        for (int k = 0; k < kDPerLane; ++k) {
          const int64_t d = lane + 32 * k;
          if (d < hd) o[rr][k] += pj * v_row[d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = q0 + warp * kRowsPerWarp + rr;
    if (i >= T) continue;
    const float inv_sum = 1.0f / row_sum[rr];
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < hd) store(out, (b * T + i) * C + h * hd + d, o[rr][k] * inv_sum);
    }
    if (lane == 0) lse[(b * NH + h) * T + i] = row_max[rr] + logf(row_sum[rr]);
  }
}

template <int kDPerLane>
void launch_forward(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                    const int32_t* positions, cudaStream_t stream) {
  const int warps = warps_for(s.hd);
  const int owned = warps * kRowsPerWarp;
  const size_t shared_bytes =
      static_cast<size_t>(owned * s.hd + kStreamRows * stream_stride(s.hd) + kStreamRows * s.hd) *
      sizeof(float);
  allow_shared_memory(attention_forward_kernel<kDPerLane>, shared_bytes);
  const dim3 grid(ceil_div(s.T, owned), static_cast<unsigned>(s.B * s.NH));
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  DSTRAIN_LAUNCH(attention_forward_kernel<kDPerLane>, grid, 32 * warps, shared_bytes, stream)
  (device_tensor(out), lse.f32(), device_tensor(qkv), positions, s.T, s.NH, s.KV, s.hd, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(const CudaContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                       Tensor positions, int n_head, int n_kv_head, cudaStream_t stream) {
  const QkvShape s = check_attention(ctx, qkv, out, lse, n_head, n_kv_head);
  check_positions_shape(positions, s.B, s.T, "attention");
  if (s.B == 0 || s.T == 0 || s.hd == 0) return;
  const int32_t* position = positions.empty() ? nullptr : positions.i32();
  // BF16/F16 with hd 64, 128, 192, 256: the tensor-core kernel (cuda_attention_mma.cu), with or
  // without positions.
  if (attention::mma_forward_supports(s, qkv, out)) {
    attention::attention_forward_mma(s, out, lse, qkv, position, stream);
  } else if (s.hd <= 64) {
    launch_forward<2>(s, out, lse, qkv, position, stream);
  } else if (s.hd <= 128) {
    launch_forward<4>(s, out, lse, qkv, position, stream);
  } else {
    launch_forward<8>(s, out, lse, qkv, position, stream);
  }
}

}  // namespace dstrain::cuda
