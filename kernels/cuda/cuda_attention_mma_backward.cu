// Causal self-attention backward on tensor cores, FlashAttention-2 style, for bf16/f16 storage
// and head dims 64, 128, 192, 256 (the forward: cuda_attention_mma.cu; shared pieces:
// cuda_attention_mma_common.cuh). Probabilities are recomputed from q, k and the saved lse; no
// T x T matrix exists. Two kernels, dQ first:
//   1. dQ: a block owns 64 query rows of one (b, query head), 16 per warp (128, 32 per warp, at
//      hd 64 with set_cuda_attention_warp_rows(32)). It first computes
//      delta (B,NH,T) fp32 = rowsum(dO * O) of its rows (dO from its tile, O with 128-bit loads,
//      a fixed-order shuffle sum) and stores it for the dK/dV kernel; then it streams its kv
//      head's key tiles in ascending order: S = Q K^T, P, dP = dO V^T, dS as below, dQ += dS K
//      (K from ldmatrix .trans); scaled at the end. Key tiles past the block's last query are not
//      loaded, n-tiles above a warp's rows not computed; the tiles a warp sees whole take a path
//      without mask or n-tile tests. exp2 is ex2.approx.ftz in both kernels.
//   2. dK, dV: a block of 4 warps owns kKeys = 64 key rows of one (b, kv head) (32 for hd 192
//      and 256, where each 16 key rows belong to 2 warps that split the head-dim columns of dK
//      and dV so that the two (16, 96 or 128) fp32 accumulators fit the registers; 128, 32 per
//      warp, at hd 64
//      with set_cuda_attention_warp_rows(32)). It streams the query tiles
//      that see its keys, of each of the kv head's query heads in ascending order, through two
//      cp.async stages, and per warp and tile:
//        S^T (keys, queries) = K Q^T      (mma: K's rows the A operand, Q's rows B's columns)
//        P^T = exp2(S^T scale log2(e) - lse log2(e)), masked (causal, past T) where a query
//              of the tile is before one of the warp's keys
//        dP^T = V dO^T,  dS^T = P^T * (dP^T - delta)
//        dV += P^T dO,   dK += dS^T Q     (P^T, dS^T rounded to 16 bits: the accumulators' layout
//                                          is the A fragment's; dO, Q from ldmatrix .trans)
//      dK is scaled once at the end. Query tiles wholly above a warp's keys are skipped.
// Packed sequences (positions): query i sees keys [i - positions[b,i], i], in kernels of their
// own (kPacked; without positions both kernels are the plain causal ones, instruction for
// instruction). Sequence starts and ends never decrease along a row. The dQ kernel skips key
// tiles as the forward does (from the tile of its first row's start; per warp, the tiles wholly
// before its first row's start; unmasked only from its last row's start on) and masks keys
// before a row's start. The dK/dV kernel finds the end of each of its keys' sequences (the
// last query that sees the key: a binary search over the row for the block's last key, over
// the block's keys for the others), so its query tiles end at the one holding the block's last
// key's end, a warp skips the tiles past its last key's end, takes the unmasked path only up to
// its first key's end, and masks queries past a key's end. The starts and ends sit in shared
// memory (the dQ block's rows', the dK/dV block's keys'), not in registers.
// dq, dk, dv are written (not accumulated) into dqkv through shared memory with 128-bit stores.
// Deterministic: every sum in a fixed order (the mma's, the loops'), no atomics; dQ has its own
// kernel rather than atomic adds from the dK/dV kernel. Against the CPU twin the results differ
// by P's and dS's rounding to 16 bits (tests/kernels_cuda/attention_mma_backward_test.cpp states
// the bound).
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/cuda_attention_mma.cuh"
#include "kernels/cuda/cuda_attention_mma_common.cuh"

