// CUDA fused softmax + cross-entropy: one block per row. One read of the row computes the
// running max and sum of exponentials (online softmax per thread, then combined across the
// block in a fixed order); the loss follows; with dlogits, a second sweep over the same row
// writes (softmax - onehot) * dloss. Every thread reads an element before it writes the same
// element, and the target logit is read before the first block barrier, so dlogits may be
// logits itself.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

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

// losses (N), logits / dlogits (N, Vp), targets (N).
__global__ void softmax_cross_entropy_kernel(float* losses, DeviceTensor dlogits,
                                             DeviceTensor logits, const int32_t* targets,
                                             int64_t Vp, int64_t V, float dloss, bool with_grad,
                                             unsigned* error_word) {
  __shared__ MaxSum warp_results[kThreads / 32];
  const int64_t n = blockIdx.x;
  const int64_t base = n * Vp;
  const int32_t target = targets[n];
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

  MaxSum local{-INFINITY, 0.0f};
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float x = load(logits, base + j);
    if (x > local.max) {
      local.sum = local.sum * expf(local.max - x) + 1.0f;
      local.max = x;
    } else {
      local.sum += expf(x - local.max);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, local.max, offset),
                       __shfl_xor_sync(0xffffffffu, local.sum, offset)};
    local = combine(local, other);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_results[warp] = local;
  __syncthreads();
  MaxSum total = warp_results[0];
  for (int w = 1; w < kThreads / 32; ++w) total = combine(total, warp_results[w]);  // fixed order

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

}  // namespace

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
  DSTRAIN_LAUNCH(softmax_cross_entropy_kernel, static_cast<unsigned>(N), kThreads, 0, stream)
  (losses.f32(), with_grad ? device_tensor(dlogits) : DeviceTensor{nullptr, DType::F32},
   device_tensor(logits), static_cast<const int32_t*>(targets.data), Vp, V, dloss, with_grad,
   ctx.error_word);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
