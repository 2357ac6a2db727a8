// CUDA RMSNorm (Llama, Qwen2): fp32 statistics, the normalized value rounded to the input's
// dtype before the weight multiply (as Hugging Face's LlamaRMSNorm), like the CPU twin.
//
// Rows: one warp per row, the sum of squares by warp butterfly (fixed order). The forward holds
// the row in registers (cuda_rows.cuh: 128-bit loads and stores, each element read once) where
// C % 8 == 0, C <= 2048 and the row tensors share a dtype and are 16-byte aligned, and can fuse
// the residual add before it; else (and in backward) lanes stride over the channels. Both forms
// add a lane's C / 32 squares in sequence, then the 32 lane sums by butterfly: the same error
// bound, other bits. dweight: the rows are cut into fixed chunks of kPartialRows (a function of N
// only, not of the GPU); one block per (32 columns, chunk) sums its chunk in a fixed order into a
// partial, and add_column_partials adds the partials in chunk order. No atomics: the same inputs
// give the same bits on every run.
#include "kernels/cuda/cuda_rows.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kRowsPerBlock = 8;   // warps per block of the row kernels
constexpr int kPartialRows = 128;  // rows per partial of dweight
constexpr int kColumnThreadsY = 8;

// value rounded through `dtype` (RNE) and back to fp32: core/dtype.h's round_through.
__device__ __forceinline__ float round_to_storage(DType dtype, float value) {
  switch (dtype) {
    case DType::F16:
      return __half2float(__float2half_rn(value));
    case DType::BF16:
      return __bfloat162float(__float2bfloat16_rn(value));
    default:
      return value;
  }
}

// out (N,C) = round(inp * rstd) * weight, rstd (N); one warp per row.
__global__ void rmsnorm_forward_kernel(DeviceTensor out, float* rstd, DeviceTensor inp,
                                       DeviceTensor weight, float eps, int64_t N, int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C;
  float squares = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float x = load(inp, base + c);
    squares += x * x;
  }
  const float r = 1.0f / sqrtf(warp_sum(squares) / static_cast<float>(C) + eps);
  // The second read of the row hits the cache: the row was just read by this warp.
  for (int64_t c = lane; c < C; c += 32) {
    store(out, base + c, round_to_storage(inp.dtype, load(inp, base + c) * r) * load(weight, c));
  }
  if (lane == 0) rstd[n] = r;
}

// out (N,C), rstd (N) as rmsnorm_forward_kernel, the row in registers; weight (C) any float
// dtype. With residual_b (not null) the rows are inp + residual_b, stored to residual (N,C) on
// the way: the residual add fused in.
template <class T, int kPacks, bool kResidual>
__global__ void rmsnorm_forward_vector_kernel(T* out, float* rstd, const T* inp,
                                              const T* residual_b, T* residual, DeviceTensor weight,
                                              float eps, int64_t N, int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C, packs = C / kVectorElements;
  float x[kPacks][kVectorElements];
  load_row<T, kPacks, kResidual>(x, inp, residual_b, residual, base, packs, lane);
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (lane + 32 * k >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) squares += x[k][j] * x[k][j];
  }
  const float r = 1.0f / sqrtf(warp_sum(squares) / static_cast<float>(C) + eps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    float w[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      x[k][j] = to_float(from_float<T>(x[k][j] * r)) * w[j];
    }
    store_vector(out + base + p * kVectorElements, x[k]);
  }
  if (lane == 0) rstd[n] = r;
}

// residual and residual_b: empty, or the fused residual add (see the kernel).
void launch_forward_vector(int packs, Tensor out, Tensor rstd, Tensor inp, Tensor residual_b,
                           Tensor residual, Tensor weight, float eps, RowShape s,
                           cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_packs(packs, [&](auto kPacks) {
      with_residual(!residual_b.empty(), [&](auto kResidual) {
        DSTRAIN_LAUNCH(
            (rmsnorm_forward_vector_kernel<T, decltype(kPacks)::value, decltype(kResidual)::value>),
            ceil_div(s.rows, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream)
        (static_cast<T*>(out.data), rstd.f32(), static_cast<const T*>(inp.data),
         static_cast<const T*>(residual_b.data), static_cast<T*>(residual.data),
         device_tensor(weight), eps, s.rows, s.cols);
      });
    });
  });
  CUDA_CHECK_LAUNCH();
}

// dinp (N,C) += rstd * (dnorm - norm * mean(dnorm * norm)), dnorm = w * dout, norm = x * rstd
// (unrounded: the rounding to storage passes the gradient straight through). One warp per row.
__global__ void rmsnorm_backward_dinp_kernel(DeviceTensor dinp, DeviceTensor dout, DeviceTensor inp,
                                             DeviceTensor weight, const float* rstd, int64_t N,
                                             int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C;
  const float r = rstd[n];
  float dnorm_norm_sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    dnorm_norm_sum += load(weight, c) * load(dout, base + c) * (load(inp, base + c) * r);
  }
  const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / static_cast<float>(C);
  for (int64_t c = lane; c < C; c += 32) {
    const float dnorm = load(weight, c) * load(dout, base + c);
    const float dx = (dnorm - load(inp, base + c) * r * dnorm_norm_mean) * r;
    store(dinp, base + c, load(dinp, base + c) + dx);
  }
}