namespace dstrain::cuda::attention {

namespace {

using namespace mma;

// Tile sizes per head dim, and shared memory (16-bit tiles, fp32 lse/delta rows, with packed
// rows int sequence starts or ends), at most the 99 KiB a block may opt in to on sm_86/sm_89.
//
// dK/dV: K, V (kKeys, hd) + 2 stages of Q, dO (kQueries, hd) + 2 stages of lse, delta
// (kQueries): 49 KiB (hd 64), 48.3 KiB (128), 48.3 KiB (192), 64.3 KiB (256) -- 16-row query
// tiles for hd 128 and up keep the S^T, dP^T fragments small next to the (16, 128) dK and dV
// accumulators (16, 96 at hd 192): 229 and 247 registers at hd 128 and 256, no spills (32 rows
// spilled at hd 256). At hd 64 a warp may own 32 key rows
// (kWarpTiles 2, set_cuda_attention_warp_rows): every Q and dO fragment read from shared memory
// then feeds 4 mma instead of 2, with 32-row query tiles for the registers: 48.3 KiB. Packed
// rows add the sequence end of each of the block's keys (int): 128 to 512 B.
template <int kHeadDim, int kWarpTiles>
struct DkdvTiling {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "head dim 64, 128, 192 or 256");
  static_assert(kWarpTiles == 1 || (kWarpTiles == 2 && kHeadDim == 64), "32 key rows: hd 64");
  static constexpr int kStages = 2;
  // Warps per key rows (each owning kHeadDim / kColumnSplit columns of dK, dV).
  static constexpr int kColumnSplit = kHeadDim >= 192 ? 2 : 1;
  static constexpr int kWarpColumns = kHeadDim / kColumnSplit;
  static constexpr int kWarpKeys = kWarpRows * kWarpTiles;                // key rows of a warp
  static constexpr int kKeys = kWarps / kColumnSplit * kWarpKeys;         // key rows of a block
  static constexpr int kQueries = kHeadDim == 64 ? 64 / kWarpTiles : 16;  // rows of a query tile
  static constexpr size_t kSharedBytes =
      static_cast<size_t>(2 * kKeys + 2 * kStages * kQueries) * kHeadDim * 2 +
      2 * kStages * kQueries * sizeof(float);
  static constexpr size_t kPackedSharedBytes = kSharedBytes + kKeys * sizeof(int);
  static_assert(kKeys <= kThreads, "a thread per key's sequence end");
  // Blocks per SM the registers must allow. At hd 64 with 16 key rows per warp on sm_90: 3 (168
  // registers, no spill; its 228 KB of shared memory hold 4 blocks). Unbounded it takes 176
  // registers, 2 blocks, and Nsight Compute on an H200 found it latency-bound there (no warp
  // eligible in 62% of the cycles, against 42% at 3 blocks before the unmasked path). Elsewhere
  // no bound: sm_89's 100 KB of shared memory hold 2 blocks anyway, and it spills at 168.
  // Packed rows' form has no bound (kPackedMinBlocks): at 168 registers its few more live values
  // (the count of query tiles, the sequence ends) spilled a register to local memory in every
  // arrangement tried; unbounded it takes 244 registers on sm_90, 2 blocks per SM.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int kMinBlocks = kHeadDim == 64 && kWarpTiles == 1 ? 3 : 1;
#else
  static constexpr int kMinBlocks = 1;
#endif
  static constexpr int kPackedMinBlocks = 1;
};

// dQ: Q, dO (64, hd) + 2 stages of K, V (kKeys, hd) + delta (64): 48, 64 KiB (hd 64, 128), 96 KiB
// (192 with 32-key tiles, 256 with 16) + 256 B. Q and
// dO fragments kept in registers (hd 64) or read again for each tile. At hd 64 a warp may own 32
// query rows (kWarpTiles 2, set_cuda_attention_warp_rows): each K and V fragment then feeds 4
// mma instead of 2, with 32-key tiles for the registers: 48.5 KiB. Packed rows add the block's
// rows' sequence starts (int): 256 or 512 B.
template <int kHeadDim, int kWarpTiles>
struct DqTiling {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "head dim 64, 128, 192 or 256");
  static_assert(kWarpTiles == 1 || (kWarpTiles == 2 && kHeadDim == 64), "32 query rows: hd 64");
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / kChunkElements;      // 16-byte chunks per row
  static constexpr int kWarpQueryRows = kWarpRows * kWarpTiles;  // query rows of a warp
  static constexpr int kBlockRows = kWarpQueryRows * kWarps;     // query rows of a block
  static constexpr int kKeys = kHeadDim == 64 ? 64 / kWarpTiles : kHeadDim <= 192 ? 32 : 16;
  static constexpr bool kFragmentsInRegisters = kHeadDim == 64;
  static constexpr size_t kSharedBytes =
      static_cast<size_t>(2 * kBlockRows + 2 * kStages * kKeys) * kHeadDim * 2 +
      kBlockRows * sizeof(float);
  static constexpr size_t kPackedSharedBytes = kSharedBytes + kBlockRows * sizeof(int);
  static_assert(kBlockRows <= kThreads, "a thread per block row's sequence start");
};

// delta = rowsum(dO * O) of a warp's kRows query rows [t0, t0 + kRows) of one head: dO from the
// block's swizzled tile (the warp's rows from `row0`), O from global memory with 128-bit loads
// (`out_head` its row 0, rows C elements apart). kChunks lanes per row, 8 products each in order,
// then a butterfly over the row's lanes: a fixed order. At hd 192 a row takes the whole warp,
// its 24 chunks on lanes 0-23 and 0 on the others (the butterfly needs a power of two). Rows at
// or past T get 0 (their dO rows are zero-filled) and are not stored. Each row's sum goes to
// `block_delta[row0 + row]` (shared) and `head_delta[t]` (the (B,NH,T) scratch the dK/dV kernel
// reads).
template <class Element, int kHeadDim, int kRows>
__device__ __forceinline__ void warp_delta(float* block_delta, float* head_delta,
                                           const Element* do_tile, const Element* out_head,
                                           int64_t C, int row0, int t0, int T, int lane) {
  using Core = TensorCore<Element>;
  constexpr int kChunks = kHeadDim / kChunkElements;
  constexpr int kLanesPerRow = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;  // a power of two
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static_assert(kChunks <= 32 && kRows % kRowsPerPass == 0, "whole rows per pass");
  const int chunk = lane % kLanesPerRow;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + lane / kLanesPerRow, t = t0 + row;
    float sum = 0.0f;
    if (t < T && chunk < kChunks) {
      const uint4 out_bits =
          load_128(reinterpret_cast<const uint4*>(out_head + t * C + chunk * kChunkElements));
      const uint4 dout_bits =
          *reinterpret_cast<const uint4*>(do_tile + swizzled<kHeadDim>(row0 + row, chunk));
      Element dout_values[kChunkElements], out_values[kChunkElements];
      memcpy(static_cast<void*>(dout_values), &dout_bits, 16);
      memcpy(static_cast<void*>(out_values), &out_bits, 16);
#pragma unroll
      for (int k = 0; k < kChunkElements; ++k)
        sum += Core::to_float(dout_values[k]) * Core::to_float(out_values[k]);
    }
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (chunk == 0) {
      block_delta[row0 + row] = sum;
      if (t < T) head_delta[t] = sum;
    }
  }
}

