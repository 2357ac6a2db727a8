// CUDA causal self-attention backward, flash-attention style (see cuda_attention.cuh for the
// tiling). Probabilities are recomputed from q, k and the saved lse; no T x T matrix exists.
//   1. delta (B,NH,T) = rowsum(dO * O)                         (scratch)
//   2. dK, dV: a block owns key rows of a kv head and streams, for each of the kv head's query
//              heads in ascending order, the query tiles that can see them
//   3. dQ:     a block owns query rows of a query head and streams the key tiles they see
// dQ gets its own pass (recomputing the scores once more) instead of atomic adds from step 2:
// every gradient element is then summed by one thread in a fixed order -- deterministic.
// With positions (packed sequences), query i sees keys [i - positions[b, i], i] only. BF16/F16
// at head dims 64, 128, 192, 256 run on the tensor-core kernels instead
// (cuda_attention_mma_backward.cu), packed rows too; these kernels take the rest.
#include <cmath>

#include "kernels/cuda/cuda_attention.cuh"
#include "kernels/cuda/cuda_attention_mma.cuh"
#include "kernels/positions.h"

namespace dstrain::cuda {

namespace {

using namespace attention;

// delta (B,NH,T) = sum_d dout * out per (b, head, t); one warp per (b, t, head).
__global__ void attention_delta_kernel(float* delta, DeviceTensor dout, DeviceTensor out, int64_t B,
                                       int64_t T, int64_t C, int64_t NH, int64_t hd) {
  const int64_t row = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32;  // (b, t, h)
  if (row >= B * T * NH) return;
  const int lane = threadIdx.x % 32;
  const int64_t h = row % NH, bt = row / NH;
  const int64_t base = bt * C + h * hd;
  float sum = 0.0f;
  for (int64_t d = lane; d < hd; d += 32) sum += load(dout, base + d) * load(out, base + d);
  sum = warp_sum(sum);
  const int64_t b = bt / T, t = bt % T;
  if (lane == 0) delta[(b * NH + h) * T + t] = sum;
}

// The tiles of the dK/dV kernel's block in shared memory.
struct DkdvTiles {
  float* k;     // (owned, hd): the block's key rows
  float* v;     // (owned, hd)
  float* q;     // (32, stride): a streamed query tile
  float* dout;  // (32, stride)
};

// Adds query head h's share to the dk, dv accumulators of this warp's key rows: the query tiles
// from the one holding key j0 (earlier queries see none of these keys) to the end, each query
// row in ascending order. dk stays unscaled.
template <int kDPerLane>
__device__ __forceinline__ void accumulate_dkdv_head(
    float (&dk)[kRowsPerWarp][kDPerLane], float (&dv)[kRowsPerWarp][kDPerLane],
    const DkdvTiles& tile, const DeviceTensor& dout, const DeviceTensor& qkv, const float* row_lse,
    const float* row_delta, const int32_t* positions, int64_t b, int64_t h, int64_t j0, int64_t T,
    int64_t C, int64_t width, int64_t hd, float scale) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t stride = stream_stride(hd);
  for (int64_t q0 = j0 / kStreamRows * kStreamRows; q0 < T; q0 += kStreamRows) {
    __syncthreads();  // the previous tile (or head, or the owned tiles' load) is complete
    load_rows(tile.q, stride, qkv, b, T, width, h * hd, q0, kStreamRows, hd);
    load_rows(tile.dout, stride, dout, b, T, C, h * hd, q0, kStreamRows, hd);
    __syncthreads();
    const int64_t i = q0 + lane;  // this lane's query
    const float lse_i = i < T ? row_lse[i] : 0.0f;
    const float delta_i = i < T ? row_delta[i] : 0.0f;
    // The first key this lane's query sees: the start of its sequence.
    const int64_t first_i = positions != nullptr && i < T ? i - positions[b * T + i] : 0;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int64_t j = j0 + r;
      if (j >= T || q0 + kStreamRows <= j) continue;  // warp-uniform: no query of the tile sees j
      const bool visible = i < T && i >= j && j >= first_i;
      float p = 0.0f, ds = 0.0f;
      if (visible) {
        p = expf(dot_rows(tile.k + r * hd, tile.q + lane * stride, hd) * scale - lse_i);
        const float dp = dot_rows(tile.v + r * hd, tile.dout + lane * stride, hd);
        ds = p * (dp - delta_i);
      }
      const int first = static_cast<int>(max(int64_t{0}, j - q0));
      const int last = static_cast<int>(min(int64_t{kStreamRows}, T - q0));
      for (int ii = first; ii < last; ++ii) {
        const float p_i = __shfl_sync(0xffffffffu, p, ii);
        const float ds_i = __shfl_sync(0xffffffffu, ds, ii);
        const float* do_row = tile.dout + ii * stride;
        const float* q_row = tile.q + ii * stride;
#pragma unroll
        for (int k = 0; k < kDPerLane; ++k) {
          const int64_t d = lane + 32 * k;
          if (d < hd) {
            dv[rr][k] += p_i * do_row[d];
            dk[rr][k] += ds_i * q_row[d];
          }
        }
      }
    }
  }
}

