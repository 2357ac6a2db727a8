// Causal self-attention backward on tensor cores, FlashAttention-2 style, for bf16/f16 storage
// and head dims 64, 128, 256 (the forward: cuda_attention_mma.cu; shared pieces:
// cuda_attention_mma_common.cuh). Probabilities are recomputed from q, k and the saved lse; no
// T x T matrix exists. Three kernels:
//   1. delta (B,NH,T) fp32 = rowsum(dO * O), 128-bit loads, a fixed-order shuffle sum;
//   2. dK, dV: a block of 4 warps owns kKeys = 64 key rows of one (b, kv head) (32 for hd 256,
//      where each 16 key rows belong to 2 warps that split the head-dim columns of dK and dV so
//      that the two (16, 128) fp32 accumulators fit the registers). It streams the query tiles
//      that see its keys, of each of the kv head's query heads in ascending order, through two
//      cp.async stages, and per warp and tile:
//        S^T (16 keys, queries) = K Q^T   (mma: K's rows the A operand, Q's rows B's columns)
//        P^T = exp2(S^T scale log2(e) - lse log2(e)), masked (causal, past T)
//        dP^T = V dO^T,  dS^T = P^T * (dP^T - delta)
//        dV += P^T dO,   dK += dS^T Q     (P^T, dS^T rounded to 16 bits: the accumulators' layout
//                                          is the A fragment's; dO, Q from ldmatrix .trans)
//      dK is scaled once at the end. Query tiles wholly above a warp's keys are skipped.
//   3. dQ: a block owns 64 query rows of one (b, query head), 16 per warp, and streams its kv
//      head's key tiles in ascending order: S = Q K^T, P, dP = dO V^T, dS as above, dQ += dS K
//      (K from ldmatrix .trans); scaled at the end. Key tiles past the block's last query are not
//      loaded, n-tiles above a warp's rows not computed.
// dq, dk, dv are written (not accumulated) into dqkv through shared memory with 128-bit stores.
// Deterministic: every sum in a fixed order (the mma's, the loops'), no atomics; dQ has its own
// kernel rather than atomic adds from the dK/dV kernel. Against the CPU twin the results differ
// by P's and dS's rounding to 16 bits (tests/kernels_cuda/attention_mma_backward_test.cpp states
// the bound).
#include <cmath>
#include <cstring>

#include "kernels/cuda/cuda_attention_mma.cuh"
#include "kernels/cuda/cuda_attention_mma_common.cuh"

