// CUDA optimizer ops: AdamW over a flat buffer, sum of squares (fp64), inf/NaN check.
#include <cmath>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;
// sum_squares: one block per kSumChunk elements (at most kMaxSumBlocks blocks, then each block
// strides): the partition depends on n only, so the sum is the same on every GPU and run.
constexpr int64_t kSumChunk = 16384;
constexpr int64_t kMaxSumBlocks = 2048;

struct AdamWConstants {
  float decay;             // 1 - lr * weight_decay
  float lerp_weight;       // 1 - beta1
  bool lerp_weight_small;  // |lerp_weight| < 0.5: ATen's lerp form
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float neg_step_size;  // -lr / bias_correction1
  float eps;
  float grad_scale;
};

// One element's update in the CPU twin's op order (torch.optim.AdamW, single-tensor path), each
// op rounded once: the _rn intrinsics keep nvcc from contracting a*b+c into an FMA, so F32
// results are bitwise the CPU's. Returns the new parameter; m, v updated in place.
__device__ __forceinline__ float adamw_update(const AdamWConstants& k, float param, float grad,
                                              float& m, float& v) {
  const float g = __fmul_rn(grad, k.grad_scale);
  const float param_decayed = __fmul_rn(param, k.decay);
  const float m_new =
      k.lerp_weight_small
          ? __fadd_rn(m, __fmul_rn(k.lerp_weight, __fsub_rn(g, m)))
          : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), __fsub_rn(1.0f, k.lerp_weight)));
  const float v_new =
      __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), k.bias_correction2_sqrt), k.eps);
  m = m_new;
  v = v_new;
  return __fadd_rn(param_decayed, __fdiv_rn(__fmul_rn(k.neg_step_size, m_new), denom));
}

// param, m, v (n) F32; grad (n) any float dtype; param_copy (n) optional. Any alignment.
__global__ void adamw_kernel(float* param, DeviceTensor grad, float* m, float* v,
                             DeviceTensor param_copy, AdamWConstants k, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float p = adamw_update(k, param[i], load(grad, i), m[i], v[i]);
    param[i] = p;
    if (param_copy.data) store(param_copy, i, p);
  }
}

// The same, 8 elements per thread per step with 128-bit loads and stores (param, m, v: two
// each; grad and param_copy: one in bf16/f16, two in F32), then a scalar tail. param_copy may be
// null. REQUIRES: every pointer 16-byte aligned.
template <class Grad, class Copy>
__global__ void adamw_vector_kernel(float* param, const Grad* grad, float* m, float* v,
                                    Copy* param_copy, AdamWConstants k, int64_t n) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t vectors = n / kVectorElements;
  for (int64_t vec = first; vec < vectors; vec += stride) {
    const int64_t i = vec * kVectorElements;
    float p[kVectorElements], g[kVectorElements], m8[kVectorElements], v8[kVectorElements];
    load_vector(param + i, p);  // all four loads in flight before the math
    load_vector(grad + i, g);
    load_vector(m + i, m8);
    load_vector(v + i, v8);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) p[j] = adamw_update(k, p[j], g[j], m8[j], v8[j]);
    store_vector(param + i, p);
    store_vector(m + i, m8);
    store_vector(v + i, v8);
    if (param_copy) store_vector(param_copy + i, p);
  }
  for (int64_t i = vectors * kVectorElements + first; i < n; i += stride) {
    const float p = adamw_update(k, param[i], to_float(grad[i]), m[i], v[i]);
    param[i] = p;
    if (param_copy) param_copy[i] = from_float<Copy>(p);
  }
}

// partials (gridDim.x) = per-block sums of x^2 in double; fixed partition and tree.
__global__ void sum_squares_partials_kernel(double* partials, DeviceTensor x, int64_t n) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double value = load(x, i);
    sum += value * value;
  }
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// result = sum of partials (count), one block, fixed order.
__global__ void sum_partials_kernel(double* result, const double* partials, int64_t count) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) *result = sum;
}

__global__ void inf_nan_kernel(unsigned* found, DeviceTensor x, int64_t n) {
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    bad |= !isfinite(load(x, i));
  }
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) *found = 1u;  // same value: no race
}