// partial_dw (chunks, C): per chunk of kPartialRows rows, the sum of dout * round(inp * rstd)
// (the rounded norm: what forward multiplied the weight with). Block (32, kColumnThreadsY),
// grid (column blocks, chunks).
__global__ void rmsnorm_dweight_partials_kernel(float* partial_dw, DeviceTensor dout,
                                                DeviceTensor inp, const float* rstd, int64_t N,
                                                int64_t C) {
  __shared__ float sums[kColumnThreadsY][32];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  const int64_t row_begin = blockIdx.y * int64_t{kPartialRows};
  const int64_t row_end = min(row_begin + kPartialRows, N);
  float sum = 0.0f;
  if (c < C) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kColumnThreadsY) {
      sum += load(dout, r * C + c) * round_to_storage(inp.dtype, load(inp, r * C + c) * rstd[r]);
    }
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float total = 0.0f;
  for (int y = 0; y < kColumnThreadsY; ++y) total += sums[y][threadIdx.x];  // fixed order
  partial_dw[blockIdx.y * C + c] = total;
}

// dweight (C) += sum over the N rows of dout * round(inp * rstd), deterministic.
void rmsnorm_dweight(const CudaContext& ctx, Tensor dweight, Tensor dout, Tensor inp,
                     const float* rstd, RowShape s, cudaStream_t stream) {
  const int64_t chunks = (s.rows + kPartialRows - 1) / kPartialRows;
  DSTRAIN_CHECK(chunks <= 65535) << "rmsnorm dweight over " << s.rows << " rows: at most "
                                 << 65535 * int64_t{kPartialRows} << " rows";
  Scratch partials(ctx, static_cast<size_t>(chunks * s.cols) * sizeof(float), stream);
  const dim3 grid(ceil_div(s.cols, 32), static_cast<unsigned>(chunks));
  DSTRAIN_LAUNCH(rmsnorm_dweight_partials_kernel, grid, dim3(32, kColumnThreadsY), 0, stream)
  (partials.as<float>(), device_tensor(dout), device_tensor(inp), rstd, s.rows, s.cols);
  CUDA_CHECK_LAUNCH();
  add_column_partials(dweight, partials.as<float>(), chunks, stream);
}

}  // namespace

void rmsnorm_forward(const CudaContext& ctx, Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                     float eps, cudaStream_t stream) {
  check_float_tensor(ctx, out, "rmsnorm out");
  check_float_tensor(ctx, inp, "rmsnorm inp");
  check_float_tensor(ctx, weight, "rmsnorm weight");
  check_tensor_dtype(ctx, rstd, DType::F32, "rmsnorm rstd");
  const RowShape s = check_rmsnorm_shapes(out, rstd, inp, weight, eps);
  if (s.rows == 0) return;
  if (const int packs = register_packs(s.cols, {out, inp}, {weight})) {
    return launch_forward_vector(packs, out, rstd, inp, Tensor(), Tensor(), weight, eps, s, stream);
  }
  DSTRAIN_LAUNCH(rmsnorm_forward_kernel, ceil_div(s.rows, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                 stream)
  (device_tensor(out), rstd.f32(), device_tensor(inp), device_tensor(weight), eps, s.rows, s.cols);
  CUDA_CHECK_LAUNCH();
}

// One pass where the rows fit the register-held form, else the two ops (the same bits).
void residual_rmsnorm_forward(const CudaContext& ctx, Tensor residual, Tensor out, Tensor rstd,
                              Tensor a, Tensor b, Tensor weight, float eps, cudaStream_t stream) {
  check_residual_operands(ctx, residual, a, b);
  check_float_tensor(ctx, out, "rmsnorm out");
  check_float_tensor(ctx, weight, "rmsnorm weight");
  check_tensor_dtype(ctx, rstd, DType::F32, "rmsnorm rstd");
  const RowShape s = check_rmsnorm_shapes(out, rstd, a, weight, eps);
  const int packs = register_packs(s.cols, {out, a, b, residual}, {weight});
  if (packs == 0) {
    residual_forward(ctx, residual, a, b, stream);
    rmsnorm_forward(ctx, out, rstd, residual, weight, eps, stream);
    return;
  }
  if (s.rows == 0) return;
  launch_forward_vector(packs, out, rstd, a, b, residual, weight, eps, s, stream);
}

void rmsnorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                      Tensor weight, Tensor rstd, cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "rmsnorm dinp");
  check_float_tensor(ctx, dweight, "rmsnorm dweight");
  check_float_tensor(ctx, dout, "rmsnorm dout");
  check_float_tensor(ctx, inp, "rmsnorm inp");
  check_float_tensor(ctx, weight, "rmsnorm weight");
  check_tensor_dtype(ctx, rstd, DType::F32, "rmsnorm rstd");
  const RowShape s = check_rmsnorm_backward_shapes(dinp, dweight, dout, inp, weight, rstd);
  if (s.rows == 0) return;
  DSTRAIN_LAUNCH(rmsnorm_backward_dinp_kernel, ceil_div(s.rows, kRowsPerBlock), 32 * kRowsPerBlock,
                 0, stream)
  (device_tensor(dinp), device_tensor(dout), device_tensor(inp), device_tensor(weight), rstd.f32(),
   s.rows, s.cols);
  CUDA_CHECK_LAUNCH();
  rmsnorm_dweight(ctx, dweight, dout, inp, rstd.f32(), s, stream);
}

}  // namespace dstrain::cuda