namespace dstrain::cuda::attention {

namespace {

using namespace mma;

// Tile sizes per head dim, and shared memory (16-bit tiles, fp32 lse/delta rows):
//   dK/dV: K, V (kKeys, hd) + 2 stages of Q, dO (kQueries, hd) + 2 stages of lse, delta
//          (kQueries): 49 KiB (hd 64), 48.3 KiB (128), 64.3 KiB (256) -- 16-row query tiles
//          for hd 128 and 256 keep the S^T, dP^T fragments small next to the (16, 128) dK and
//          dV accumulators: 229 and 247 registers, no spills (32 rows spilled at hd 256);
//   dQ:    Q, dO (64, hd) + 2 stages of K, V (kDqKeys, hd): 48, 64, 96 KiB.
// At most the 99 KiB a block may opt in to on sm_86/sm_89.
template <int kHeadDim>
struct BackwardTiling {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / kChunkElements;  // 16-byte chunks per row
  // dK/dV kernel: warps per 16 key rows (each owning kHeadDim / kColumnSplit columns of dK, dV).
  static constexpr int kColumnSplit = kHeadDim == 256 ? 2 : 1;
  static constexpr int kWarpColumns = kHeadDim / kColumnSplit;
  static constexpr int kKeys = kWarps / kColumnSplit * kWarpRows;  // key rows of a block
  static constexpr int kQueries = kHeadDim == 64 ? 64 : 16;        // rows of a query tile
  static constexpr size_t kDkdvSharedBytes =
      static_cast<size_t>(2 * kKeys + 2 * kStages * kQueries) * kHeadDim * 2 +
      2 * kStages * kQueries * sizeof(float);
  // dQ kernel: rows of a streamed K or V tile; Q and dO fragments kept in registers (hd 64) or
  // read again for each tile.
  static constexpr int kDqKeys = kHeadDim == 64 ? 64 : kHeadDim == 128 ? 32 : 16;
  static constexpr bool kDqFragmentsInRegisters = kHeadDim == 64;
  static constexpr size_t kDqSharedBytes =
      static_cast<size_t>(2 * kQueryRows + 2 * kStages * kDqKeys) * kHeadDim * 2;
};

// delta (B,NH,T) = sum_d dout * out for each (b, t, head) row of dout, out (B,T,NH*hd): kChunks
// lanes per row, 8 products each, then a butterfly over the row's lanes (a fixed order).
// Grid ceil(rows / (kThreads / kChunks)), kThreads.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    attention_delta_mma_kernel(float* delta, const Element* dout, const Element* out, int64_t rows,
                               int T, int NH) {
  using Core = TensorCore<Element>;
  constexpr int kChunks = kHeadDim / kChunkElements;
  constexpr int kRowsPerBlock = kThreads / kChunks;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kChunks;  // (b, t, h)
  const int chunk = threadIdx.x % kChunks;
  float sum = 0.0f;
  if (row < rows) {
    const int64_t offset = row * kHeadDim + chunk * kChunkElements;
    const uint4 dout_bits = load_128(reinterpret_cast<const uint4*>(dout + offset));
    const uint4 out_bits = load_128(reinterpret_cast<const uint4*>(out + offset));
    Element dout_values[kChunkElements], out_values[kChunkElements];
    memcpy(static_cast<void*>(dout_values), &dout_bits, 16);
    memcpy(static_cast<void*>(out_values), &out_bits, 16);
#pragma unroll
    for (int k = 0; k < kChunkElements; ++k)
      sum += Core::to_float(dout_values[k]) * Core::to_float(out_values[k]);
  }
#pragma unroll
  for (int offset = kChunks / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && chunk == 0) {
    const int64_t h = row % NH, bt = row / NH;
    delta[(bt / T * NH + h) * T + bt % T] = sum;
  }
}

// Issues the cp.async copies of one query tile of the dK/dV kernel into `stage` (Q and dO rows
// [q0, q0 + kQueries) of query head h) and stores the tile's lse * log2(e) (+inf past T: P = 0)
// and delta (0 past T) with plain stores: the barrier that publishes the copies publishes them.
template <class Element, int kHeadDim>
__device__ __forceinline__ void load_query_tile(Element* q_tile, Element* do_tile, float* tile_lse,
                                                float* tile_delta, const Element* batch_qkv,
                                                const Element* batch_dout, const float* head_lse,
                                                const float* head_delta, int h, int q0, int T,
                                                int64_t width, int64_t C) {
  constexpr int kQueries = BackwardTiling<kHeadDim>::kQueries;
  load_tile_async<kQueries, kHeadDim>(q_tile, batch_qkv + h * kHeadDim, width, q0, T);
  load_tile_async<kQueries, kHeadDim>(do_tile, batch_dout + h * kHeadDim, C, q0, T);
  cp_async_commit_group();
  static_assert(2 * kQueries <= kThreads, "one thread per lse and delta value");
  const int i = threadIdx.x % kQueries, t = q0 + i;
  if (threadIdx.x < kQueries) {
    tile_lse[i] = t < T ? head_lse[t] * kLog2e : INFINITY;
  } else if (threadIdx.x < 2 * kQueries) {
    tile_delta[i] = t < T ? head_delta[t] : 0.0f;
  }
}

// Copies a block's (kRows, hd) swizzled tile to rows [row0, row0 + kRows) of a head slice
// (`head` its row 0, rows `width` apart), rows at or past T skipped: 128-bit stores.
template <int kRows, int kHeadDim, class Element>
__device__ __forceinline__ void store_tile(Element* head, int64_t width, const Element* tile,
                                           int row0, int T) {
  constexpr int kChunks = kHeadDim / kChunkElements;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const int t = row0 + row;
    if (t >= T) continue;
    // Default caching: the qkv projection's backward reads dqkv next.
    store_128(reinterpret_cast<uint4*>(head + t * width + chunk * kChunkElements),
              *reinterpret_cast<const uint4*>(tile + swizzled<kHeadDim>(row, chunk)));
  }
}

