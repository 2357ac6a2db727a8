// Shared by the tensor-core attention kernels (cuda_attention_mma.cu, the forward;
// cuda_attention_mma_backward.cu, the backward): the block shape, the mma and 16-bit packing of
// each storage type, the swizzled shared-memory tiles and their cp.async loads. Device code:
// include it from .cu files only, after cuda_ptx.cuh's requirements (nvcc or the emulator).
//
// Shared-memory tiles are (rows, hd) of 16-bit elements with the 16-byte chunks of row r stored
// at chunk ^ (r % 8): the 8 rows an ldmatrix matrix reads (and the cp.async copies of 8 adjacent
// chunks) then fall in 8 different groups of 4 banks, without padding. The head dims (64, 128,
// 192, 256) are whole 128-byte lines of 8 chunks, so the XOR stays inside a row's line.
#pragma once

#include <cstring>

#include "kernels/cuda/cuda_attention.cuh"
#include "kernels/cuda/cuda_ptx.cuh"

namespace dstrain::cuda::attention::mma {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpRows = 16;      // rows per warp: the mma's M
constexpr int kChunkElements = 8;  // 16-bit elements per 16-byte chunk
constexpr float kLog2e = 1.4426950408889634f;

// The mma and the fp32 -> 16-bit pair conversion of each storage type.
template <class Element>
struct TensorCore;
template <>
struct TensorCore<__nv_bfloat16> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    mma_m16n8k16_bf16(d, a, b, d);
  }
  // (low, high) rounded to nearest even, low in the low half: one cvt.rn.bf16x2.f32.
  __device__ __forceinline__ static uint32_t pack(float low, float high) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    uint32_t bits;
    memcpy(&bits, &pair, 4);
    return bits;
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <>
struct TensorCore<__half> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    mma_m16n8k16_f16(d, a, b, d);
  }
  __device__ __forceinline__ static uint32_t pack(float low, float high) {
    const __half2 pair = __floats2half2_rn(low, high);
    uint32_t bits;
    memcpy(&bits, &pair, 4);
    return bits;
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
};

// The first key query row i of a packed batch row sees: the start of its sequence, i -
// positions[b, i] (`row_positions` the batch row's (T) positions, kernels/ops.h); 0 for rows at
// or past T. Nondecreasing in i for valid positions: a tile's first row has the least start,
// its last row before T the greatest.
__device__ __forceinline__ int sequence_start(const int32_t* row_positions, int i, int T) {
  return i < T ? i - row_positions[i] : 0;
}

// Packed rows, for a block of kBlockRows query rows from q0 of batch row b: its rows' sequence
// starts into row_starts (shared; the caller's next barrier publishes them), and the first key
// tile any of them sees: the one holding its first row's start (the starts never decrease along
// a row), clamped to [0, q0] so that invalid positions stay inside the tensors.
template <int kBlockRows, int kKeys>
__device__ __forceinline__ int packed_block_starts(const int32_t* positions, int b, int q0, int T,
                                                   int* row_starts) {
  const int32_t* row_positions = positions + int64_t{b} * T;
  if (threadIdx.x < kBlockRows) {
    row_starts[threadIdx.x] = sequence_start(row_positions, q0 + threadIdx.x, T);
  }
  return max(0, min(sequence_start(row_positions, q0, T), q0)) / kKeys;
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled (rows, kHeadDim) tile.
template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kHeadDim + (chunk ^ (row & 7)) * kChunkElements;
}