// Issues the cp.async copies of one query tile of the dK/dV kernel into `stage` (Q and dO rows
// [q0, q0 + kQueries) of query head h) and stores the tile's lse * log2(e) (+inf past T: P = 0)
// and delta (0 past T) with plain stores: the barrier that publishes the copies publishes them.
template <int kQueries, int kHeadDim, class Element>
__device__ __forceinline__ void load_query_tile(Element* q_tile, Element* do_tile, float* tile_lse,
                                                float* tile_delta, const Element* batch_qkv,
                                                const Element* batch_dout, const float* head_lse,
                                                const float* head_delta, int h, int q0, int T,
                                                int64_t width, int64_t C) {
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

// The last query of a packed batch row (`row_positions`) that sees key j < T: the end of j's
// sequence, the last i >= j whose sequence starts at or before j (starts never decrease along
// a row). Binary search over the row.
__device__ __forceinline__ int sequence_end(const int32_t* row_positions, int j, int T) {
  int lo = j, hi = T;  // start(lo) <= j; hi == T or start(hi) > j
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (mid - row_positions[mid] <= j) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// key_end (kKeys, shared) = the sequence end (the last query that sees it) of each key
// [j0, j0 + kKeys) of a packed batch row, T - 1 past T; returns the block's last key's, the
// greatest. The block's keys' starts go through key_end first: a key in the last key's sequence
// ends where it does (one binary search over the row, by every thread alike); any other key
// ends before the block's last key, at the last key of the block with its start (a binary
// search over the block). Two barriers; the caller's next one publishes key_end.
template <int kKeys>
__device__ __forceinline__ int block_sequence_ends(int* key_end, const int32_t* row_positions,
                                                   int j0, int T) {
  const int last = min(j0 + kKeys, T) - 1 - j0;  // the block's last key before T, from j0
  const int block_end = sequence_end(row_positions, j0 + last, T);
  const int k = threadIdx.x;
  if (k <= last) key_end[k] = sequence_start(row_positions, j0 + k, T);
  __syncthreads();
  int end = T - 1;
  if (k <= last) {
    const int start = key_end[k];
    end = block_end;
    if (key_end[last] != start) {
      int lo = k, hi = last;  // key_end[lo] == start != key_end[hi]
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (key_end[mid] == start) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      end = j0 + lo;
    }
  }
  __syncthreads();  // every thread has read the starts
  if (k < kKeys) key_end[k] = end;
  return block_end;
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

// dK/dV kernel helpers. A warp owns kWarpTiles 16-row tiles of keys (rows (m, r) of a lane:
// warp_key0 + 16 m + group + 8 r) and kColumnTiles 8-column n-tiles of dK and dV.

// P^T and dS^T = P^T (dP^T - delta) in place of S^T and dP^T: query i = q0 + column sees key j
// when j <= i < T (lse +inf past T, so P = 0 there too) and, kPacked, i is not past the end of
// j's sequence (`warp_key_end`: the warp's keys' ends, in shared memory). !kMasked: every query
// of the tile sees every key of the warp (those past T get P = 0 from lse alone).
template <bool kMasked, bool kPacked, int kWarpTiles, int kQueryTiles>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[kWarpTiles][kQueryTiles][4],
                                                     float (&dp)[kWarpTiles][kQueryTiles][4],
                                                     const float* tile_lse, const float* tile_delta,
                                                     const int* warp_key_end, int key0, int q0,
                                                     int T, float scale_log2, int lane) {
  const int group = lane / 4, tig = lane % 4;
  int end[kWarpTiles][2] = {};  // of the lane's key rows (m, r), kPacked
  if constexpr (kMasked && kPacked) {
#pragma unroll
    for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) end[m][r] = warp_key_end[kWarpRows * m + group + 8 * r];
    }
  }
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kQueryTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = 8 * n + 2 * tig + (e & 1);
        const int i = q0 + column, j = key0 + kWarpRows * m + group + 8 * (e / 2);
        const float p = !kMasked || (i >= j && i < T && (!kPacked || i <= end[m][e / 2]))
                            ? exp2_approx_ftz(fmaf(s[m][n][e], scale_log2, -tile_lse[column]))
                            : 0.0f;
        s[m][n][e] = p;
        dp[m][n][e] = p * (dp[m][n][e] - tile_delta[column]);
      }
    }
  }
}