// Writes a warp's (16, 8 kTiles) fp32 accumulator times `factor`, rounded to 16 bits, into
// rows [row0, row0 + 16) and columns [column0, column0 + 8 kTiles) of a swizzled tile.
template <class Element, int kHeadDim, int kTiles>
__device__ __forceinline__ void accumulator_to_tile(Element* tile, const float (&acc)[kTiles][4],
                                                    float factor, int row0, int column0, int lane) {
  const int group = lane / 4, tig = lane % 4;
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + group + 8 * r;
      const uint32_t pair =
          TensorCore<Element>::pack(acc[n][2 * r] * factor, acc[n][2 * r + 1] * factor);
      *reinterpret_cast<uint32_t*>(tile + swizzled<kHeadDim>(row, column0 / 8 + n) + 2 * tig) =
          pair;
    }
  }
}

// dqkv (B,T,(NH+2KV)*hd): writes the k and v columns of kv head blockIdx.y % KV; dout
// (B,T,NH*hd), qkv (B,T,(NH+2KV)*hd), lse and delta (B,NH,T). Grid (ceil(T/kKeys), B*KV),
// kThreads, BackwardTiling<kHeadDim>::kDkdvSharedBytes. scale_log2 = scale * log2(e).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_mma_kernel(Element* dqkv, const Element* dout, const Element* qkv,
                              const float* lse, const float* delta, int T, int NH, int KV,
                              float scale, float scale_log2) {
  using Tile = BackwardTiling<kHeadDim>;
  using Core = TensorCore<Element>;
  constexpr int kKeys = Tile::kKeys, kQueries = Tile::kQueries;
  constexpr int kQueryTiles = kQueries / 8;             // 8-query n-tiles of S^T, dP^T
  constexpr int kQuerySteps = kQueries / 16;            // 16-query k-steps of P^T dO, dS^T Q
  constexpr int kDimSteps = kHeadDim / 16;              // k-steps of K Q^T, V dO^T
  constexpr int kColumnTiles = Tile::kWarpColumns / 8;  // n-tiles of this warp's dK, dV
  constexpr int kStreamElements = kQueries * kHeadDim;

  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* k_tile = reinterpret_cast<Element*>(shared_chunks);    // (kKeys, hd)
  Element* v_tile = k_tile + kKeys * kHeadDim;                    // (kKeys, hd)
  Element* q_tiles = v_tile + kKeys * kHeadDim;                   // (stages, kQueries, hd)
  Element* do_tiles = q_tiles + Tile::kStages * kStreamElements;  // (stages, kQueries, hd)
  float* lse_tiles = reinterpret_cast<float*>(do_tiles + Tile::kStages * kStreamElements);
  float* delta_tiles = lse_tiles + Tile::kStages * kQueries;  // (stages, kQueries) each

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane / 4, tig = lane % 4;  // the mma fragments' groupID, thread-in-group
  const int j0 = static_cast<int>(blockIdx.x) * kKeys;  // the first key blocks work longest
  const int b = blockIdx.y / KV, kv_head = blockIdx.y % KV, heads_per_kv = NH / KV;
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim, C = int64_t{NH} * kHeadDim;
  const Element* batch_qkv = qkv + int64_t{b} * T * width;
  const Element* batch_dout = dout + int64_t{b} * T * C;
  const int k_column = (NH + kv_head) * kHeadDim, v_column = (NH + KV + kv_head) * kHeadDim;

  const int warp_key0 = kWarpRows * (warp / Tile::kColumnSplit);  // in the block
  const int column0 = Tile::kWarpColumns * (warp % Tile::kColumnSplit);
  const int keys[2] = {j0 + warp_key0 + group, j0 + warp_key0 + group + 8};  // this lane's rows
  // Query tiles from the one holding key j0 (earlier queries see none of the block's keys).
  const int first_tile = j0 / kQueries;
  const int query_tiles = (T + kQueries - 1) / kQueries - first_tile;
  const int items = heads_per_kv * query_tiles;  // (head, query tile), heads ascending

  const auto load_item = [&](int item, int stage) {
    const int h = kv_head * heads_per_kv + item / query_tiles;
    const int q0 = (first_tile + item % query_tiles) * kQueries;
    const int64_t head_row = (int64_t{b} * NH + h) * T;
    load_query_tile<Element, kHeadDim>(
        q_tiles + stage * kStreamElements, do_tiles + stage * kStreamElements,
        lse_tiles + stage * kQueries, delta_tiles + stage * kQueries, batch_qkv, batch_dout,
        lse + head_row, delta + head_row, h, q0, T, width, C);
  };

  load_tile_async<kKeys, kHeadDim>(k_tile, batch_qkv + k_column, width, j0, T);
  load_tile_async<kKeys, kHeadDim>(v_tile, batch_qkv + v_column, width, j0, T);
  load_item(0, 0);  // its commit covers K and V too

  float dk[kColumnTiles][4], dv[kColumnTiles][4];  // rows keys[0], keys[1]; unscaled dk
#pragma unroll
  for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  }

  for (int item = 0; item < items; ++item) {
    const int stage = item % Tile::kStages;
    const int q0 = (first_tile + item % query_tiles) * kQueries;
    cp_async_wait_group<0>();  // this thread's copies of this tile have landed
    // Everyone's have, and every warp is done with the previous tile, whose stage the next
    // tile's loads reuse: one barrier per tile.
    __syncthreads();
    if (item + 1 < items) load_item(item + 1, (item + 1) % Tile::kStages);
    const Element* q_tile = q_tiles + stage * kStreamElements;
    const Element* do_tile = do_tiles + stage * kStreamElements;
    const float* tile_lse = lse_tiles + stage * kQueries;
    const float* tile_delta = delta_tiles + stage * kQueries;

    // Warp-uniform: some query of the tile sees one of this warp's keys, and they are not all
    // past T.
    if (q0 + kQueries <= j0 + warp_key0 || j0 + warp_key0 >= T) continue;

    // ---- S^T = K Q^T, dP^T = V dO^T (16 keys, kQueries) ----
    float s[kQueryTiles][4], dp[kQueryTiles][4];
#pragma unroll
    for (int n = 0; n < kQueryTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < kDimSteps; ++kk) {
      uint32_t a[4], b0[2], b1[2];
      load_a_fragment<kHeadDim>(a, k_tile, warp_key0, lane, kk);
#pragma unroll
      for (int np = 0; np < kQueryTiles / 2; ++np) {
        load_b_pair<kHeadDim>(b0, b1, q_tile, lane, np, kk);
        Core::mma(s[2 * np], a, b0);
        Core::mma(s[2 * np + 1], a, b1);
      }
      load_a_fragment<kHeadDim>(a, v_tile, warp_key0, lane, kk);
#pragma unroll
      for (int np = 0; np < kQueryTiles / 2; ++np) {
        load_b_pair<kHeadDim>(b0, b1, do_tile, lane, np, kk);
        Core::mma(dp[2 * np], a, b0);
        Core::mma(dp[2 * np + 1], a, b1);
      }
    }

    // ---- P^T and dS^T in place of S^T and dP^T: query i sees key j when j <= i < T ----
#pragma unroll
    for (int n = 0; n < kQueryTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = 8 * n + 2 * tig + (e & 1);
        const int i = q0 + column;
        const float p =
            i >= keys[e / 2] && i < T ? exp2f(fmaf(s[n][e], scale_log2, -tile_lse[column])) : 0.0f;
        s[n][e] = p;
        dp[n][e] = p * (dp[n][e] - tile_delta[column]);
      }
    }

    // ---- dV += P^T dO, dK += dS^T Q over this warp's columns ----
