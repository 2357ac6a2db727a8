// CUDA fused softmax + cross-entropy: one block per row. One read of the row computes the
// running max and sum of exponentials (online softmax per thread, then combined across the
// block in a fixed order); the loss follows; with dlogits, a second sweep over the same row
// writes (softmax - onehot) * dloss. Where Vp % 8 == 0 and logits and dlogits share a dtype and
// are 16-byte aligned, the row moves in packs of 8 (128-bit loads and stores, one rescale of a
// thread's sum per pack: other bits than the element-wise form, the same tolerances). Every
// thread reads an element before it writes the same element, and the target logit is read before
// the first block barrier, so dlogits may be logits itself.
//
// Vocabulary-parallel (the logits' columns split over ranks): cross_entropy_stats reduces a
// slice's rows to (max, sum of exponentials, target logit) with the same block reduction;
// cross_entropy_from_stats combines every slice's statistics per row in slice order (each
// thread the same sequential loop, as the CPU twin) and writes the loss and the slice's
// gradient.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max;
  float sum;  // sum of exp(x - max)
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};  // both empty
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// The block's total of the threads' (max, sum of exp(x - max)): by butterfly within each warp,
// then across warps in a fixed order. Every thread gets the total.
__device__ MaxSum block_combine(MaxSum local) {
  __shared__ MaxSum warp_results[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, local.max, offset),
                       __shfl_xor_sync(0xffffffffu, local.sum, offset)};
    local = combine(local, other);
  }
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = local;
  __syncthreads();
  MaxSum total = warp_results[0];
  for (int w = 1; w < kThreads / 32; ++w) total = combine(total, warp_results[w]);
  return total;
}

// The block's (max, sum of exp(x - max)) over columns [0, end) of row `base`: online softmax
// per thread, element by element, then block_combine.
__device__ MaxSum block_max_sum(const DeviceTensor& logits, int64_t base, int64_t end) {
  MaxSum local{-INFINITY, 0.0f};
  for (int64_t j = threadIdx.x; j < end; j += blockDim.x) {
    const float x = load(logits, base + j);
    if (x > local.max) {
      local.sum = local.sum * expf(local.max - x) + 1.0f;
      local.max = x;
    } else {
      local.sum += expf(x - local.max);
    }
  }
  return block_combine(local);
}

// The same over the columns [0, V) of `row` (storage type T), 8 columns per step with 128-bit
// loads: a thread's online softmax takes a pack's max first, so one rescale per pack. Columns
// from V to the end of the last pack are read (they lie in the row: Vp % 8 == 0) and skipped.
template <class T>
__device__ MaxSum block_max_sum_vector(const T* row, int64_t V) {
  MaxSum local{-INFINITY, 0.0f};
  const int64_t packs = (V + kVectorElements - 1) / kVectorElements;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    float x[kVectorElements];
    load_vector(row + p * kVectorElements, x);
    const int real = static_cast<int>(min(V - p * kVectorElements, int64_t{kVectorElements}));
    float m = local.max;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      if (j < real) m = fmaxf(m, x[j]);
    }
    float sum = local.sum * expf(local.max - m);  // 0 while local is empty (exp(-inf))
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      if (j < real) sum += expf(x[j] - m);
    }
    local = {m, sum};
  }
  return block_combine(local);
}

// losses (N), logits / dlogits (N, Vp), targets (N).
__global__ void softmax_cross_entropy_kernel(float* losses, DeviceTensor dlogits,
                                             DeviceTensor logits, const int32_t* targets,
                                             int64_t Vp, int64_t V, float dloss, bool with_grad,
                                             unsigned* error_word) {
  const int64_t n = blockIdx.x;
  const int64_t base = n * Vp;
  const int32_t target = targets[n];
  if (target == kIgnoreTarget) {  // a row the loss does not count
    if (threadIdx.x == 0) losses[n] = 0.0f;
    if (with_grad) {
      for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) store(dlogits, base + j, 0.0f);
    }
    return;
  }
  if (target < 0 || target >= V) {  // the same for the whole block: no barrier is skipped
    if (threadIdx.x == 0) {
      atomicOr(error_word, kBadTargetId);
      losses[n] = NAN;
    }
    if (with_grad) {
      for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) store(dlogits, base + j, NAN);
    }
    return;
  }
  const float target_logit = load(logits, base + target);
  const MaxSum total = block_max_sum(logits, base, V);

  if (threadIdx.x == 0) {
    // log(sum) - (x_t - max): no large max added and subtracted again.
    losses[n] = logf(total.sum) - (target_logit - total.max);
  }
  if (!with_grad) return;
  const float inv_sum = 1.0f / total.sum;
  for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) {
    float dx = 0.0f;  // padded columns do not exist
    if (j < V) {
      const float p = expf(load(logits, base + j) - total.max) * inv_sum;
      dx = (p - (j == target ? 1.0f : 0.0f)) * dloss;
    }
    store(dlogits, base + j, dx);
  }
}