// The vector kernel where every pointer is 16-byte aligned, else the scalar one.
void launch_adamw(const CudaContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v,
                  Tensor param_copy, const AdamWConstants& k, cudaStream_t stream) {
  const int64_t n = param.numel();
  const bool aligned = vector_aligned(param.data) && vector_aligned(grad.data) &&
                       vector_aligned(m.data) && vector_aligned(v.data) &&
                       vector_aligned(param_copy.data);
  if (!aligned) {
    DSTRAIN_LAUNCH(adamw_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
    (param.f32(), device_tensor(grad), m.f32(), v.f32(),
     param_copy.empty() ? DeviceTensor{nullptr, DType::F32} : device_tensor(param_copy), k, n);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = grid_for(ctx, (n + kVectorElements - 1) / kVectorElements, kThreads);
  // Without a copy: the F32 instantiation with a null pointer.
  const DType copy_dtype = param_copy.empty() ? DType::F32 : param_copy.dtype;
  with_storage_type(grad.dtype, [&](auto grad_tag) {
    using Grad = decltype(grad_tag);
    with_storage_type(copy_dtype, [&](auto copy_tag) {
      using Copy = decltype(copy_tag);
      DSTRAIN_LAUNCH((adamw_vector_kernel<Grad, Copy>), grid, kThreads, 0, stream)
      (param.f32(), static_cast<const Grad*>(grad.data), m.f32(), v.f32(),
       static_cast<Copy*>(param_copy.data), k, n);
    });
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void adamw(const CudaContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
           const AdamWStep& step, cudaStream_t stream) {
  check_tensor_dtype(ctx, param, DType::F32, "adamw param");
  check_tensor_dtype(ctx, m, DType::F32, "adamw m");
  check_tensor_dtype(ctx, v, DType::F32, "adamw v");
  check_float_tensor(ctx, grad, "adamw grad");
  const int64_t n = param.numel();
  DSTRAIN_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n)
      << "adamw param " << param.shape_str() << ", grad " << grad.shape_str() << ", m "
      << m.shape_str() << ", v " << v.shape_str() << " must have the same number of elements";
  if (!param_copy.empty()) {
    check_float_tensor(ctx, param_copy, "adamw param_copy");
    DSTRAIN_CHECK(param_copy.numel() == n)
        << "adamw param_copy " << param_copy.shape_str() << " must have " << n << " elements";
  }
  DSTRAIN_CHECK(step.step >= 1) << "adamw step " << step.step << " must be >= 1 (1-based)";
  if (n == 0) return;

  // Scalars exactly as the CPU twin computes them (double, then float where the op uses them).
  const double lr = step.lr, beta1 = step.beta1, beta2 = step.beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step.step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step.step));
  AdamWConstants k;
  k.decay = static_cast<float>(1.0 - lr * static_cast<double>(step.weight_decay));
  k.lerp_weight = static_cast<float>(1.0 - beta1);
  k.lerp_weight_small = std::abs(k.lerp_weight) < 0.5f;
  k.beta2 = step.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  k.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  k.eps = step.eps;
  k.grad_scale = step.grad_scale;
  launch_adamw(ctx, param, grad, m, v, param_copy, k, stream);
}

double sum_squares(const CudaContext& ctx, Tensor x, cudaStream_t stream) {
  if (x.numel() == 0) return 0.0;
  check_float_tensor(ctx, x, "sum_squares x");
  const int64_t n = x.numel();
  const int64_t blocks = std::min(kMaxSumBlocks, (n + kSumChunk - 1) / kSumChunk);
  Scratch scratch(ctx, static_cast<size_t>(blocks + 1) * sizeof(double), stream);
  double* partials = scratch.as<double>();
  double* result = partials + blocks;
  DSTRAIN_LAUNCH(sum_squares_partials_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)
  (partials, device_tensor(x), n);
  CUDA_CHECK_LAUNCH();
  DSTRAIN_LAUNCH(sum_partials_kernel, 1, 1024, 0, stream)(result, partials, blocks);
  CUDA_CHECK_LAUNCH();
  double host_result = 0.0;
  CUDA_CHECK(
      cudaMemcpyAsync(&host_result, result, sizeof host_result, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host_result;
}

bool has_inf_or_nan(const CudaContext& ctx, Tensor x, cudaStream_t stream) {
  if (x.numel() == 0) return false;
  check_float_tensor(ctx, x, "has_inf_or_nan x");
  const int64_t n = x.numel();
  Scratch scratch(ctx, sizeof(unsigned), stream);
  unsigned* found = scratch.as<unsigned>();
  CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(unsigned), stream));
  DSTRAIN_LAUNCH(inf_nan_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (found, device_tensor(x), n);
  CUDA_CHECK_LAUNCH();
  unsigned host_found = 0;
  CUDA_CHECK(
      cudaMemcpyAsync(&host_found, found, sizeof host_found, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host_found != 0;
}

}  // namespace dstrain::cuda