#pragma unroll
    for (int kk = 0; kk < kQuerySteps; ++kk) {
      uint32_t p_fragment[4], ds_fragment[4];
      pack_a_fragment<Element>(p_fragment, s, kk);
      pack_a_fragment<Element>(ds_fragment, dp, kk);
#pragma unroll
      for (int cp = 0; cp < kColumnTiles / 2; ++cp) {
        uint32_t b0[2], b1[2];
        load_b_pair_trans<kHeadDim>(b0, b1, do_tile, lane, kk, column0 / 16 + cp);
        Core::mma(dv[2 * cp], p_fragment, b0);
        Core::mma(dv[2 * cp + 1], p_fragment, b1);
        load_b_pair_trans<kHeadDim>(b0, b1, q_tile, lane, kk, column0 / 16 + cp);
        Core::mma(dk[2 * cp], ds_fragment, b0);
        Core::mma(dk[2 * cp + 1], ds_fragment, b1);
      }
    }
  }

  // ---- epilogue: dK * scale and dV through the K and V tiles, 128-bit stores ----
  __syncthreads();  // every warp is done reading K and V
  accumulator_to_tile<Element, kHeadDim>(k_tile, dk, scale, warp_key0, column0, lane);
  accumulator_to_tile<Element, kHeadDim>(v_tile, dv, 1.0f, warp_key0, column0, lane);
  __syncthreads();
  Element* batch_dqkv = dqkv + int64_t{b} * T * width;
  store_tile<kKeys, kHeadDim>(batch_dqkv + k_column, width, k_tile, j0, T);
  store_tile<kKeys, kHeadDim>(batch_dqkv + v_column, width, v_tile, j0, T);
}