// dV += P^T dO and dK += dS^T Q over the warp's columns (P^T, dS^T rounded to 16 bits: the
// accumulators' layout is the A fragment's; dO, Q from ldmatrix .trans); each fragment pair
// serves every 16-key tile of the warp.
template <class Element, int kHeadDim, int kWarpTiles, int kQueryTiles, int kColumnTiles>
__device__ __forceinline__ void accumulate_dkdv(float (&dk)[kWarpTiles][kColumnTiles][4],
                                                float (&dv)[kWarpTiles][kColumnTiles][4],
                                                const float (&p)[kWarpTiles][kQueryTiles][4],
                                                const float (&ds)[kWarpTiles][kQueryTiles][4],
                                                const Element* q_tile, const Element* do_tile,
                                                int column0, int lane) {
  using Core = TensorCore<Element>;
#pragma unroll
  for (int kk = 0; kk < kQueryTiles / 2; ++kk) {
    uint32_t p_fragment[kWarpTiles][4], ds_fragment[kWarpTiles][4];
#pragma unroll
    for (int m = 0; m < kWarpTiles; ++m) {
      pack_a_fragment<Element>(p_fragment[m], p[m], kk);
      pack_a_fragment<Element>(ds_fragment[m], ds[m], kk);
    }
#pragma unroll
    for (int cp = 0; cp < kColumnTiles / 2; ++cp) {
      uint32_t b0[2], b1[2];
      load_b_pair_trans<kHeadDim>(b0, b1, do_tile, lane, kk, column0 / 16 + cp);
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m) {
        Core::mma(dv[m][2 * cp], p_fragment[m], b0);
        Core::mma(dv[m][2 * cp + 1], p_fragment[m], b1);
      }
      load_b_pair_trans<kHeadDim>(b0, b1, q_tile, lane, kk, column0 / 16 + cp);
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m) {
        Core::mma(dk[m][2 * cp], ds_fragment[m], b0);
        Core::mma(dk[m][2 * cp + 1], ds_fragment[m], b1);
      }
    }
  }
}

