// Causal self-attention forward on tensor cores, FlashAttention-2 style, for bf16/f16 storage.
//
// A block of 4 warps owns 64 query rows of one (b, query head), 16 per warp (or 128, 32 per
// warp, at head dims 64 and 128: set_cuda_attention_warp_rows), and streams its kv head's key
// and value rows through shared memory in tiles of kKeys rows:
//   - cp.async (16 bytes per copy, .cg: a tile is read once per block) fills a tile while the
//     previous one is being used: two stages, one commit group per tile;
//   - S (16, kKeys) = Q K^T per 16-row tile of a warp with mma.sync m16n8k16 (fp32
//     accumulators), Q fragments from ldmatrix (once, kept in registers, for hd 64 and for hd
//     128 at 16 rows per warp; otherwise read again for each tile, to leave the registers to
//     the fp32 output accumulator);
//   - the online softmax on the accumulator fragments: a lane holds two rows (groupID and
//     groupID + 8) of every 8-key n-tile, the row max is reduced over the 4 lanes of a quad with
//     shuffles, exp2 (ex2.approx.ftz: one MUFU.EX2 each) with log2(e) folded into the scale;
//   - P, rounded to 16 bits in registers, is the A operand of O += P V (the S accumulator's
//     layout IS the A fragment's layout), V's B fragments from ldmatrix .trans;
//   - key tiles past the block's last query are never loaded, n-tiles above a warp's rows are
//     skipped (their probabilities are 0), the diagonal and the ragged end (keys >= T,
//     zero-filled by cp.async) are masked; the tiles that every row of a warp sees whole (all
//     but its last one or two) take a code path with neither mask nor n-tile tests;
//   - the output goes through shared memory (the warp's own Q rows) and leaves with 128-bit
//     stores; lse = max * scale + log(sum), natural log, as the fp32 kernel and the backward use;
//   - packed sequences (positions): row i sees keys [i - positions[b,i], i], in a kernel of its
//     own (kPacked; without positions the kernel is the plain causal one, instruction for
//     instruction). Sequence starts never decrease along a row, so the block's key tiles begin
//     at the one holding its first row's start (the tiles before it are not loaded), a warp
//     skips the tiles wholly before its first row's start, and only tiles from its last row's
//     start on take the unmasked path; the masked path also masks the keys before a row's start
//     (the block's row starts sit in shared memory: no registers for them). A row may see no
//     key of a tile its warp computes (its sequence starts in a later one): its max stays -inf
//     there and 0 stands in for it in the exponents.
// Shared-memory tiles: swizzled (rows, hd), see cuda_attention_mma_common.cuh.
//
// Deterministic: every sum runs in a fixed order (the mma's, the quad's butterfly), no atomics.
// Against the CPU twin the output differs by P's rounding to 16 bits (tests/kernels_cuda/
// attention_mma_test.cpp states the bound).
#include <cmath>
#include <cstring>

#include "kernels/cuda/cuda_attention_mma.cuh"
#include "kernels/cuda/cuda_attention_mma_common.cuh"

