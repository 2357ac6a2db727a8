// Rows held in registers, for the layernorm and RMSNorm vector kernels. A row belongs to kWarps
// warps (RowThread): 1 warp for C <= 2048 (8 rows per block of 256 threads), 8 warps for
// 2048 < C <= 8192 (one row per block). Thread t of the row holds packs p = t + 32 * kWarps * k
// (k < kPacks, p < C / 8), elements 8p .. 8p + 7, as fp32. Each row element is read from memory
// once, with 128-bit loads, and written with 128-bit stores. The host side picks the form
// (row_form) and instantiates the kernel for it (with_row_form).
//
// Reduction order (row_sum): a thread adds its terms in sequence, the warp adds its 32 lane sums
// by butterfly (5 levels), and with 8 warps the 8 warp sums are added in warp order. Each sum is
// a sequential sum of at most C / 32 terms (C / 256 with 8 warps) followed by at most 13 more
// additions in a row, so its error bound is below the one of the CPU twin's sequential sum of C
// terms.
#pragma once

#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

constexpr int kRowBlockThreads = 256;  // threads per block of the row kernels
// One warp per row: up to kMaxPacks packs of 8 elements per lane, C <= 2048.
constexpr int kMaxPacks = 8;
constexpr int64_t kMaxWarpRowC = int64_t{32} * kVectorElements * kMaxPacks;
// Wider rows: a block of kWideRowWarps warps per row, up to kMaxWidePacks packs per thread.
constexpr int kWideRowWarps = kRowBlockThreads / 32;
constexpr int kMaxWidePacks = 4;
constexpr int64_t kMaxRegisterC = int64_t{kRowBlockThreads} * kVectorElements * kMaxWidePacks;

// The row a thread works on (n) and its index among the row's kThreads threads (t).
template <int kWarps>
struct RowThread {
  static_assert(kWarps == 1 || kWarps == kWideRowWarps, "a warp or a block per row");
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerBlock = kRowBlockThreads / kThreads;
  int t;
  int64_t n;
  __device__ __forceinline__ RowThread()
      : t(static_cast<int>(threadIdx.x) % kThreads),
        n(blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kThreads) {}
  // The global index of this thread's pack k.
  __device__ __forceinline__ int64_t pack(int k) const { return t + int64_t{kThreads} * k; }
};

// The sum of `value` over the row's threads, in the order of the header comment, in every thread.
// With kWarps > 1 every thread of the block calls it (a block is one row: none returned early).
template <int kWarps>
__device__ __forceinline__ float row_sum(float value) {
  value = warp_sum(value);
  if constexpr (kWarps == 1) {
    return value;
  } else {
    __shared__ float warp_sums[kWarps];
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
    __syncthreads();  // warp_sums is free for the next row_sum
    return total;
  }
}

// x = this thread's share of the row at a + base (packs = C / 8 packs). With
// kResidual the row is a + b rounded to T, exactly residual_forward's sum, and is also stored at
// sum + base (b and sum unused otherwise): the residual add fused into the norm that reads its
// result. The loads of `a` are all issued before the first use; b is read one pack at a time (8
// registers, not 8 per pack: the row already takes 8 per pack).
template <class T, int kWarps, int kPacks, bool kResidual>
__device__ __forceinline__ void load_row(float (&x)[kPacks][kVectorElements], const T* a,
                                         const T* b, T* sum, int64_t base, int64_t packs,
                                         const RowThread<kWarps>& row) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p < packs) load_vector(a + base + p * kVectorElements, x[k]);
  }
  if constexpr (kResidual) {
    b += base;
    sum += base;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = row.pack(k);
      if (p >= packs) continue;
      float y[kVectorElements];
      load_vector(b + p * kVectorElements, y);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        x[k][j] = to_float(from_float<T>(__fadd_rn(x[k][j], y[j])));  // the stored sum
      }
      store_vector(sum + p * kVectorElements, x[k]);
    }
  }
}

// x, dy = this thread's share of the rows at a + base and b + base (a backward's inp and dout),
// every load issued before the first use.
template <class T, int kWarps, int kPacks>
__device__ __forceinline__ void load_rows(float (&x)[kPacks][kVectorElements],
                                          float (&dy)[kPacks][kVectorElements], const T* a,
                                          const T* b, int64_t base, int64_t packs,
                                          const RowThread<kWarps>& row) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    load_vector(a + base + p * kVectorElements, x[k]);
    load_vector(b + base + p * kVectorElements, dy[k]);
  }
}