// dqkv (B,T,(NH+2KV)*hd): writes the k and v columns of kv head blockIdx.y % KV; dout
// (B,T,NH*hd), qkv (B,T,(NH+2KV)*hd), lse and delta (B,NH,T), positions (B,T) of packed
// sequences (kPacked; else unused). Grid (ceil(T/kKeys), B*KV), kThreads,
// DkdvTiling<kHeadDim, kWarpTiles>::kSharedBytes (kPackedSharedBytes). scale_log2 = scale *
// log2(e).
template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
__global__ void __launch_bounds__(kThreads,
                                  (kPacked ? DkdvTiling<kHeadDim, kWarpTiles>::kPackedMinBlocks
                                           : DkdvTiling<kHeadDim, kWarpTiles>::kMinBlocks))
    attention_dkdv_mma_kernel(Element* dqkv, const Element* dout, const Element* qkv,
                              const float* lse, const float* delta, const int32_t* positions, int T,
                              int NH, int KV, float scale, float scale_log2) {
  using Tile = DkdvTiling<kHeadDim, kWarpTiles>;
  constexpr int kKeys = Tile::kKeys, kQueries = Tile::kQueries;
  constexpr int kQueryTiles = kQueries / 8;             // 8-query n-tiles of S^T, dP^T
  constexpr int kColumnTiles = Tile::kWarpColumns / 8;  // n-tiles of this warp's dK, dV
  constexpr int kStreamElements = kQueries * kHeadDim;

  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* k_tile = reinterpret_cast<Element*>(shared_chunks);    // (kKeys, hd)
  Element* v_tile = k_tile + kKeys * kHeadDim;                    // (kKeys, hd)
  Element* q_tiles = v_tile + kKeys * kHeadDim;                   // (stages, kQueries, hd)
  Element* do_tiles = q_tiles + Tile::kStages * kStreamElements;  // (stages, kQueries, hd)
  float* lse_tiles = reinterpret_cast<float*>(do_tiles + Tile::kStages * kStreamElements);
  float* delta_tiles = lse_tiles + Tile::kStages * kQueries;  // (stages, kQueries) each
  int* key_end = reinterpret_cast<int*>(delta_tiles + Tile::kStages * kQueries);  // kPacked

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j0 = static_cast<int>(blockIdx.x) * kKeys;  // the first key blocks work longest
  const int b = blockIdx.y / KV, kv_head = blockIdx.y % KV, heads_per_kv = NH / KV;
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim, C = int64_t{NH} * kHeadDim;
  const Element* batch_qkv = qkv + int64_t{b} * T * width;
  const Element* batch_dout = dout + int64_t{b} * T * C;
  const int k_column = (NH + kv_head) * kHeadDim, v_column = (NH + KV + kv_head) * kHeadDim;

  const int warp_key0 = Tile::kWarpKeys * (warp / Tile::kColumnSplit);  // in the block
  const int column0 = Tile::kWarpColumns * (warp % Tile::kColumnSplit);
  // Query tiles from the one holding key j0 (earlier queries see none of the block's keys) to
  // the end of the row, or for packed rows to the one holding the end of the block's last key's
  // sequence (later queries belong to later sequences).
  const int first_tile = j0 / kQueries;
  int query_tiles = (T + kQueries - 1) / kQueries - first_tile;
  if constexpr (kPacked) {
    const int block_end = block_sequence_ends<kKeys>(key_end, positions + int64_t{b} * T, j0, T);
    // At least the first (it holds key j0, which sees itself): invalid positions keep the loop.
    query_tiles = max(1, block_end / kQueries + 1 - first_tile);
  }
  const int items = heads_per_kv * query_tiles;  // (head, query tile), heads ascending

  // An item's query head in the kv head's group and query tile from first_tile, stepped by a
  // cursor: no integer division by query_tiles per item (its reciprocal took a register).
  struct Item {
    int head, tile;
  };
  const auto next_item = [&](Item it) {
    return it.tile + 1 < query_tiles ? Item{it.head, it.tile + 1} : Item{it.head + 1, 0};
  };
  const auto load_item = [&](Item it, int stage) {
    const int h = kv_head * heads_per_kv + it.head;
    const int q0 = (first_tile + it.tile) * kQueries;
    const int64_t head_row = (int64_t{b} * NH + h) * T;
    load_query_tile<kQueries, kHeadDim>(
        q_tiles + stage * kStreamElements, do_tiles + stage * kStreamElements,
        lse_tiles + stage * kQueries, delta_tiles + stage * kQueries, batch_qkv, batch_dout,
        lse + head_row, delta + head_row, h, q0, T, width, C);
  };

  load_tile_async<kKeys, kHeadDim>(k_tile, batch_qkv + k_column, width, j0, T);
  load_tile_async<kKeys, kHeadDim>(v_tile, batch_qkv + v_column, width, j0, T);
  load_item({0, 0}, 0);  // its commit covers K and V too

  float dk[kWarpTiles][kColumnTiles][4], dv[kWarpTiles][kColumnTiles][4];  // unscaled dk
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[m][n][e] = dv[m][n][e] = 0.0f;
    }
  }

  Item current{0, 0};
  for (int item = 0; item < items; ++item, current = next_item(current)) {
    const int stage = item % Tile::kStages;
    const int q0 = (first_tile + current.tile) * kQueries;
    cp_async_wait_group<0>();  // this thread's copies of this tile have landed
    // Everyone's have, and every warp is done with the previous tile, whose stage the next
    // tile's loads reuse: one barrier per tile.
    __syncthreads();
    if (item + 1 < items) load_item(next_item(current), (item + 1) % Tile::kStages);
    const Element* q_tile = q_tiles + stage * kStreamElements;
    const Element* do_tile = do_tiles + stage * kStreamElements;

    // Warp-uniform: some query of the tile sees one of this warp's keys, and they are not all
    // past T.
    if (q0 + kQueries <= j0 + warp_key0 || j0 + warp_key0 >= T) continue;
    if constexpr (kPacked) {
      // Packed rows: past the end of the warp's last key's sequence (the greatest end).
      if (q0 > key_end[min(warp_key0 + Tile::kWarpKeys, T - j0) - 1]) continue;
    }
    // S^T = K Q^T and dP^T = V dO^T (the warp's keys, the tile's queries); K's and V's A
    // fragments read from shared memory for each tile (no registers left to keep them).
    float s[kWarpTiles][kQueryTiles][4], dp[kWarpTiles][kQueryTiles][4];
    const uint32_t no_fragments[kWarpTiles][1][4] = {};
    warp_products<false, kHeadDim>(s, no_fragments, k_tile, q_tile, warp_key0, lane, kQueryTiles);
    warp_products<false, kHeadDim>(dp, no_fragments, v_tile, do_tile, warp_key0, lane, kQueryTiles);
    const float* tile_lse = lse_tiles + stage * kQueries;
    const float* tile_delta = delta_tiles + stage * kQueries;
    // The tile's queries see all the keys: causal, and for packed rows its last query before T
    // is not past the end of the warp's first key's sequence (the least end).
    if (q0 >= j0 + warp_key0 + Tile::kWarpKeys - 1 &&
        (!kPacked || min(q0 + kQueries, T) - 1 <= key_end[warp_key0])) {
      probabilities_and_ds<false, kPacked>(s, dp, tile_lse, tile_delta, key_end + warp_key0,
                                           j0 + warp_key0, q0, T, scale_log2, lane);
    } else {
      probabilities_and_ds<true, kPacked>(s, dp, tile_lse, tile_delta, key_end + warp_key0,
                                          j0 + warp_key0, q0, T, scale_log2, lane);
    }
    accumulate_dkdv<Element, kHeadDim>(dk, dv, s, dp, q_tile, do_tile, column0, lane);
  }

  // ---- epilogue: dK * scale and dV through the K and V tiles, 128-bit stores ----
  __syncthreads();  // every warp is done reading K and V
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
    const int row0 = warp_key0 + kWarpRows * m;
    accumulator_to_tile<Element, kHeadDim>(k_tile, dk[m], scale, row0, column0, lane);
    accumulator_to_tile<Element, kHeadDim>(v_tile, dv[m], 1.0f, row0, column0, lane);
  }
  __syncthreads();
  Element* batch_dqkv = dqkv + int64_t{b} * T * width;
  store_tile<kKeys, kHeadDim>(batch_dqkv + k_column, width, k_tile, j0, T);
  store_tile<kKeys, kHeadDim>(batch_dqkv + v_column, width, v_tile, j0, T);
}