// softmax_cross_entropy_kernel with the row in packs of 8: 128-bit loads of the logits and
// stores of the gradient, and block_max_sum_vector. REQUIRES: Vp % 8 == 0; logits and dlogits
// of storage type T, 16-byte aligned.
template <class T>
__global__ void softmax_cross_entropy_vector_kernel(float* losses, T* dlogits, const T* logits,
                                                    const int32_t* targets, int64_t Vp, int64_t V,
                                                    float dloss, unsigned* error_word) {
  const int64_t n = blockIdx.x, packs = Vp / kVectorElements;
  const T* row = logits + n * Vp;
  T* drow = dlogits == nullptr ? nullptr : dlogits + n * Vp;
  const int32_t target = targets[n];
  if (target == kIgnoreTarget || target < 0 || target >= V) {  // the same for the whole block
    const bool ignored = target == kIgnoreTarget;
    if (threadIdx.x == 0) {
      if (!ignored) atomicOr(error_word, kBadTargetId);
      losses[n] = ignored ? 0.0f : NAN;
    }
    if (drow == nullptr) return;
    const T fill = from_float<T>(ignored ? 0.0f : NAN);
    for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) drow[j] = fill;
    return;
  }
  const float target_logit = to_float(row[target]);  // before the block's first barrier
  const MaxSum total = block_max_sum_vector(row, V);
  if (threadIdx.x == 0) losses[n] = logf(total.sum) - (target_logit - total.max);
  if (drow == nullptr) return;
  const float inv_sum = 1.0f / total.sum;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const int64_t first = p * kVectorElements;
    float x[kVectorElements];
    load_vector(row + first, x);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      const int64_t column = first + j;
      float dx = 0.0f;  // padded columns do not exist
      if (column < V) {
        const float p = expf(x[j] - total.max) * inv_sum;
        dx = (p - (column == target ? 1.0f : 0.0f)) * dloss;
      }
      x[j] = dx;
    }
    store_vector(drow + first, x);
  }
}

// stats (N, 3) of logits (N, Vs) = columns [begin, begin + Vs), real below `vocab`.
__global__ void cross_entropy_stats_kernel(float* stats, DeviceTensor logits,
                                           const int32_t* targets, int64_t Vs, int64_t begin,
                                           int64_t vocab, unsigned* error_word) {
  const int64_t n = blockIdx.x, base = n * Vs;
  const int32_t target = targets[n];
  // An ignored row's statistics are computed as any other's (no slice holds its target).
  if (target != kIgnoreTarget && (target < 0 || target >= vocab)) {  // the same for the block
    if (threadIdx.x == 0) {
      atomicOr(error_word, kBadTargetId);
      for (int k = 0; k < 3; ++k) stats[3 * n + k] = NAN;
    }
    return;
  }
  const int64_t real = min(max(vocab - begin, int64_t{0}), Vs), local_target = target - begin;
  const MaxSum total = block_max_sum(logits, base, real);
  if (threadIdx.x != 0) return;
  stats[3 * n] = total.max;
  stats[3 * n + 1] = total.sum;
  stats[3 * n + 2] = local_target >= 0 && local_target < real ? load(logits, base + local_target)
                                                              : 0.0f;
}