// Issues the cp.async copies of rows [first_row, first_row + kRows) of one head slice into
// `tile` (kRows, kHeadDim), swizzled; rows at or past T are zero-filled (src-size 0, from row 0
// of the slice: a valid address that is not read). `head` is the slice's row 0, rows `width`
// elements apart. A thread copies one chunk column, every kThreads / kChunks rows: a loop of
// known length, unrolled, from one source address stepped by a fixed stride (the copies of a
// tile cost a few instructions each, not a loop test and a 64-bit multiply).
//
// At hd 192 (24 chunks a row, not a divisor of kThreads) a thread's chunks are every kThreads-th
// of the tile's, row by row: its column and row step change along the loop (still unrolled).
template <int kRows, int kHeadDim, class Element>
__device__ __forceinline__ void load_tile_async(Element* tile, const Element* head, int64_t width,
                                                int first_row, int T) {
  constexpr int kChunks = kHeadDim / kChunkElements;
  if constexpr (kThreads % kChunks != 0) {
    static_assert(kRows * kChunks % kThreads == 0, "a whole tile in kThreads-chunk passes");
#pragma unroll
    for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
      const int index = threadIdx.x + i * kThreads;
      const int row = index / kChunks, chunk = index % kChunks;
      const bool inside = first_row + row < T;
      const Element* column = head + chunk * kChunkElements;
      cp_async_cg_16_zfill(tile + swizzled<kHeadDim>(row, chunk),
                           inside ? column + (first_row + row) * width : column, inside ? 16 : 0);
    }
  } else {
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "a whole tile per pass");
    const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
    const Element* column = head + chunk * kChunkElements;
    const Element* source = column + (first_row + row0) * width;
    const int64_t stride = kRowStep * width;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const int row = row0 + i * kRowStep;
      const bool inside = first_row + row < T;
      cp_async_cg_16_zfill(tile + swizzled<kHeadDim>(row, chunk),
                           inside ? source + i * stride : column, inside ? 16 : 0);
    }
  }
}

// The A fragment (or, read as B of a .col operand, two n-tiles' B fragments -- see
// load_b_pair) of rows [row0, row0 + 16) of a swizzled tile for columns [16 kk, 16 kk + 16):
// matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15) in the order a0a1, a2a3, a4a5, a6a7.
template <int kHeadDim, class Element>
__device__ __forceinline__ void load_a_fragment(uint32_t (&a)[4], const Element* tile, int row0,
                                                int lane, int kk) {
  const int matrix = lane / 8;
  const int row = row0 + lane % 8 + 8 * (matrix % 2);
  ldmatrix<4>(a, tile + swizzled<kHeadDim>(row, 2 * kk + matrix / 2));
}

// B fragments of n-tiles (2 np, 2 np + 1) of X^T for a tile X whose rows are B's columns (.col:
// K in Q K^T): matrices (rows 16 np + 0-7 | 8-15) x (columns 16 kk + 0-7 | 8-15).
template <int kHeadDim, class Element>
__device__ __forceinline__ void load_b_pair(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                            const Element* tile, int lane, int np, int kk) {
  const int matrix = lane / 8;
  const int row = 16 * np + lane % 8 + 8 * (matrix / 2);
  uint32_t regs[4];
  ldmatrix<4>(regs, tile + swizzled<kHeadDim>(row, 2 * kk + matrix % 2));
  b0[0] = regs[0], b0[1] = regs[1], b1[0] = regs[2], b1[1] = regs[3];
}

// B fragments of column n-tiles (2 dp, 2 dp + 1) of a tile X whose rows are B's rows (k = the
// row: V in P V), for k-step kk (rows 16 kk + 0-15): ldmatrix .trans.
template <int kHeadDim, class Element>
__device__ __forceinline__ void load_b_pair_trans(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                                  const Element* tile, int lane, int kk, int dp) {
  const int matrix = lane / 8;
  const int row = 16 * kk + lane % 8 + 8 * (matrix % 2);
  uint32_t regs[4];
  ldmatrix<4, true>(regs, tile + swizzled<kHeadDim>(row, 2 * dp + matrix / 2));
  b0[0] = regs[0], b0[1] = regs[1], b1[0] = regs[2], b1[1] = regs[3];
}