// dS = P (dP - delta) in place of S, with P = exp2(S scale log2(e) - lse log2(e)): row i of the
// warp (lane rows (m, r): warp_q0 + 16 m + group + 8 r) sees key j = k0 + column when j <= i
// and j < T (rows past T: lse +inf, P = 0) and, kPacked, j is not before the start of its
// sequence (`row_starts`: the block's rows', in shared memory; the warp's from row0). !kMasked:
// every row of the warp sees every key.
template <bool kMasked, bool kPacked, int kWarpTiles, int kKeyTiles>
__device__ __forceinline__ void ds_in_place(float (&s)[kWarpTiles][kKeyTiles][4],
                                            const float (&dp)[kWarpTiles][kKeyTiles][4],
                                            const float (&row_lse_log2)[kWarpTiles][2],
                                            const float (&row_delta)[kWarpTiles][2],
                                            const int* row_starts, int row0, int warp_q0, int k0,
                                            int T, float scale_log2, int lane) {
  const int group = lane / 4, tig = lane % 4;
  int start[kWarpTiles][2] = {};  // of the lane rows (kPacked)
  if constexpr (kMasked && kPacked) {
#pragma unroll
    for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) start[m][r] = row_starts[row0 + kWarpRows * m + group + 8 * r];
    }
  }
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = k0 + 8 * n + 2 * tig + (e & 1);
        const int r = e / 2, i = warp_q0 + kWarpRows * m + group + 8 * r;
        const float p = !kMasked || (j <= i && j < T && (!kPacked || j >= start[m][r]))
                            ? exp2_approx_ftz(fmaf(s[m][n][e], scale_log2, -row_lse_log2[m][r]))
                            : 0.0f;
        s[m][n][e] = p * (dp[m][n][e] - row_delta[m][r]);
      }
    }
  }
}