// dqkv (B,T,(NH+2KV)*hd): writes the q columns of query head blockIdx.y % NH; dout, qkv, lse,
// delta as above. Grid (ceil(T/64), B*NH), kThreads, BackwardTiling<kHeadDim>::kDqSharedBytes.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    attention_dq_mma_kernel(Element* dqkv, const Element* dout, const Element* qkv,
                            const float* lse, const float* delta, int T, int NH, int KV,
                            float scale, float scale_log2) {
  using Tile = BackwardTiling<kHeadDim>;
  using Core = TensorCore<Element>;
  constexpr int kKeys = Tile::kDqKeys;
  constexpr int kKeyTiles = kKeys / 8;      // 8-key n-tiles of S, dP
  constexpr int kKeySteps = kKeys / 16;     // 16-key k-steps of dS K
  constexpr int kDimTiles = kHeadDim / 8;   // 8-column n-tiles of dQ
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of Q K^T, dO V^T
  constexpr int kTileElements = kKeys * kHeadDim;
  constexpr bool kInRegisters = Tile::kDqFragmentsInRegisters;

  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* q_tile = reinterpret_cast<Element*>(shared_chunks);  // (64, hd)
  Element* do_tile = q_tile + kQueryRows * kHeadDim;            // (64, hd)
  Element* k_tiles = do_tile + kQueryRows * kHeadDim;           // (stages, kKeys, hd)
  Element* v_tiles = k_tiles + Tile::kStages * kTileElements;   // (stages, kKeys, hd)

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane / 4, tig = lane % 4;
  // The last query blocks have the most key tiles: launched first, they do not trail the grid.
  const int q0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kQueryRows;
  const int b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim, C = int64_t{NH} * kHeadDim;
  const Element* batch_qkv = qkv + int64_t{b} * T * width;
  const Element* k_head = batch_qkv + (NH + kv_head) * kHeadDim;
  const Element* v_head = batch_qkv + (NH + KV + kv_head) * kHeadDim;

  const int warp_row0 = q0 + kWarpRows * warp;
  const int rows[2] = {warp_row0 + group, warp_row0 + group + 8};  // this lane's two rows
  const int visible_end = min(q0 + kQueryRows, T);
  const int key_tiles = (visible_end + kKeys - 1) / kKeys;

  load_tile_async<kQueryRows, kHeadDim>(q_tile, batch_qkv + h * kHeadDim, width, q0, T);
  load_tile_async<kQueryRows, kHeadDim>(do_tile, dout + int64_t{b} * T * C + h * kHeadDim, C, q0,
                                        T);
  load_tile_async<kKeys, kHeadDim>(k_tiles, k_head, width, 0, T);
  load_tile_async<kKeys, kHeadDim>(v_tiles, v_head, width, 0, T);
  cp_async_commit_group();

  float row_lse_log2[2], row_delta[2];  // +inf and 0 past T: P = 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t index = (int64_t{b} * NH + h) * T + rows[r];
    row_lse_log2[r] = rows[r] < T ? lse[index] * kLog2e : INFINITY;
    row_delta[r] = rows[r] < T ? delta[index] : 0.0f;
  }

  uint32_t q_fragments[kInRegisters ? kDimSteps : 1][4];
  uint32_t do_fragments[kInRegisters ? kDimSteps : 1][4];
  float dq[kDimTiles][4];  // unscaled
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int tile = 0; tile < key_tiles; ++tile) {
    const int stage = tile % Tile::kStages;
    const int k0 = tile * kKeys;
    cp_async_wait_group<0>();
    __syncthreads();  // as in the dK/dV kernel: one barrier per tile
    if (tile + 1 < key_tiles) {
      const int next = (tile + 1) % Tile::kStages;
      load_tile_async<kKeys, kHeadDim>(k_tiles + next * kTileElements, k_head, width, k0 + kKeys,
                                       T);
      load_tile_async<kKeys, kHeadDim>(v_tiles + next * kTileElements, v_head, width, k0 + kKeys,
                                       T);
      cp_async_commit_group();
    }
    const Element* k_tile = k_tiles + stage * kTileElements;
    const Element* v_tile = v_tiles + stage * kTileElements;

    if constexpr (kInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int kk = 0; kk < kDimSteps; ++kk) {
          load_a_fragment<kHeadDim>(q_fragments[kk], q_tile, kWarpRows * warp, lane, kk);
          load_a_fragment<kHeadDim>(do_fragments[kk], do_tile, kWarpRows * warp, lane, kk);
        }
      }
    }

    // 8-key n-tiles with a key that some row of this warp sees (warp-uniform), as the forward.
    const int seen = warp_row0 < T ? min(warp_row0 + kWarpRows, T) - k0 : 0;
    const int active_tiles = min(kKeyTiles, (max(seen, 0) + 7) / 8);
    if (active_tiles == 0) continue;

    // ---- S = Q K^T, dP = dO V^T (16 rows, kKeys) ----
    float s[kKeyTiles][4], dp[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < kDimSteps; ++kk) {
      uint32_t a[4], b0[2], b1[2];
      if constexpr (kInRegisters) {
        for (int i = 0; i < 4; ++i) a[i] = q_fragments[kk][i];
      } else {
        load_a_fragment<kHeadDim>(a, q_tile, kWarpRows * warp, lane, kk);
      }
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) {
        if (2 * np >= active_tiles) continue;
        load_b_pair<kHeadDim>(b0, b1, k_tile, lane, np, kk);
        Core::mma(s[2 * np], a, b0);
        Core::mma(s[2 * np + 1], a, b1);
      }
      if constexpr (kInRegisters) {
        for (int i = 0; i < 4; ++i) a[i] = do_fragments[kk][i];
      } else {
        load_a_fragment<kHeadDim>(a, do_tile, kWarpRows * warp, lane, kk);
      }
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) {
        if (2 * np >= active_tiles) continue;
        load_b_pair<kHeadDim>(b0, b1, v_tile, lane, np, kk);
        Core::mma(dp[2 * np], a, b0);
        Core::mma(dp[2 * np + 1], a, b1);
      }
    }

    // ---- dS in place of S: row i sees key j when j <= i and j < T (rows past T: lse +inf) ----
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = k0 + 8 * n + 2 * tig + (e & 1);
        const int r = e / 2;
        const float p =
            j <= rows[r] && j < T ? exp2f(fmaf(s[n][e], scale_log2, -row_lse_log2[r])) : 0.0f;
        s[n][e] = p * (dp[n][e] - row_delta[r]);
      }
    }

    // ---- dQ += dS K: dS rounded to 16 bits, K's rows are B's rows (.trans) ----
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
      if (2 * kk >= active_tiles) continue;
      uint32_t ds_fragment[4];
      pack_a_fragment<Element>(ds_fragment, s, kk);