// The row at dst + base += f(k, j) for element j of this thread's pack k: each pack read and
// written once, 128 bits at a time (a backward's dinp, which accumulates). kPacks given.
template <int kPacks, class T, int kWarps, class F>
__device__ __forceinline__ void add_to_row(T* dst, int64_t base, int64_t packs,
                                           const RowThread<kWarps>& row, F&& f) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    float d[kVectorElements];
    load_vector(dst + base + p * kVectorElements, d);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) d[j] = d[j] + f(k, j);
    store_vector(dst + base + p * kVectorElements, d);
  }
}

// Calls f(std::bool_constant<residual>{}): the plain norm kernels keep their registers.
template <class F>
void with_residual(bool residual, F&& f) {
  if (residual) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Which pass of a norm a row form is for: each has its own bound for the 8-warp form.
enum class RowPass { kForward, kBackward };

// Rows of more than this many elements take the 8-warp form. Measured on an H200 (bf16,
// benchmarks/RESULTS.md, 2026-11-26): the one-warp forward is as fast or faster up to 2048, the
// one-warp backward only up to 1024 (at C = 1600 the 8-warp backward is 55-62% faster; at 768
// 22% slower). A benchmark or a test moves both: set_cuda_norm_block_rows_above in
// cuda_backend.h. One value per process.
constexpr int64_t kDefaultBlockRowsAbove[] = {kMaxWarpRowC, 1024};
inline int64_t& block_rows_above(RowPass pass) {
  static int64_t C[] = {kDefaultBlockRowsAbove[0], kDefaultBlockRowsAbove[1]};
  return C[static_cast<int>(pass)];
}

// The register-held form of a row kernel: warps per row and packs per thread (0: not this form).
struct RowForm {
  int warps = 0;
  int packs = 0;
  explicit operator bool() const { return packs != 0; }
  // Blocks of kRowBlockThreads for `rows` rows.
  unsigned blocks(int64_t rows) const {
    const int64_t per_block = kRowBlockThreads / (32 * warps);
    return static_cast<unsigned>((rows + per_block - 1) / per_block);
  }
};

// The form for rows of C elements in `rows` (one dtype, 16-byte aligned; empty tensors ignored)
// with `params` (aligned); {} where it does not apply. Kernels are instantiated for 1 warp with
// 2, 4 and 8 packs (C <= 512, 1024, 2048) and 8 warps with 2 and 4 (C <= 4096, 8192); the 8-warp
// form takes the rows above block_rows_above(pass).
inline RowForm row_form(RowPass pass, int64_t C, std::initializer_list<Tensor> rows,
                        std::initializer_list<Tensor> params) {
  if (C % kVectorElements != 0 || C > kMaxRegisterC) return {};
  for (const Tensor& t : rows) {
    if (t.empty()) continue;
    if (t.dtype != rows.begin()->dtype || !vector_aligned(t.data)) return {};
  }
  for (const Tensor& t : params) {
    if (!vector_aligned(t.data)) return {};
  }
  const int64_t packs = C / kVectorElements;
  if (C <= block_rows_above(pass)) {
    const int64_t per_lane = (packs + 31) / 32;
    return {1, per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : kMaxPacks};
  }
  const int64_t per_thread = (packs + kRowBlockThreads - 1) / kRowBlockThreads;
  return {kWideRowWarps, per_thread <= 2 ? 2 : kMaxWidePacks};
}

// Calls f(std::integral_constant<int, warps>{}, std::integral_constant<int, packs>{}) for the
// forms row_form returns.
template <class F>
void with_row_form(RowForm form, F&& f) {
  using One = std::integral_constant<int, 1>;
  using Wide = std::integral_constant<int, kWideRowWarps>;
  using P2 = std::integral_constant<int, 2>;
  using P4 = std::integral_constant<int, 4>;
  if (form.warps == 1) {
    if (form.packs == 2) {
      f(One{}, P2{});
    } else if (form.packs == 4) {
      f(One{}, P4{});
    } else {
      f(One{}, std::integral_constant<int, kMaxPacks>{});
    }
  } else if (form.packs == 2) {
    f(Wide{}, P2{});
  } else {
    f(Wide{}, P4{});
  }
}

}  // namespace dstrain::cuda