// dqkv (B,T,(NH+2KV)*hd): writes the q columns of query head blockIdx.y % NH; dout, qkv, lse,
// positions as above; out (B,T,NH*hd) the forward's output; delta (B,NH,T): written for the
// block's rows (the dK/dV kernel reads it). Grid (ceil(T/kBlockRows), B*NH), kThreads,
// DqTiling<kHeadDim, kWarpTiles>::kSharedBytes (kPackedSharedBytes).
template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
__global__ void __launch_bounds__(kThreads)
    attention_dq_mma_kernel(Element* dqkv, float* delta, const Element* dout, const Element* qkv,
                            const Element* out, const float* lse, const int32_t* positions, int T,
                            int NH, int KV, float scale, float scale_log2) {
  using Tile = DqTiling<kHeadDim, kWarpTiles>;
  constexpr int kKeys = Tile::kKeys, kBlockRows = Tile::kBlockRows;
  constexpr int kWarpQueryRows = Tile::kWarpQueryRows;
  constexpr int kKeyTiles = kKeys / 8;  // 8-key n-tiles of S, dP
  constexpr int kTileElements = kKeys * kHeadDim;
  constexpr bool kInRegisters = Tile::kFragmentsInRegisters;

  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* q_tile = reinterpret_cast<Element*>(shared_chunks);  // (kBlockRows, hd)
  Element* do_tile = q_tile + kBlockRows * kHeadDim;            // (kBlockRows, hd)
  Element* k_tiles = do_tile + kBlockRows * kHeadDim;           // (stages, kKeys, hd)
  Element* v_tiles = k_tiles + Tile::kStages * kTileElements;   // (stages, kKeys, hd)
  float* block_delta = reinterpret_cast<float*>(v_tiles + Tile::kStages * kTileElements);
  int* row_starts = reinterpret_cast<int*>(block_delta + kBlockRows);  // (kBlockRows), kPacked

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane / 4;
  // The last query blocks have the most key tiles: launched first, they do not trail the grid.
  const int q0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kBlockRows;
  const int b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim, C = int64_t{NH} * kHeadDim;
  const Element* batch_qkv = qkv + int64_t{b} * T * width;
  const Element* k_head = batch_qkv + (NH + kv_head) * kHeadDim;
  const Element* v_head = batch_qkv + (NH + KV + kv_head) * kHeadDim;

  const int row0 = kWarpQueryRows * warp;  // this warp's first row in the block's tiles
  const int warp_q0 = q0 + row0;           // and its first query row
  const int key_tiles = (min(q0 + kBlockRows, T) + kKeys - 1) / kKeys;  // keys the block sees
  // Packed rows: key tiles from the one holding the start of the block's first row's sequence,
  // tiles wholly before the warp's least start skipped, whole tiles only from its greatest on:
  // as the forward (cuda_attention_mma.cu). The block's rows' starts go to shared memory,
  // published by the barrier before delta. Without positions, tile 0.
  int first_tile = 0;
  if constexpr (kPacked) {
    first_tile = packed_block_starts<kBlockRows, kKeys>(positions, b, q0, T, row_starts);
  }

  const int64_t head_row = (int64_t{b} * NH + h) * T;  // of lse and delta
  load_tile_async<kBlockRows, kHeadDim>(q_tile, batch_qkv + h * kHeadDim, width, q0, T);
  load_tile_async<kBlockRows, kHeadDim>(do_tile, dout + int64_t{b} * T * C + h * kHeadDim, C, q0,
                                        T);
  cp_async_commit_group();
  const int first_stage = first_tile % Tile::kStages;
  load_tile_async<kKeys, kHeadDim>(k_tiles + first_stage * kTileElements, k_head, width,
                                   first_tile * kKeys, T);
  load_tile_async<kKeys, kHeadDim>(v_tiles + first_stage * kTileElements, v_head, width,
                                   first_tile * kKeys, T);
  cp_async_commit_group();

  float row_lse_log2[kWarpTiles][2], row_delta[kWarpTiles][2];  // +inf and 0 past T: P = 0
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = warp_q0 + kWarpRows * m + group + 8 * r;
      row_lse_log2[m][r] = t < T ? lse[head_row + t] * kLog2e : INFINITY;
    }
  }
  // delta of the warp's rows while the first K and V tiles stream in: dO's copies (the first
  // group) by every thread have landed after the barrier.
  cp_async_wait_group<1>();
  __syncthreads();
  warp_delta<Element, kHeadDim, kWarpQueryRows>(block_delta, delta + head_row, do_tile,
                                                out + int64_t{b} * T * C + h * kHeadDim, C, row0,
                                                warp_q0, T, lane);
  __syncwarp();
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_delta[m][r] = block_delta[row0 + kWarpRows * m + group + 8 * r];
  }

  constexpr int kFragmentSteps = kInRegisters ? kHeadDim / 16 : 1;
  uint32_t q_fragments[kWarpTiles][kFragmentSteps][4], do_fragments[kWarpTiles][kFragmentSteps][4];
  float dq[kWarpTiles][kHeadDim / 8][4];  // unscaled
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      dq[m][n][0] = dq[m][n][1] = dq[m][n][2] = dq[m][n][3] = 0.0f;
  }

  for (int tile = first_tile; tile < key_tiles; ++tile) {
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
      if (tile == first_tile) {
        load_warp_fragments<kHeadDim>(q_fragments, q_tile, row0, lane);
        load_warp_fragments<kHeadDim>(do_fragments, do_tile, row0, lane);
      }
    }
    if constexpr (kPacked) {
      // Wholly before the sequence of the warp's first row (the least start): warp-uniform.
      if (k0 + kKeys <= row_starts[row0]) continue;
    }

    // dS for n-tiles [0, active_tiles), masked or not, then dQ += dS K.
    const auto key_tile = [&](auto masked, int active_tiles) {
      float s[kWarpTiles][kKeyTiles][4], dp[kWarpTiles][kKeyTiles][4];
      // S = Q K^T, dP = dO V^T
      warp_products<kInRegisters, kHeadDim>(s, q_fragments, q_tile, k_tile, row0, lane,
                                            active_tiles);
      warp_products<kInRegisters, kHeadDim>(dp, do_fragments, do_tile, v_tile, row0, lane,
                                            active_tiles);
      ds_in_place<decltype(masked)::value, kPacked>(s, dp, row_lse_log2, row_delta, row_starts,
                                                    row0, warp_q0, k0, T, scale_log2, lane);
      warp_accumulate_product<Element, kHeadDim>(dq, s, k_tile, lane, active_tiles);
    };
    // Packed rows: the tiles from the start of the warp's last row's sequence (the greatest) on.
    if (warp_q0 < T && k0 + kKeys - 1 <= warp_q0 && k0 + kKeys <= T &&
        (!kPacked || k0 >= row_starts[min(row0 + kWarpQueryRows, T - q0) - 1])) {
      key_tile(std::false_type{}, kKeyTiles);  // every row sees every key: as the forward
      continue;
    }
    // 8-key n-tiles with a key that some row of this warp sees (warp-uniform), as the forward.
    const int seen = warp_q0 < T ? min(warp_q0 + kWarpQueryRows, T) - k0 : 0;
    const int active_tiles = min(kKeyTiles, (max(seen, 0) + 7) / 8);
    if (active_tiles == 0) continue;
    key_tile(std::true_type{}, active_tiles);
  }

  // ---- epilogue: dQ * scale through this warp's own Q rows (only it reads them), 128-bit
  // stores ----
  __syncwarp();
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m)
    accumulator_to_tile<Element, kHeadDim>(q_tile, dq[m], scale, row0 + kWarpRows * m, 0, lane);
  __syncwarp();
  constexpr int kChunks = Tile::kChunks;
  Element* dq_head = dqkv + int64_t{b} * T * width + h * kHeadDim;