// dK, dV of the key rows of one kv head this block owns: the sums over its query heads in
// ascending order (with KV == NH the one head: multi-head attention), one accumulator per
// element. dqkv (B,T,(NH+2KV)*hd): writes the kv head's k and v columns. Grid (key blocks,
// B*KV).
template <int kDPerLane>
__global__ void attention_dkdv_kernel(DeviceTensor dqkv, DeviceTensor dout, DeviceTensor qkv,
                                      const float* lse, const float* delta,
                                      const int32_t* positions, int64_t T, int64_t NH, int64_t KV,
                                      int64_t hd, float scale) {
  DSTRAIN_DYNAMIC_SHARED(float, shared);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int owned = (blockDim.x / 32) * kRowsPerWarp;  // key rows of this block
  const int64_t b = blockIdx.y / KV, kv_head = blockIdx.y % KV, group = NH / KV;
  const int64_t j0 = blockIdx.x * int64_t{owned};
  DkdvTiles tile;
  tile.k = shared;
  tile.v = tile.k + owned * hd;
  tile.q = tile.v + owned * hd;
  tile.dout = tile.q + kStreamRows * stream_stride(hd);
  const int64_t C = NH * hd, width = (NH + 2 * KV) * hd;  // dout row, qkv row
  const int64_t k_column = (NH + kv_head) * hd, v_column = (NH + KV + kv_head) * hd;

  load_rows(tile.k, hd, qkv, b, T, width, k_column, j0, owned, hd);
  load_rows(tile.v, hd, qkv, b, T, width, v_column, j0, owned, hd);

  float dk[kRowsPerWarp][kDPerLane], dv[kRowsPerWarp][kDPerLane];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) dk[rr][k] = dv[rr][k] = 0.0f;
  }
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    accumulate_dkdv_head<kDPerLane>(dk, dv, tile, dout, qkv, lse + (b * NH + h) * T,
                                    delta + (b * NH + h) * T, positions, b, h, j0, T, C, width, hd,
                                    scale);
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t j = j0 + warp * kRowsPerWarp + rr;
    if (j >= T) continue;
    const int64_t row = (b * T + j) * width;
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < hd) {
        store(dqkv, row + k_column + d, dk[rr][k] * scale);
        store(dqkv, row + v_column + d, dv[rr][k]);
      }
    }
  }
}

