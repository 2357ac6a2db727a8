// Causal self-attention forward on tensor cores, FlashAttention-2 style, for bf16/f16 storage.
//
// A block of 4 warps owns 64 query rows of one (b, query head), 16 per warp, and streams its kv
// head's key and value rows through shared memory in tiles of kKeys rows:
//   - cp.async (16 bytes per copy, .cg: a tile is read once per block) fills a tile while the
//     previous one is being used: two stages, one commit group per tile;
//   - S (16, kKeys) = Q K^T per warp with mma.sync m16n8k16 (fp32 accumulators), Q fragments
//     from ldmatrix (once, kept in registers, for hd <= 128; for hd 256 read again for each
//     tile, to leave the registers to the (16, 256) fp32 output accumulator);
//   - the online softmax on the accumulator fragments: a lane holds two rows (groupID and
//     groupID + 8) of every 8-key n-tile, the row max is reduced over the 4 lanes of a quad with
//     shuffles, exp2f with log2(e) folded into the scale;
//   - P, rounded to 16 bits in registers, is the A operand of O += P V (the S accumulator's
//     layout IS the A fragment's layout), V's B fragments from ldmatrix .trans;
//   - key tiles past the block's last query are never loaded, n-tiles above a warp's rows are
//     skipped (their probabilities are 0), the diagonal and the ragged end (keys >= T,
//     zero-filled by cp.async) are masked;
//   - the output goes through shared memory (the warp's own Q rows) and leaves with 128-bit
//     stores; lse = max * scale + log(sum), natural log, as the fp32 kernel and the backward use.
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