#pragma unroll
  for (int k = 0; k < kWarpQueryRows * kChunks / 32; ++k) {
    const int idx = lane + 32 * k;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const int t = warp_q0 + row;
    if (t >= T) continue;
    store_128(reinterpret_cast<uint4*>(dq_head + t * width + chunk * kChunkElements),
              *reinterpret_cast<const uint4*>(q_tile + swizzled<kHeadDim>(row0 + row, chunk)));
  }
}

// The launch arguments both kernels share.
template <class Element>
struct BackwardArgs {
  Element* dqkv;
  const Element *dout, *qkv, *out;
  const float* lse;
  float* delta;              // (B,NH,T) scratch: the dQ kernel writes it, the dK/dV kernel reads it
  const int32_t* positions;  // (B,T), or nullptr: one causal sequence per row
  int B, T, NH, KV;
  float scale, scale_log2;
};

template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
void launch_dq(const BackwardArgs<Element>& a, cudaStream_t stream) {
  using Tile = DqTiling<kHeadDim, kWarpTiles>;
  constexpr size_t kShared = kPacked ? Tile::kPackedSharedBytes : Tile::kSharedBytes;
  allow_shared_memory(attention_dq_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>, kShared);
  const dim3 grid(ceil_div(a.T, Tile::kBlockRows), static_cast<unsigned>(a.B * a.NH));
  DSTRAIN_LAUNCH((attention_dq_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>), grid, kThreads,
                 kShared, stream)
  (a.dqkv, a.delta, a.dout, a.qkv, a.out, a.lse, a.positions, a.T, a.NH, a.KV, a.scale,
   a.scale_log2);
  CUDA_CHECK_LAUNCH();
}

template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
void launch_dkdv(const BackwardArgs<Element>& a, cudaStream_t stream) {
  using Tile = DkdvTiling<kHeadDim, kWarpTiles>;
  constexpr size_t kShared = kPacked ? Tile::kPackedSharedBytes : Tile::kSharedBytes;
  allow_shared_memory(attention_dkdv_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>, kShared);
  const dim3 grid(ceil_div(a.T, Tile::kKeys), static_cast<unsigned>(a.B * a.KV));
  DSTRAIN_LAUNCH((attention_dkdv_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>), grid,
                 kThreads, kShared, stream)
  (a.dqkv, a.dout, a.qkv, a.lse, a.delta, a.positions, a.T, a.NH, a.KV, a.scale, a.scale_log2);
  CUDA_CHECK_LAUNCH();
}

// dQ first: it computes delta from the dO rows it loads anyway, for the dK/dV kernel.
template <class Element, int kHeadDim, bool kPacked>
void launch_backward_mma(const BackwardArgs<Element>& a, cudaStream_t stream) {
  if constexpr (kHeadDim == 64) {
    if (attention_warp_rows() == 32) {
      launch_dq<Element, 64, 2, kPacked>(a, stream);
      return launch_dkdv<Element, 64, 2, kPacked>(a, stream);
    }
  }
  launch_dq<Element, kHeadDim, 1, kPacked>(a, stream);
  launch_dkdv<Element, kHeadDim, 1, kPacked>(a, stream);
}

// Packed rows (positions) take the kernels' kPacked forms.
template <class Element, int kHeadDim>
void launch_backward_mma(const BackwardArgs<Element>& a, cudaStream_t stream) {
  if (a.positions != nullptr) return launch_backward_mma<Element, kHeadDim, true>(a, stream);
  launch_backward_mma<Element, kHeadDim, false>(a, stream);
}

template <class Element>
void dispatch_head_dim(const CudaContext& ctx, const QkvShape& s, Tensor dqkv, Tensor dout,
                       Tensor qkv, Tensor out, Tensor lse, const int32_t* positions,
                       cudaStream_t stream) {
  Scratch delta(ctx, static_cast<size_t>(s.B * s.NH * s.T) * sizeof(float), stream);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  const BackwardArgs<Element> a{static_cast<Element*>(dqkv.data),
                                static_cast<const Element*>(dout.data),
                                static_cast<const Element*>(qkv.data),
                                static_cast<const Element*>(out.data),
                                lse.f32(),
                                delta.as<float>(),
                                positions,
                                static_cast<int>(s.B),
                                static_cast<int>(s.T),
                                static_cast<int>(s.NH),
                                static_cast<int>(s.KV),
                                scale,
                                scale * kLog2e};
  switch (s.hd) {
    case 64:
      return launch_backward_mma<Element, 64>(a, stream);
    case 128:
      return launch_backward_mma<Element, 128>(a, stream);
    case 192:
      return launch_backward_mma<Element, 192>(a, stream);
    default:
      return launch_backward_mma<Element, 256>(a, stream);
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
                            Tensor qkv, Tensor out, Tensor lse, const int32_t* positions,
                            cudaStream_t stream) {
  if (qkv.dtype == DType::BF16) {
    dispatch_head_dim<__nv_bfloat16>(ctx, s, dqkv, dout, qkv, out, lse, positions, stream);
  } else {
    dispatch_head_dim<__half>(ctx, s, dqkv, dout, qkv, out, lse, positions, stream);
  }
}

}  // namespace dstrain::cuda::attention