namespace dstrain::cuda::attention {

int& attention_warp_rows() {
  static int rows = 16;
  return rows;
}

namespace {

using namespace mma;

// Tile sizes per head dim and query rows per warp (kWarpTiles 16-row mma tiles: 16 or 32 rows).
// Shared memory: (block rows + 2 stages * 2 * kKeys) rows of hd 16-bit elements: 40 KiB (hd 64),
// 80 KiB (128), 72 KiB (192) and 96 KiB (256; both with 32-key tiles) at 16 rows per warp;
// 48 KiB (hd 64) and 64 KiB (128, with 32-key tiles) at 32; packed rows add a sequence start
// (int) per block row, 256 or 512 B -- at most the 99 KiB a block may opt in to on sm_86/sm_89.
//
// 32 rows per warp: every K and V fragment that ldmatrix brings from shared memory feeds 4 mma
// instead of 2 (on an H100 an ldmatrix.x4 takes about as long on the shared-memory pipe as two
// m16n8k16 on the tensor cores), for twice the accumulator registers: hd 64 and 128 only.
template <int kHeadDim, int kWarpTiles>
struct Tiling {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "head dim 64, 128, 192 or 256");
  static_assert(kWarpTiles == 1 || (kWarpTiles == 2 && kHeadDim <= 128), "32 rows: hd <= 128");
  static constexpr int kWarpQueryRows = kWarpRows * kWarpTiles;  // query rows of a warp
  static constexpr int kBlockRows = kWarpQueryRows * kWarps;     // query rows of a block
  // Rows of a streamed K or V tile.
  static constexpr int kKeys = kHeadDim * kWarpTiles <= 128 ? 64 : 32;
  static constexpr int kStages = 2;
  // Q's A fragments kept in registers across key tiles, or read again for each.
  static constexpr bool kQInRegisters = kHeadDim * kWarpTiles <= 128;
  static constexpr int kChunks = kHeadDim / kChunkElements;  // 16-byte chunks per row
  static constexpr size_t kSharedBytes =
      static_cast<size_t>(kBlockRows + 2 * kStages * kKeys) * kHeadDim * 2;
  static constexpr size_t kPackedSharedBytes = kSharedBytes + kBlockRows * sizeof(int);
  static_assert(kBlockRows <= kThreads, "a thread per block row's sequence start");
  // Blocks per SM the registers must allow: at hd 64 and 16 rows per warp, 4 (at most 128
  // registers), what the 40 KiB of shared memory allows too.
  static constexpr int kMinBlocks = kHeadDim == 64 && kWarpTiles == 1 ? 4 : 1;
};

// The running state of a warp's rows: lane rows (m, r) = warp_q0 + 16 m + group + 8 r.
template <int kHeadDim, int kWarpTiles>
struct WarpRows {
  float o[kWarpTiles][kHeadDim / 8][4];  // O (16 kWarpTiles, hd), unnormalized
  float max[kWarpTiles][2];              // of the unscaled scores
  float sum[kWarpTiles][2];              // this lane's part; the quad's sum at the end
};

// -inf for the keys of the tile (from k0) a row does not see: after it (causal), at or past T
// (zero-filled), and (kPacked) before its sequence's start: `row_starts` (shared) holds the
// block's rows' starts, the warp's rows from `row0`.
template <bool kPacked, int kWarpTiles, int kKeyTiles>
__device__ __forceinline__ void mask_scores(float (&s)[kWarpTiles][kKeyTiles][4],
                                            const int* row_starts, int row0, int warp_q0, int k0,
                                            int T, int lane) {
  const int group = lane / 4, tig = lane % 4;
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The last key of the tile row (m, r) sees, relative to k0.
      const int last_seen = min(warp_q0 + kWarpRows * m + group + 8 * r, T - 1) - k0;
      // and the first (packed rows)
      const int first_seen = kPacked ? row_starts[row0 + kWarpRows * m + group + 8 * r] - k0 : 0;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int key = 8 * n + 2 * tig + (e & 1);
          if (key > last_seen || (kPacked && key < first_seen)) s[m][n][e] = -INFINITY;
        }
      }
    }
  }
}

// The online softmax over one key tile: the new row maxima, O and the sums rescaled to them,
// S replaced by P = exp2(S scale log2(e) - max scale log2(e)) (-inf -> 0), added to the sums.
// kMayBeEmpty (masked tiles of packed rows): a row may have seen no key yet, in this tile or
// before (its sequence starts in a later tile than another row's of the warp).
template <bool kMayBeEmpty, class State, int kWarpTiles, int kKeyTiles>
__device__ __forceinline__ void online_softmax(State& state, float (&s)[kWarpTiles][kKeyTiles][4],
                                               float scale_log2) {
  constexpr int kDimTiles = sizeof(state.o[0]) / sizeof(state.o[0][0]);
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = state.max[m][r];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
        tile_max = fmaxf(tile_max, fmaxf(s[m][n][2 * r], s[m][n][2 * r + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // A row that has seen no key keeps max -inf; 0 stands in for it here, so that P =
      // exp2(-inf - 0) = 0 and the correction exp2(-inf) = 0, not exp2(-inf + inf) = NaN. The
      // row's first key sets a finite max; the sums and O stay 0 until then.
      const float max_scaled = kMayBeEmpty && tile_max == -INFINITY ? 0.0f : tile_max * scale_log2;
      const float correction =  // 0 on the row's first tile with a key
          exp2_approx_ftz(state.max[m][r] * scale_log2 - max_scaled);
      state.max[m][r] = tile_max;
      state.sum[m][r] *= correction;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        state.o[m][n][2 * r] *= correction;
        state.o[m][n][2 * r + 1] *= correction;
      }
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[m][n][e] = exp2_approx_ftz(fmaf(s[m][n][e], scale_log2, -max_scaled));  // -inf -> 0
          state.sum[m][r] += s[m][n][e];
        }
      }
    }
  }
}