// dQ of the query rows of one query head this block owns (reading its kv head's k and v).
// dqkv (B,T,(NH+2KV)*hd): writes the q head's columns. Grid (query blocks, B*NH).
template <int kDPerLane>
__global__ void attention_dq_kernel(DeviceTensor dqkv, DeviceTensor dout, DeviceTensor qkv,
                                    const float* lse, const float* delta, const int32_t* positions,
                                    int64_t T, int64_t NH, int64_t KV, int64_t hd, float scale) {
  DSTRAIN_DYNAMIC_SHARED(float, shared);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int owned = (blockDim.x / 32) * kRowsPerWarp;  // query rows of this block
  const int64_t b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t q0 = blockIdx.x * int64_t{owned};
  const int64_t stride = stream_stride(hd);
  float* q_tile = shared;                         // (owned, hd)
  float* do_tile = q_tile + owned * hd;           // (owned, hd)
  float* k_tile = do_tile + owned * hd;           // (32, stride)
  float* v_tile = k_tile + kStreamRows * stride;  // (32, stride)
  const int64_t C = NH * hd, width = (NH + 2 * KV) * hd;  // dout row, qkv row
  const int64_t k_column = (NH + kv_head) * hd, v_column = (NH + KV + kv_head) * hd;
  const float* row_lse = lse + (b * NH + h) * T;
  const float* row_delta = delta + (b * NH + h) * T;

  load_rows(q_tile, hd, qkv, b, T, width, h * hd, q0, owned, hd);
  load_rows(do_tile, hd, dout, b, T, C, h * hd, q0, owned, hd);

  float dq[kRowsPerWarp][kDPerLane];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) dq[rr][k] = 0.0f;
  }

  const int64_t last_query = min(q0 + owned, T) - 1;
  for (int64_t k0 = 0; k0 <= last_query; k0 += kStreamRows) {
    __syncthreads();
    load_rows(k_tile, stride, qkv, b, T, width, k_column, k0, kStreamRows, hd);
    load_rows(v_tile, stride, qkv, b, T, width, v_column, k0, kStreamRows, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int64_t i = q0 + r;
      if (i >= T || k0 > i) continue;  // warp-uniform
      const int64_t first = positions != nullptr ? i - positions[b * T + i] : 0;
      if (k0 + kStreamRows <= first) continue;  // a tile before its sequence: warp-uniform
      const int64_t j = k0 + lane;
      float ds = 0.0f;
      if (j <= i && j >= first) {
        const float p =
            expf(dot_rows(q_tile + r * hd, k_tile + lane * stride, hd) * scale - row_lse[i]);
        const float dp = dot_rows(do_tile + r * hd, v_tile + lane * stride, hd);
        ds = p * (dp - row_delta[i]);
      }
      const int keys = static_cast<int>(min(int64_t{kStreamRows}, i - k0 + 1));
      for (int jj = 0; jj < keys; ++jj) {
        const float ds_j = __shfl_sync(0xffffffffu, ds, jj);
        const float* k_row = k_tile + jj * stride;
#pragma unroll
        for (int k = 0; k < kDPerLane; ++k) {
          const int64_t d = lane + 32 * k;
          if (d < hd) dq[rr][k] += ds_j * k_row[d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = q0 + warp * kRowsPerWarp + rr;
    if (i >= T) continue;
    const int64_t base = (b * T + i) * width + h * hd;
#pragma unroll
    for (int k = 0; k < kDPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < hd) store(dqkv, base + d, dq[rr][k] * scale);
    }
  }
}

template <int kDPerLane>
void launch_backward(const QkvShape& s, Tensor dqkv, Tensor dout, Tensor qkv, const float* lse,
                     const float* delta, const int32_t* positions, cudaStream_t stream) {
  const int warps = warps_for(s.hd);
  const int owned = warps * kRowsPerWarp;
  // Both kernels: two owned (owned, hd) tiles and two streamed (32, stride) tiles.
  const size_t shared_bytes =
      static_cast<size_t>(2 * owned * s.hd + 2 * kStreamRows * stream_stride(s.hd)) * sizeof(float);
  const dim3 key_grid(ceil_div(s.T, owned), static_cast<unsigned>(s.B * s.KV));
  const dim3 query_grid(ceil_div(s.T, owned), static_cast<unsigned>(s.B * s.NH));
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  allow_shared_memory(attention_dkdv_kernel<kDPerLane>, shared_bytes);
  DSTRAIN_LAUNCH(attention_dkdv_kernel<kDPerLane>, key_grid, 32 * warps, shared_bytes, stream)
  (device_tensor(dqkv), device_tensor(dout), device_tensor(qkv), lse, delta, positions, s.T, s.NH,
   s.KV, s.hd, scale);
  CUDA_CHECK_LAUNCH();
  allow_shared_memory(attention_dq_kernel<kDPerLane>, shared_bytes);
  DSTRAIN_LAUNCH(attention_dq_kernel<kDPerLane>, query_grid, 32 * warps, shared_bytes, stream)
  (device_tensor(dqkv), device_tensor(dout), device_tensor(qkv), lse, delta, positions, s.T, s.NH,
   s.KV, s.hd, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, Tensor positions, int n_head, int n_kv_head,
                        cudaStream_t stream) {
  check_attention(ctx, qkv, out, lse, n_head, n_kv_head);
  check_float_tensor(ctx, dqkv, "attention dqkv");
  check_float_tensor(ctx, dout, "attention dout");
  const QkvShape s =
      check_attention_backward_shapes(dqkv, dout, qkv, out, lse, n_head, n_kv_head);
  check_positions_shape(positions, s.B, s.T, "attention");
  if (s.B == 0 || s.T == 0 || s.hd == 0) return;
  const int32_t* position = positions.empty() ? nullptr : positions.i32();
  // BF16/F16 with hd 64, 128, 192, 256: the tensor-core kernels (cuda_attention_mma_backward.cu),
  // with or without positions.
  if (attention::mma_backward_supports(s, dqkv, dout, qkv, out)) {
    return attention::attention_backward_mma(ctx, s, dqkv, dout, qkv, out, lse, position, stream);
  }
  const int64_t rows = s.B * s.T * s.NH;
  Scratch delta(ctx, static_cast<size_t>(rows) * sizeof(float), stream);
  constexpr int kDeltaWarps = 8;
  DSTRAIN_LAUNCH(attention_delta_kernel, ceil_div(rows, kDeltaWarps), 32 * kDeltaWarps, 0, stream)
  (delta.as<float>(), device_tensor(dout), device_tensor(out), s.B, s.T, s.q_width(), s.NH, s.hd);
  CUDA_CHECK_LAUNCH();
  if (s.hd <= 64) {
    launch_backward<2>(s, dqkv, dout, qkv, lse.f32(), delta.as<float>(), position, stream);
  } else if (s.hd <= 128) {
    launch_backward<4>(s, dqkv, dout, qkv, lse.f32(), delta.as<float>(), position, stream);
  } else {
    launch_backward<8>(s, dqkv, dout, qkv, lse.f32(), delta.as<float>(), position, stream);
  }
}

}  // namespace dstrain::cuda