namespace {

using namespace mma;

// Tile sizes per head dim. Shared memory: (64 + 2 stages * 2 * kKeys) rows of hd 16-bit
// elements: 40 KiB (hd 64), 80 KiB (128), 96 KiB (256, with 32-key tiles) -- at most the 99 KiB
// a block may opt in to on sm_86/sm_89.
template <int kHeadDim>
struct Tiling {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
  static constexpr int kKeys = kHeadDim == 256 ? 32 : 64;  // rows of a streamed K or V tile
  static constexpr int kStages = 2;
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static constexpr int kChunks = kHeadDim / kChunkElements;  // 16-byte chunks per row
  static constexpr size_t kSharedBytes =
      static_cast<size_t>(kQueryRows + 2 * kStages * kKeys) * kHeadDim * 2;
};

// out (B,T,NH*hd), lse (B,NH,T), qkv (B,T,(NH+2KV)*hd). Grid (ceil(T/64), B*NH), 128 threads,
// Tiling<kHeadDim>::kSharedBytes of dynamic shared memory. scale_log2 = scale * log2(e).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    attention_forward_mma_kernel(Element* out, float* lse, const Element* qkv, int T, int NH,
                                 int KV, float scale, float scale_log2) {
  using Tile = Tiling<kHeadDim>;
  using Core = TensorCore<Element>;
  constexpr int kKeys = Tile::kKeys;
  constexpr int kKeyTiles = kKeys / 8;      // 8-key n-tiles of S
  constexpr int kDimTiles = kHeadDim / 8;   // 8-column n-tiles of O
  constexpr int kDimSteps = kHeadDim / 16;  // 16-column k-steps of Q K^T
  constexpr int kKeySteps = kKeys / 16;     // 16-key k-steps of P V
  constexpr int kTileElements = kKeys * kHeadDim;

  // uint4: 16-byte alignment for cp.async and ldmatrix, and one extern name for every Element.
  DSTRAIN_DYNAMIC_SHARED(uint4, shared_chunks);
  Element* q_tile = reinterpret_cast<Element*>(shared_chunks);  // (64, hd)
  Element* k_tiles = q_tile + kQueryRows * kHeadDim;            // (stages, kKeys, hd)
  Element* v_tiles = k_tiles + Tile::kStages * kTileElements;   // (stages, kKeys, hd)

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane / 4, tig = lane % 4;  // the mma fragments' groupID, thread-in-group
  // The last query blocks have the most key tiles: launched first, they do not trail the grid.
  const int q0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kQueryRows;
  const int b = blockIdx.y / NH, h = blockIdx.y % NH, kv_head = h / (NH / KV);
  const int64_t width = int64_t{NH + 2 * KV} * kHeadDim,
                C = int64_t{NH} * kHeadDim;  // qkv, out row
  const Element* batch = qkv + int64_t{b} * T * width;
  const Element* q_head = batch + h * kHeadDim;
  const Element* k_head = batch + (NH + kv_head) * kHeadDim;
  const Element* v_head = batch + (NH + KV + kv_head) * kHeadDim;

  const int warp_row0 = q0 + kWarpRows * warp;                     // this warp's first query row
  const int rows[2] = {warp_row0 + group, warp_row0 + group + 8};  // this lane's two rows
  const int visible_end = min(q0 + kQueryRows, T);                 // keys [0, visible_end) are seen
  const int key_tiles = (visible_end + kKeys - 1) / kKeys;

  load_tile_async<kQueryRows, kHeadDim>(q_tile, q_head, width, q0, T);
  load_tile_async<kKeys, kHeadDim>(k_tiles, k_head, width, 0, T);
  load_tile_async<kKeys, kHeadDim>(v_tiles, v_head, width, 0, T);
  cp_async_commit_group();

  uint32_t q_fragments[Tile::kQInRegisters ? kDimSteps : 1][4];
  float o[kDimTiles][4];                      // O (16, hd) of this warp: rows group, group + 8
  float row_max[2] = {-INFINITY, -INFINITY};  // of the unscaled scores
  float row_sum[2] = {0.0f, 0.0f};            // this lane's part; the quad's sum at the end
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  for (int tile = 0; tile < key_tiles; ++tile) {
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
    const Element* k_tile = k_tiles + stage * kTileElements;
    const Element* v_tile = v_tiles + stage * kTileElements;

    if constexpr (Tile::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int kk = 0; kk < kDimSteps; ++kk)
          load_a_fragment<kHeadDim>(q_fragments[kk], q_tile, kWarpRows * warp, lane, kk);
      }
    }

    // 8-key n-tiles with a key that some row of this warp sees (warp-uniform): the causal
    // bound, then the sequence's end; none for a warp whose rows are all past T. The first tile
    // is never empty for the others (every row sees key 0), so their running max is finite
    // from then on.
    const int seen = warp_row0 < T ? min(warp_row0 + kWarpRows, T) - k0 : 0;
    const int active_tiles = min(kKeyTiles, (max(seen, 0) + 7) / 8);
    if (active_tiles > 0) {
      // ---- S = Q K^T (unscaled) ----
      float s[kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kDimSteps; ++kk) {
        uint32_t a[4];
        if constexpr (Tile::kQInRegisters) {
          for (int i = 0; i < 4; ++i) a[i] = q_fragments[kk][i];
        } else {
          load_a_fragment<kHeadDim>(a, q_tile, kWarpRows * warp, lane, kk);
        }
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          if (2 * np >= active_tiles) continue;
          // B fragments of n-tiles 2np, 2np + 1: K's rows are B's columns (.col).
          uint32_t b0[2], b1[2];
          load_b_pair<kHeadDim>(b0, b1, k_tile, lane, np, kk);
          Core::mma(s[2 * np], a, b0);
          Core::mma(s[2 * np + 1], a, b1);
        }
      }

      // ---- mask: keys after the row (causal), keys >= T (zero-filled); the skipped n-tiles
      // lie past every row's last key, so this masks them too ----
      if (k0 + kKeys - 1 > warp_row0 || k0 + kKeys > T) {  // the diagonal or the end
        // The last key of the tile each of this lane's rows sees, relative to k0.
        const int last_seen[2] = {min(rows[0], T - 1) - k0, min(rows[1], T - 1) - k0};
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (8 * n + 2 * tig + (e & 1) > last_seen[e / 2]) s[n][e] = -INFINITY;
          }
        }
      }

      // ---- online softmax: rescale O and the sums to the new row max, P = exp2 ----
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = row_max[r];
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
          tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float max_scaled = tile_max * scale_log2;
        const float correction = exp2f(row_max[r] * scale_log2 - max_scaled);  // 0 on tile 0
        row_max[r] = tile_max;
        row_sum[r] *= correction;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[n][2 * r] *= correction;
          o[n][2 * r + 1] *= correction;
        }
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -max_scaled));  // -inf -> 0
            row_sum[r] += s[n][e];
          }
        }
      }

      // ---- O += P V: P's accumulator layout is the A fragment of the k-step's 16 keys ----
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
        if (2 * kk >= active_tiles) continue;
        uint32_t p[4];
        pack_a_fragment<Element>(p, s, kk);
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          // B fragments of column n-tiles 2dp, 2dp + 1, transposed: V's rows are B's rows.
          uint32_t b0[2], b1[2];
          load_b_pair_trans<kHeadDim>(b0, b1, v_tile, lane, kk, dp);
          Core::mma(o[2 * dp], p, b0);
          Core::mma(o[2 * dp + 1], p, b1);
        }
      }
    }
  }

  // ---- epilogue: O / sum through the warp's own Q rows in shared memory, lse ----
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: a warp entirely past T computed nothing
    if (tig == 0 && rows[r] < T) {
      lse[(int64_t{b} * NH + h) * T + rows[r]] = row_max[r] * scale + logf(sum);
    }
  }
  // Only this warp reads (read) its 16 Q rows, so it alone may overwrite them, once all its
  // lanes are past their last ldmatrix of them (compute-sanitizer's racecheck flagged the
  // writes on an H200 without this barrier: lanes of a warp are not ordered without one).
  Element* o_tile = q_tile;  // (64, hd), swizzled like Q
  __syncwarp();
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = kWarpRows * warp + group + 8 * r;
      const uint32_t pair = Core::pack(o[n][2 * r] * inv_sum[r], o[n][2 * r + 1] * inv_sum[r]);
      *reinterpret_cast<uint32_t*>(o_tile + swizzled<kHeadDim>(row, n) + 2 * tig) = pair;
    }
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < kWarpRows * Tile::kChunks / 32; ++k) {
    const int idx = lane + 32 * k;
    const int row = idx / Tile::kChunks, chunk = idx % Tile::kChunks;
    const int t = warp_row0 + row;
    if (t >= T) continue;
    const uint4 chunk_value =
        *reinterpret_cast<const uint4*>(o_tile + swizzled<kHeadDim>(kWarpRows * warp + row, chunk));
    // Default caching (not .cs): the output projection reads it next.
    store_128(reinterpret_cast<uint4*>(out + (int64_t{b} * T + t) * C + h * kHeadDim +
                                       chunk * kChunkElements),
              chunk_value);
  }
}