// One key tile for a warp's rows: S = Q K^T over the n-tiles [0, active_tiles) (the others lie
// past every row's last key), masked (kMasked: the diagonal, T, with kPacked the sequence
// starts in row_starts) or not (every row sees every key), the online softmax, O += P V.
template <bool kMasked, bool kPacked, class Tile, class Element, class State, class Fragments>
__device__ __forceinline__ void attend_key_tile(State& state, const Fragments& q_fragments,
                                                const Element* q_tile, const Element* k_tile,
                                                const Element* v_tile, const int* row_starts,
                                                int row0, int warp_q0, int k0, int T,
                                                int active_tiles, float scale_log2, int lane) {
  constexpr int kHeadDim = Tile::kChunks * kChunkElements;
  constexpr int kWarpTiles = Tile::kWarpQueryRows / kWarpRows;
  float s[kWarpTiles][Tile::kKeys / 8][4];
  // S = Q K^T (unscaled)
  warp_products<Tile::kQInRegisters, kHeadDim>(s, q_fragments, q_tile, k_tile, row0, lane,
                                               active_tiles);
  if constexpr (kMasked) mask_scores<kPacked>(s, row_starts, row0, warp_q0, k0, T, lane);
  online_softmax<kMasked && kPacked>(state, s, scale_log2);
  // O += P V
  warp_accumulate_product<Element, kHeadDim>(state.o, s, v_tile, lane, active_tiles);
}

// The warp's rows leave: lse = max * scale + log(sum) (natural log, as the fp32 kernel and the
// backward use), O / sum through the warp's own Q rows of shared memory (only this warp read
// them) and 128-bit stores. `o_tile` is the block's Q tile, `row0` the warp's first row in it.
template <class Tile, class Element, class State>
__device__ __forceinline__ void store_warp_rows(Element* out_head, int64_t C, float* lse_head,
                                                Element* o_tile, const State& state, int row0,
                                                int warp_q0, int T, float scale, int lane) {
  using Core = TensorCore<Element>;
  constexpr int kHeadDim = Tile::kChunks * kChunkElements;
  constexpr int kWarpTiles = Tile::kWarpQueryRows / kWarpRows;
  const int group = lane / 4, tig = lane % 4;
  float inv_sum[kWarpTiles][2];
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = state.sum[m][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv_sum[m][r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: a warp entirely past T computed nothing
      const int t = warp_q0 + kWarpRows * m + group + 8 * r;
      if (tig == 0 && t < T) lse_head[t] = state.max[m][r] * scale + logf(sum);
    }
  }
  // Every lane must be past its last ldmatrix of these rows before any overwrites them
  // (compute-sanitizer's racecheck flagged the writes on an H200 without this barrier: lanes of
  // a warp are not ordered without one).
  __syncwarp();
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + kWarpRows * m + group + 8 * r;
        const uint32_t pair = Core::pack(state.o[m][n][2 * r] * inv_sum[m][r],
                                         state.o[m][n][2 * r + 1] * inv_sum[m][r]);
        *reinterpret_cast<uint32_t*>(o_tile + swizzled<kHeadDim>(row, n) + 2 * tig) = pair;
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < Tile::kWarpQueryRows * Tile::kChunks / 32; ++k) {
    const int idx = lane + 32 * k;
    const int row = idx / Tile::kChunks, chunk = idx % Tile::kChunks;
    const int t = warp_q0 + row;
    if (t >= T) continue;
    const uint4 chunk_value =
        *reinterpret_cast<const uint4*>(o_tile + swizzled<kHeadDim>(row0 + row, chunk));
    // Default caching (not .cs): the output projection reads it next.
    store_128(reinterpret_cast<uint4*>(out_head + t * C + chunk * kChunkElements), chunk_value);
  }
}