// losses (N) and dlogits (N, Vs) of slice `begin` from every slice's stats (P, N, 3).
__global__ void cross_entropy_from_stats_kernel(float* losses, DeviceTensor dlogits,
                                                DeviceTensor logits, const float* stats,
                                                const int32_t* targets, int64_t N, int64_t P,
                                                int64_t Vs, int64_t begin, int64_t vocab,
                                                float dloss, bool with_grad,
                                                unsigned* error_word) {
  const int64_t n = blockIdx.x, base = n * Vs;
  const int32_t target = targets[n];
  if (target == kIgnoreTarget) {  // a row the loss does not count
    if (threadIdx.x == 0) losses[n] = 0.0f;
    if (with_grad) {
      for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) store(dlogits, base + j, 0.0f);
    }
    return;
  }
  if (target < 0 || target >= vocab) {
    if (threadIdx.x == 0) {
      atomicOr(error_word, kBadTargetId);
      losses[n] = NAN;
    }
    if (with_grad) {
      for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) store(dlogits, base + j, NAN);
    }
    return;
  }
  float max_logit = -INFINITY;
  for (int64_t p = 0; p < P; ++p) max_logit = fmaxf(max_logit, stats[(p * N + n) * 3]);
  // Both fields read before the test, and the loop not unrolled (P is the tp degree): nvcc
  // 13.0.88 unrolled the earlier form (row[1] read, then row[0] under the test) by four and
  // gave the 2nd-4th copies row[1]'s address for row[0] (PTX `ld.global.f32 [%rd30]` where
  // `[%rd30+-4]` was due), so 4 slices on a real GPU summed s * exp(s - max). The emulator
  // runs the source, not nvcc's code: the GPU run of 2026-11-26 found it (RESULTS.md).
  float sum = 0.0f;
#pragma unroll 1
  for (int64_t p = 0; p < P; ++p) {
    const float slice_max = stats[(p * N + n) * 3];
    const float slice_sum = stats[(p * N + n) * 3 + 1];
    if (slice_sum != 0.0f) {
      sum = __fadd_rn(sum, __fmul_rn(slice_sum, expf(slice_max - max_logit)));
    }
  }
  const float target_logit = stats[((target / Vs) * N + n) * 3 + 2];
  if (threadIdx.x == 0) losses[n] = logf(sum) - (target_logit - max_logit);
  if (!with_grad) return;
  const int64_t real = min(max(vocab - begin, int64_t{0}), Vs), local_target = target - begin;
  const float inv_sum = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) {
    float dx = 0.0f;  // columns that do not exist
    if (j < real) {
      const float p = expf(load(logits, base + j) - max_logit) * inv_sum;
      dx = (p - (j == local_target ? 1.0f : 0.0f)) * dloss;
    }
    store(dlogits, base + j, dx);
  }
}

struct SliceShape {
  int64_t N, Vs;
};

SliceShape check_slice(const CudaContext& ctx, const Tensor& logits, const Tensor& targets,
                       int64_t vocab_begin, int vocab) {
  check_float_tensor(ctx, logits, "logits");
  check_tensor_dtype(ctx, targets, DType::I32, "targets");
  const SliceShape s{rows_of(logits), cols_of(logits)};
  DSTRAIN_CHECK(vocab > 0 && vocab_begin >= 0)
      << "vocab " << vocab << " and vocab_begin " << vocab_begin << " must be positive";
  DSTRAIN_CHECK(targets.numel() == s.N)
      << "targets " << targets.shape_str() << " must have the " << s.N << " rows of logits "
      << logits.shape_str();
  DSTRAIN_CHECK(s.N <= INT32_MAX) << "cross-entropy over " << s.N << " rows";
  return s;
}

}  // namespace