template <class Element, int kHeadDim>
void launch_forward_mma(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                        cudaStream_t stream) {
  constexpr size_t shared_bytes = Tiling<kHeadDim>::kSharedBytes;
  allow_shared_memory(attention_forward_mma_kernel<Element, kHeadDim>, shared_bytes);
  const dim3 grid(ceil_div(s.T, kQueryRows), static_cast<unsigned>(s.B * s.NH));
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  DSTRAIN_LAUNCH((attention_forward_mma_kernel<Element, kHeadDim>), grid, kThreads, shared_bytes,
                 stream)
  (static_cast<Element*>(out.data), lse.f32(), static_cast<const Element*>(qkv.data),
   static_cast<int>(s.T), static_cast<int>(s.NH), static_cast<int>(s.KV), scale, scale * kLog2e);
  CUDA_CHECK_LAUNCH();
}

template <class Element>
void dispatch_head_dim(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv, cudaStream_t stream) {
  switch (s.hd) {
    case 64:
      return launch_forward_mma<Element, 64>(s, out, lse, qkv, stream);
    case 128:
      return launch_forward_mma<Element, 128>(s, out, lse, qkv, stream);
    default:
      return launch_forward_mma<Element, 256>(s, out, lse, qkv, stream);
  }
}

}  // namespace

bool mma_forward_supports(const QkvShape& s, const Tensor& qkv, const Tensor& out) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return (qkv.dtype == DType::BF16 || qkv.dtype == DType::F16) && out.dtype == qkv.dtype &&
         (s.hd == 64 || s.hd == 128 || s.hd == 256) && aligned(qkv.data) && aligned(out.data) &&
         s.T < (int64_t{1} << 30);  // row indices in int
}

void attention_forward_mma(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                           cudaStream_t stream) {
  if (qkv.dtype == DType::BF16) {
    dispatch_head_dim<__nv_bfloat16>(s, out, lse, qkv, stream);
  } else {
    dispatch_head_dim<__half>(s, out, lse, qkv, stream);
  }
}

}  // namespace dstrain::cuda::attention