// out (B,T,NH*hd), lse (B,NH,T), qkv (B,T,(NH+2KV)*hd), positions (B,T) of packed sequences
// (kPacked; else unused: one causal sequence per row). Grid (ceil(T/kBlockRows), B*NH), 128
// threads, Tiling<kHeadDim, kWarpTiles>::kSharedBytes (kPackedSharedBytes) of dynamic shared
// memory. scale_log2 = scale * log2(e).
template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
__global__ void __launch_bounds__(kThreads, (Tiling<kHeadDim, kWarpTiles>::kMinBlocks))
    attention_forward_mma_kernel(Element* out, float* lse, const Element* qkv,
                                 const int32_t* positions, int T, int NH, int KV, float scale,
                                 float scale_log2) {
  using Tile = Tiling<kHeadDim, kWarpTiles>;
  constexpr int kKeys = Tile::kKeys, kBlockRows = Tile::kBlockRows;
  constexpr int kKeyTiles = kKeys / 8;  // 8-key n-tiles of S
  constexpr int kTileElements = kKeys * kHeadDim;

  // uint4: 16-byte alignment for cp.async and ldmatrix, and one extern name for every Element.
  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* q_tile = reinterpret_cast<Element*>(shared_chunks);  // (kBlockRows, hd)
  Element* k_tiles = q_tile + kBlockRows * kHeadDim;            // (stages, kKeys, hd)
  Element* v_tiles = k_tiles + Tile::kStages * kTileElements;   // (stages, kKeys, hd)
  int* row_starts = reinterpret_cast<int*>(v_tiles + Tile::kStages * kTileElements);  // kPacked

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // The last query blocks have the most key tiles: launched first, they do not trail the grid.
  const int q0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kBlockRows;
  const int b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim;  // a qkv row
  const Element* batch = qkv + int64_t{b} * T * width;
  const Element* k_head = batch + (NH + kv_head) * kHeadDim;
  const Element* v_head = batch + (NH + KV + kv_head) * kHeadDim;

  const int row0 = Tile::kWarpQueryRows * warp;  // this warp's first row in the block's tiles
  const int warp_q0 = q0 + row0;                 // and its first query row
  const int key_tiles = (min(q0 + kBlockRows, T) + kKeys - 1) / kKeys;  // keys the block sees
  // Packed rows: the key tiles from the one holding the block's first row's sequence start;
  // the rows' starts published by the loop's first barrier. Without positions, tile 0.
  int first_tile = 0;
  if constexpr (kPacked) {
    first_tile = packed_block_starts<kBlockRows, kKeys>(positions, b, q0, T, row_starts);
  }

  load_tile_async<kBlockRows, kHeadDim>(q_tile, batch + h * kHeadDim, width, q0, T);
  const int first_stage = first_tile % Tile::kStages;
  load_tile_async<kKeys, kHeadDim>(k_tiles + first_stage * kTileElements, k_head, width,
                                   first_tile * kKeys, T);
  load_tile_async<kKeys, kHeadDim>(v_tiles + first_stage * kTileElements, v_head, width,
                                   first_tile * kKeys, T);
  cp_async_commit_group();

  uint32_t q_fragments[kWarpTiles][Tile::kQInRegisters ? kHeadDim / 16 : 1][4];  // or unused
  WarpRows<kHeadDim, kWarpTiles> state;
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m) {
    state.max[m][0] = state.max[m][1] = -INFINITY;
    state.sum[m][0] = state.sum[m][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      state.o[m][n][0] = state.o[m][n][1] = state.o[m][n][2] = state.o[m][n][3] = 0.0f;
  }

  for (int tile = first_tile; tile < key_tiles; ++tile) {
    const int stage = tile % Tile::kStages;
    const int k0 = tile * kKeys;
    cp_async_wait_group<0>();  // this thread's copies of this tile (and of Q) have landed
    // Everyone's have, and every warp is done with the previous tile, whose stage the next
    // tile's copies reuse: one barrier per tile.
    __syncthreads();
    if (tile + 1 < key_tiles) {  // the next tile streams in while this one is used
      const int next = (tile + 1) % Tile::kStages;
      load_tile_async<kKeys, kHeadDim>(k_tiles + next * kTileElements, k_head, width, k0 + kKeys,
                                       T);
      load_tile_async<kKeys, kHeadDim>(v_tiles + next * kTileElements, v_head, width, k0 + kKeys,
                                       T);
      cp_async_commit_group();
    }
    if constexpr (Tile::kQInRegisters) {
      if (tile == first_tile) load_warp_fragments<kHeadDim>(q_fragments, q_tile, row0, lane);
    }
    if constexpr (kPacked) {
      // Wholly before the sequence of the warp's first row (the least start): warp-uniform.
      if (k0 + kKeys <= row_starts[row0]) continue;
    }

    const Element* k_tile = k_tiles + stage * kTileElements;
    const Element* v_tile = v_tiles + stage * kTileElements;
    // Packed rows: the tiles from the start of the warp's last row's sequence (the greatest) on.
    if (warp_q0 < T && k0 + kKeys - 1 <= warp_q0 && k0 + kKeys <= T &&
        (!kPacked || k0 >= row_starts[min(row0 + Tile::kWarpQueryRows, T - q0) - 1])) {
      // Every row of the warp sees every key of the tile (all but the last tiles of a warp, and
      // for packed rows the first of a sequence that starts inside a tile): no mask and every
      // n-tile, known when compiled.
      attend_key_tile<false, kPacked, Tile>(state, q_fragments, q_tile, k_tile, v_tile, row_starts,
                                            row0, warp_q0, k0, T, kKeyTiles, scale_log2, lane);
      continue;
    }
    // 8-key n-tiles with a key that some row of this warp sees (warp-uniform): the causal
    // bound, then the sequence's end; none for a warp whose rows are all past T. A row may
    // see no key of the tile (packed rows: its sequence starts later), which online_softmax
    // handles; every row before T sees itself, so its max is finite by its last tile. The
    // skipped n-tiles lie past every row's last key, so masking covers them.
    const int seen = warp_q0 < T ? min(warp_q0 + Tile::kWarpQueryRows, T) - k0 : 0;
    const int active_tiles = min(kKeyTiles, (max(seen, 0) + 7) / 8);
    if (active_tiles == 0) continue;
    attend_key_tile<true, kPacked, Tile>(state, q_fragments, q_tile, k_tile, v_tile, row_starts,
                                         row0, warp_q0, k0, T, active_tiles, scale_log2, lane);
  }

  store_warp_rows<Tile>(out + int64_t{b} * T * NH * kHeadDim + h * kHeadDim, int64_t{NH} * kHeadDim,
                        lse + (int64_t{b} * NH + h) * T, q_tile, state, row0, warp_q0, T, scale,
                        lane);
}