// The A fragment of k-step kk (16 keys) from an (16, 8 n) accumulator s (P, dS) rounded to 16
// bits: the accumulator's layout IS the A fragment's.
template <class Element, int kTiles>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&a)[4], const float (&s)[kTiles][4],
                                                int kk) {
  using Core = TensorCore<Element>;
  a[0] = Core::pack(s[2 * kk][0], s[2 * kk][1]);
  a[1] = Core::pack(s[2 * kk][2], s[2 * kk][3]);
  a[2] = Core::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = Core::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The A fragments of every k-step of a warp's kWarpTiles 16-row tiles (rows row0 + 16 m of a
// swizzled tile), to keep in registers across streamed tiles.
template <int kHeadDim, class Element, int kWarpTiles>
__device__ __forceinline__ void load_warp_fragments(
    uint32_t (&fragments)[kWarpTiles][kHeadDim / 16][4], const Element* tile, int row0, int lane) {
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      load_a_fragment<kHeadDim>(fragments[m][kk], tile, row0 + 16 * m, lane, kk);
  }
}

// acc (16 kWarpTiles rows, 8 kTiles columns) = X Y^T over the head dim, for a warp's rows of X
// (rows row0 + 16 m of a swizzled tile: Q, dO) against the rows of a streamed tile Y (K, V),
// which are B's columns (.col); only the n-tiles [0, active_tiles), the others stay 0. X's A
// fragments come from `fragments` (kFromRegisters: load_warp_fragments) or from x_tile. Each Y
// fragment pair serves every 16-row tile of the warp.
template <bool kFromRegisters, int kHeadDim, class Element, int kWarpTiles, int kTiles, int kSteps>
__device__ __forceinline__ void warp_products(float (&acc)[kWarpTiles][kTiles][4],
                                              const uint32_t (&fragments)[kWarpTiles][kSteps][4],
                                              const Element* x_tile, const Element* y_tile,
                                              int row0, int lane, int active_tiles) {
  static_assert(!kFromRegisters || kSteps == kHeadDim / 16, "a fragment per k-step");
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
      acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
  }
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[kWarpTiles][4];
#pragma unroll
    for (int m = 0; m < kWarpTiles; ++m) {
      if constexpr (kFromRegisters) {
        for (int i = 0; i < 4; ++i) a[m][i] = fragments[m][kk][i];
      } else {
        load_a_fragment<kHeadDim>(a[m], x_tile, row0 + 16 * m, lane, kk);
      }
    }
#pragma unroll
    for (int np = 0; np < kTiles / 2; ++np) {
      if (2 * np >= active_tiles) continue;
      uint32_t b0[2], b1[2];
      load_b_pair<kHeadDim>(b0, b1, y_tile, lane, np, kk);
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m) {
        TensorCore<Element>::mma(acc[m][2 * np], a[m], b0);
        TensorCore<Element>::mma(acc[m][2 * np + 1], a[m], b1);
      }
    }
  }
}

// acc (16 kWarpTiles rows, hd) += P Y over the k-steps with an active n-tile of P: P (rows,
// 8 kTiles) an fp32 accumulator (P, dS), rounded to 16 bits as the A operand (its layout is the
// A fragment's); Y a streamed tile (V, K) whose rows are B's rows (ldmatrix .trans). Each Y
// fragment pair serves every 16-row tile of the warp. O += P V, dQ += dS K.
template <class Element, int kHeadDim, int kWarpTiles, int kTiles>
__device__ __forceinline__ void warp_accumulate_product(float (&acc)[kWarpTiles][kHeadDim / 8][4],
                                                        const float (&p)[kWarpTiles][kTiles][4],
                                                        const Element* y_tile, int lane,
                                                        int active_tiles) {
#pragma unroll
  for (int kk = 0; kk < kTiles / 2; ++kk) {
    if (2 * kk >= active_tiles) continue;
    uint32_t a[kWarpTiles][4];
#pragma unroll
    for (int m = 0; m < kWarpTiles; ++m) pack_a_fragment<Element>(a[m], p[m], kk);
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      uint32_t b0[2], b1[2];
      load_b_pair_trans<kHeadDim>(b0, b1, y_tile, lane, kk, dp);
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m) {
        TensorCore<Element>::mma(acc[m][2 * dp], a[m], b0);
        TensorCore<Element>::mma(acc[m][2 * dp + 1], a[m], b1);
      }
    }
  }
}

}  // namespace dstrain::cuda::attention::mma