void cross_entropy_stats(const CudaContext& ctx, Tensor stats, Tensor logits, Tensor targets,
                         int64_t vocab_begin, int vocab, cudaStream_t stream) {
  const SliceShape s = check_slice(ctx, logits, targets, vocab_begin, vocab);
  check_tensor_dtype(ctx, stats, DType::F32, "stats");
  DSTRAIN_CHECK(stats.numel() == 3 * s.N)
      << "stats " << stats.shape_str() << " must be (" << s.N << ", 3)";
  if (s.N == 0) return;
  DSTRAIN_LAUNCH(cross_entropy_stats_kernel, static_cast<unsigned>(s.N), kThreads, 0, stream)
  (stats.f32(), device_tensor(logits), static_cast<const int32_t*>(targets.data), s.Vs,
   vocab_begin, vocab, ctx.error_word);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_from_stats(const CudaContext& ctx, Tensor losses, Tensor dlogits,
                              Tensor logits, Tensor stats, Tensor targets, int64_t vocab_begin,
                              int vocab, float dloss, cudaStream_t stream) {
  const SliceShape s = check_slice(ctx, logits, targets, vocab_begin, vocab);
  check_tensor_dtype(ctx, losses, DType::F32, "losses");
  check_tensor_dtype(ctx, stats, DType::F32, "stats");
  DSTRAIN_CHECK(losses.numel() == s.N)
      << "losses " << losses.shape_str() << " must have " << s.N << " elements";
  const int64_t P = stats.numel() / std::max<int64_t>(3 * s.N, 1);
  DSTRAIN_CHECK(stats.numel() == P * s.N * 3 && P * s.Vs >= vocab &&
                vocab_begin + s.Vs <= P * s.Vs)
      << "stats " << stats.shape_str() << " must be (P, " << s.N << ", 3) for " << P
      << " slices of " << s.Vs << " columns covering the vocabulary " << vocab;
  const bool with_grad = !dlogits.empty();
  if (with_grad) {
    check_float_tensor(ctx, dlogits, "dlogits");
    check_same_numel(dlogits, "dlogits", logits, "logits");
    DSTRAIN_CHECK(cols_of(dlogits) == s.Vs) << "dlogits " << dlogits.shape_str();
    DSTRAIN_CHECK(dlogits.data != logits.data || dlogits.dtype == logits.dtype)
        << "dlogits may alias logits only with the same dtype";
  }
  if (s.N == 0) return;
  DSTRAIN_LAUNCH(cross_entropy_from_stats_kernel, static_cast<unsigned>(s.N), kThreads, 0,
                 stream)
  (losses.f32(), with_grad ? device_tensor(dlogits) : DeviceTensor{nullptr, DType::F32},
   device_tensor(logits), stats.f32(), static_cast<const int32_t*>(targets.data), s.N, P, s.Vs,
   vocab_begin, vocab, dloss, with_grad, ctx.error_word);
  CUDA_CHECK_LAUNCH();
}

void softmax_cross_entropy(const CudaContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                           Tensor targets, int vocab, float dloss, cudaStream_t stream) {
  check_float_tensor(ctx, logits, "logits");
  check_tensor_dtype(ctx, losses, DType::F32, "losses");
  check_tensor_dtype(ctx, targets, DType::I32, "targets");
  const int64_t Vp = cols_of(logits), N = rows_of(logits), V = vocab;
  DSTRAIN_CHECK(V > 0 && V <= Vp) << "vocab " << V << " must be in [1, " << Vp << "] for logits "
                                  << logits.shape_str();
  DSTRAIN_CHECK(losses.numel() == N && targets.numel() == N)
      << "losses " << losses.shape_str() << " and targets " << targets.shape_str() << " must have "
      << N << " elements (logits " << logits.shape_str() << ")";
  const bool with_grad = !dlogits.empty();
  if (with_grad) {
    check_float_tensor(ctx, dlogits, "dlogits");
    check_same_numel(dlogits, "dlogits", logits, "logits");
    DSTRAIN_CHECK(cols_of(dlogits) == Vp) << "dlogits " << dlogits.shape_str();
    DSTRAIN_CHECK(dlogits.data != logits.data || dlogits.dtype == logits.dtype)
        << "dlogits may alias logits only with the same dtype";
  }
  if (N == 0) return;
  DSTRAIN_CHECK(N <= INT32_MAX) << "cross-entropy over " << N << " rows";
  const bool vector =
      Vp % kVectorElements == 0 && vector_aligned(logits.data) &&
      (!with_grad || (dlogits.dtype == logits.dtype && vector_aligned(dlogits.data)));
  if (vector) {
    with_storage_type(logits.dtype, [&](auto tag) {
      using T = decltype(tag);
      DSTRAIN_LAUNCH(softmax_cross_entropy_vector_kernel<T>, static_cast<unsigned>(N), kThreads, 0,
                     stream)
      (losses.f32(), with_grad ? static_cast<T*>(dlogits.data) : nullptr,
       static_cast<const T*>(logits.data), static_cast<const int32_t*>(targets.data), Vp, V, dloss,
       ctx.error_word);
    });
    CUDA_CHECK_LAUNCH();
    return;
  }
  DSTRAIN_LAUNCH(softmax_cross_entropy_kernel, static_cast<unsigned>(N), kThreads, 0, stream)
  (losses.f32(), with_grad ? device_tensor(dlogits) : DeviceTensor{nullptr, DType::F32},
   device_tensor(logits), static_cast<const int32_t*>(targets.data), Vp, V, dloss, with_grad,
   ctx.error_word);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