#pragma unroll
      for (int dp_pair = 0; dp_pair < kDimTiles / 2; ++dp_pair) {
        uint32_t b0[2], b1[2];
        load_b_pair_trans<kHeadDim>(b0, b1, k_tile, lane, kk, dp_pair);
        Core::mma(dq[2 * dp_pair], ds_fragment, b0);
        Core::mma(dq[2 * dp_pair + 1], ds_fragment, b1);
      }
    }
  }

  // ---- epilogue: dQ * scale through this warp's own Q rows (only it reads them), 128-bit
  // stores ----
  __syncwarp();
  accumulator_to_tile<Element, kHeadDim>(q_tile, dq, scale, kWarpRows * warp, 0, lane);
  __syncwarp();
  constexpr int kChunks = Tile::kChunks;
  Element* dq_head = dqkv + int64_t{b} * T * width + h * kHeadDim;
#pragma unroll
  for (int k = 0; k < kWarpRows * kChunks / 32; ++k) {
    const int idx = lane + 32 * k;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const int t = warp_row0 + row;
    if (t >= T) continue;
    store_128(reinterpret_cast<uint4*>(dq_head + t * width + chunk * kChunkElements),
              *reinterpret_cast<const uint4*>(q_tile +
                                              swizzled<kHeadDim>(kWarpRows * warp + row, chunk)));
  }
}