template <class Element, int kHeadDim, int kWarpTiles, bool kPacked>
void launch_forward_kernel(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                           const int32_t* positions, cudaStream_t stream) {
  using Tile = Tiling<kHeadDim, kWarpTiles>;
  constexpr size_t kShared = kPacked ? Tile::kPackedSharedBytes : Tile::kSharedBytes;
  allow_shared_memory(attention_forward_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>,
                      kShared);
  const dim3 grid(ceil_div(s.T, Tile::kBlockRows), static_cast<unsigned>(s.B * s.NH));
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  DSTRAIN_LAUNCH((attention_forward_mma_kernel<Element, kHeadDim, kWarpTiles, kPacked>), grid,
                 kThreads, kShared, stream)
  (static_cast<Element*>(out.data), lse.f32(), static_cast<const Element*>(qkv.data), positions,
   static_cast<int>(s.T), static_cast<int>(s.NH), static_cast<int>(s.KV), scale, scale * kLog2e);
  CUDA_CHECK_LAUNCH();
}

// Packed rows (positions) take the kernel's kPacked form.
template <class Element, int kHeadDim, int kWarpTiles>
void launch_forward_mma(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                        const int32_t* positions, cudaStream_t stream) {
  if (positions != nullptr) {
    return launch_forward_kernel<Element, kHeadDim, kWarpTiles, true>(s, out, lse, qkv, positions,
                                                                      stream);
  }
  launch_forward_kernel<Element, kHeadDim, kWarpTiles, false>(s, out, lse, qkv, nullptr, stream);
}

template <class Element>
void dispatch_head_dim(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                       const int32_t* positions, cudaStream_t stream) {
  const bool wide = attention_warp_rows() == 32;
  switch (s.hd) {
    case 64:
      return wide ? launch_forward_mma<Element, 64, 2>(s, out, lse, qkv, positions, stream)
                  : launch_forward_mma<Element, 64, 1>(s, out, lse, qkv, positions, stream);
    case 128:
      return wide ? launch_forward_mma<Element, 128, 2>(s, out, lse, qkv, positions, stream)
                  : launch_forward_mma<Element, 128, 1>(s, out, lse, qkv, positions, stream);
    case 192:  // multi-head latent attention's qk head dim (DeepSeek-V2/V3: 128 + 64)
      return launch_forward_mma<Element, 192, 1>(s, out, lse, qkv, positions, stream);
    default:
      return launch_forward_mma<Element, 256, 1>(s, out, lse, qkv, positions, stream);
  }
}

}  // namespace

bool mma_forward_supports(const QkvShape& s, const Tensor& qkv, const Tensor& out) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return (qkv.dtype == DType::BF16 || qkv.dtype == DType::F16) && out.dtype == qkv.dtype &&
         (s.hd == 64 || s.hd == 128 || s.hd == 192 || s.hd == 256) && aligned(qkv.data) &&
         aligned(out.data) &&
         s.T < (int64_t{1} << 30);  // row indices in int
}

void attention_forward_mma(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                           const int32_t* positions, cudaStream_t stream) {
  if (qkv.dtype == DType::BF16) {
    dispatch_head_dim<__nv_bfloat16>(s, out, lse, qkv, positions, stream);
  } else {
    dispatch_head_dim<__half>(s, out, lse, qkv, positions, stream);
  }
}

}  // namespace dstrain::cuda::attention

namespace dstrain {

void set_cuda_attention_warp_rows(int rows) {
  cuda::attention::attention_warp_rows() = rows == 32 ? 32 : 16;
}

}  // namespace dstrain