template <class Element, int kHeadDim>
void launch_backward_mma(const CudaContext& ctx, const QkvShape& s, Tensor dqkv, Tensor dout,
                         Tensor qkv, Tensor out, Tensor lse, cudaStream_t stream) {
  using Tile = BackwardTiling<kHeadDim>;
  const int T = static_cast<int>(s.T), NH = static_cast<int>(s.NH), KV = static_cast<int>(s.KV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  auto* dqkv_data = static_cast<Element*>(dqkv.data);
  const auto* dout_data = static_cast<const Element*>(dout.data);
  const auto* qkv_data = static_cast<const Element*>(qkv.data);

  const int64_t rows = s.B * s.T * s.NH;
  Scratch delta(ctx, static_cast<size_t>(rows) * sizeof(float), stream);
  DSTRAIN_LAUNCH((attention_delta_mma_kernel<Element, kHeadDim>),
                 ceil_div(rows, kThreads / Tile::kChunks), kThreads, 0, stream)
  (delta.as<float>(), dout_data, static_cast<const Element*>(out.data), rows, T, NH);
  CUDA_CHECK_LAUNCH();

  allow_shared_memory(attention_dkdv_mma_kernel<Element, kHeadDim>, Tile::kDkdvSharedBytes);
  const dim3 key_grid(ceil_div(s.T, Tile::kKeys), static_cast<unsigned>(s.B * s.KV));
  DSTRAIN_LAUNCH((attention_dkdv_mma_kernel<Element, kHeadDim>), key_grid, kThreads,
                 Tile::kDkdvSharedBytes, stream)
  (dqkv_data, dout_data, qkv_data, lse.f32(), delta.as<float>(), T, NH, KV, scale, scale * kLog2e);
  CUDA_CHECK_LAUNCH();

  allow_shared_memory(attention_dq_mma_kernel<Element, kHeadDim>, Tile::kDqSharedBytes);
  const dim3 query_grid(ceil_div(s.T, kQueryRows), static_cast<unsigned>(s.B * s.NH));
  DSTRAIN_LAUNCH((attention_dq_mma_kernel<Element, kHeadDim>), query_grid, kThreads,
                 Tile::kDqSharedBytes, stream)
  (dqkv_data, dout_data, qkv_data, lse.f32(), delta.as<float>(), T, NH, KV, scale, scale * kLog2e);
  CUDA_CHECK_LAUNCH();
}

template <class Element>
void dispatch_head_dim(const CudaContext& ctx, const QkvShape& s, Tensor dqkv, Tensor dout,
                       Tensor qkv, Tensor out, Tensor lse, cudaStream_t stream) {
  switch (s.hd) {
    case 64:
      return launch_backward_mma<Element, 64>(ctx, s, dqkv, dout, qkv, out, lse, stream);
    case 128:
      return launch_backward_mma<Element, 128>(ctx, s, dqkv, dout, qkv, out, lse, stream);
    default:
      return launch_backward_mma<Element, 256>(ctx, s, dqkv, dout, qkv, out, lse, stream);
  }
}

}  // namespace

bool mma_backward_supports(const QkvShape& s, const Tensor& dqkv, const Tensor& dout,
                           const Tensor& qkv, const Tensor& out) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return mma_forward_supports(s, qkv, out) && dqkv.dtype == qkv.dtype && dout.dtype == qkv.dtype &&
         aligned(dqkv.data) && aligned(dout.data);
}

void attention_backward_mma(const CudaContext& ctx, const QkvShape& s, Tensor dqkv, Tensor dout,
                            Tensor qkv, Tensor out, Tensor lse, cudaStream_t stream) {
  if (qkv.dtype == DType::BF16) {
    dispatch_head_dim<__nv_bfloat16>(ctx, s, dqkv, dout, qkv, out, lse, stream);
  } else {
    dispatch_head_dim<__half>(ctx, s, dqkv, dout, qkv, out, lse, stream);
  }
}

}  // namespace dstrain::cuda::attention
