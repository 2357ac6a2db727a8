// CUDA RMSNorm (Llama, Qwen2): fp32 statistics, the normalized value rounded to the input's
// dtype before the weight multiply (as Hugging Face's LlamaRMSNorm), like the CPU twin.
//
// Rows: the forward and the backward's dinp hold the row in registers (cuda_rows.cuh: 128-bit
// loads and stores, each element read once; one warp per row for C <= 2048, a block of 8 warps
// for C <= 8192) where C % 8 == 0 and the row tensors share a dtype and are 16-byte aligned; the
// forward can fuse the residual add before it. Elsewhere one warp per row, lanes striding over
// the channels. Both forms add a thread's terms in sequence, then by butterfly (and, for wide
// rows, the 8 warp sums in order): the error bound of cuda_rows.cuh, other bits.
// dweight: the rows are cut into fixed chunks of kPartialRows (a function of N only, not of the
// GPU); one block per (columns, chunk) sums its chunk in a fixed order into a partial (8 adjacent
// columns per thread with 128-bit loads where C % 8 == 0 and dout, inp are aligned and of one
// dtype, else one column per thread: per column the same terms in the same order, the same
// bits), and add_column_partials adds the partials in chunk order. No atomics: the same inputs
// give the same bits on every run.
#include "kernels/cuda/cuda_columns.cuh"
#include "kernels/cuda/cuda_rows.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kRowsPerBlock = 8;  // warps (rows) per block of the scalar row kernels

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
template <class T, int kWarps, int kPacks, bool kResidual>
__global__ void rmsnorm_forward_vector_kernel(T* out, float* rstd, const T* inp,
                                              const T* residual_b, T* residual, DeviceTensor weight,
                                              float eps, int64_t N, int64_t C) {
  const RowThread<kWarps> row;
  if (row.n >= N) return;
  const int64_t n = row.n, base = n * C, packs = C / kVectorElements;
  float x[kPacks][kVectorElements];
  load_row<T, kWarps, kPacks, kResidual>(x, inp, residual_b, residual, base, packs, row);
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (row.pack(k) >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) squares += x[k][j] * x[k][j];
  }
  const float r = 1.0f / sqrtf(row_sum<kWarps>(squares) / static_cast<float>(C) + eps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    float w[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      x[k][j] = to_float(from_float<T>(x[k][j] * r)) * w[j];
    }
    store_vector(out + base + p * kVectorElements, x[k]);
  }
  if (row.t == 0) rstd[n] = r;
}

// residual and residual_b: empty, or the fused residual add (see the kernel).
void launch_forward_vector(RowForm form, Tensor out, Tensor rstd, Tensor inp, Tensor residual_b,
                           Tensor residual, Tensor weight, float eps, RowShape s,
                           cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_row_form(form, [&](auto kWarps, auto kPacks) {
      with_residual(!residual_b.empty(), [&](auto kResidual) {
        DSTRAIN_LAUNCH(
            (rmsnorm_forward_vector_kernel<T, decltype(kWarps)::value, decltype(kPacks)::value,
                                           decltype(kResidual)::value>),
            form.blocks(s.rows), kRowBlockThreads, 0, stream)
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

// dinp (N,C) += ... as rmsnorm_backward_dinp_kernel, the row in registers: x holds norm and dy
// holds dnorm after the first pass. weight (C) in any float dtype.
template <class T, int kWarps, int kPacks>
__global__ void rmsnorm_backward_dinp_vector_kernel(T* dinp, const T* dout, const T* inp,
                                                    DeviceTensor weight, const float* rstd,
                                                    int64_t N, int64_t C) {
  const RowThread<kWarps> row;
  if (row.n >= N) return;
  const int64_t n = row.n, base = n * C, packs = C / kVectorElements;
  const float r = rstd[n];
  float x[kPacks][kVectorElements], dy[kPacks][kVectorElements];
  load_rows(x, dy, inp, dout, base, packs, row);
  float dnorm_norm_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    float w[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      x[k][j] = x[k][j] * r;       // norm
      dy[k][j] = w[j] * dy[k][j];  // dnorm
      dnorm_norm_sum += dy[k][j] * x[k][j];
    }
  }
  const float dnorm_norm_mean = row_sum<kWarps>(dnorm_norm_sum) / static_cast<float>(C);
  add_to_row<kPacks>(dinp, base, packs, row,
                     [&](int k, int j) { return (dy[k][j] - x[k][j] * dnorm_norm_mean) * r; });
}

void launch_backward_dinp_vector(RowForm form, Tensor dinp, Tensor dout, Tensor inp, Tensor weight,
                                 Tensor rstd, RowShape s, cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_row_form(form, [&](auto kWarps, auto kPacks) {
      DSTRAIN_LAUNCH((rmsnorm_backward_dinp_vector_kernel<T, decltype(kWarps)::value,
                                                          decltype(kPacks)::value>),
                     form.blocks(s.rows), kRowBlockThreads, 0, stream)
      (static_cast<T*>(dinp.data), static_cast<const T*>(dout.data),
       static_cast<const T*>(inp.data), device_tensor(weight), rstd.f32(), s.rows, s.cols);
    });
  });
  CUDA_CHECK_LAUNCH();
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

// The same partials with 128-bit loads, in the order of cuda_columns.cuh: per column the terms
// and order of rmsnorm_dweight_partials_kernel, so the same partials. REQUIRES: C % 8 == 0;
// dout, inp of storage type T, 16-byte aligned.
template <class T>
__global__ void rmsnorm_dweight_partials_vector_kernel(float* partial_dw, const T* dout,
                                                       const T* inp, const float* rstd, int64_t N,
                                                       int64_t C) {
  const int64_t c = vector_column();
  float sum[kVectorElements] = {};
  for_chunk_rows(N, c, C, [&](int64_t r) {
    float dy[kVectorElements], x[kVectorElements];
    load_vector(dout + r * C + c, dy);
    load_vector(inp + r * C + c, x);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      sum[j] += dy[j] * to_float(from_float<T>(x[j] * rstd[r]));
    }
  });
  column_block_sum(partial_dw + blockIdx.y * C, sum, c, C);
}

// The partials of rmsnorm_dweight: the vector kernel where dout and inp allow, else the scalar.
void launch_dweight_partials(float* partials, Tensor dout, Tensor inp, const float* rstd,
                             RowShape s, int64_t chunks, cudaStream_t stream) {
  const bool vector = s.cols % kVectorElements == 0 && inp.dtype == dout.dtype &&
                      vector_aligned(dout.data) && vector_aligned(inp.data);
  if (!vector) {
    const dim3 grid(ceil_div(s.cols, 32), static_cast<unsigned>(chunks));
    DSTRAIN_LAUNCH(rmsnorm_dweight_partials_kernel, grid, dim3(32, kColumnThreadsY), 0, stream)
    (partials, device_tensor(dout), device_tensor(inp), rstd, s.rows, s.cols);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid(ceil_div(s.cols, kColumnPacks * kVectorElements), static_cast<unsigned>(chunks));
  with_storage_type(dout.dtype, [&](auto tag) {
    using T = decltype(tag);
    DSTRAIN_LAUNCH(rmsnorm_dweight_partials_vector_kernel<T>, grid,
                   dim3(kColumnPacks, kColumnThreadsY), 0, stream)
    (partials, static_cast<const T*>(dout.data), static_cast<const T*>(inp.data), rstd, s.rows,
     s.cols);
  });
  CUDA_CHECK_LAUNCH();
}

// dweight (C) += sum over the N rows of dout * round(inp * rstd), deterministic.
void rmsnorm_dweight(const CudaContext& ctx, Tensor dweight, Tensor dout, Tensor inp,
                     const float* rstd, RowShape s, cudaStream_t stream) {
  const int64_t chunks = (s.rows + kPartialRows - 1) / kPartialRows;
  DSTRAIN_CHECK(chunks <= 65535) << "rmsnorm dweight over " << s.rows << " rows: at most "
                                 << 65535 * int64_t{kPartialRows} << " rows";
  Scratch partials(ctx, static_cast<size_t>(chunks * s.cols) * sizeof(float), stream);
  launch_dweight_partials(partials.as<float>(), dout, inp, rstd, s, chunks, stream);
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
  if (const RowForm form = row_form(RowPass::kForward, s.cols, {out, inp}, {weight})) {
    return launch_forward_vector(form, out, rstd, inp, Tensor(), Tensor(), weight, eps, s, stream);
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
  const RowForm form = row_form(RowPass::kForward, s.cols, {out, a, b, residual}, {weight});
  if (!form) {
    residual_forward(ctx, residual, a, b, stream);
    rmsnorm_forward(ctx, out, rstd, residual, weight, eps, stream);
    return;
  }
  if (s.rows == 0) return;
  launch_forward_vector(form, out, rstd, a, b, residual, weight, eps, s, stream);
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
  if (const RowForm form = row_form(RowPass::kBackward, s.cols, {dinp, dout, inp}, {weight})) {
    launch_backward_dinp_vector(form, dinp, dout, inp, weight, rstd, s, stream);
  } else {
    DSTRAIN_LAUNCH(rmsnorm_backward_dinp_kernel, ceil_div(s.rows, kRowsPerBlock),
                   32 * kRowsPerBlock, 0, stream)
    (device_tensor(dinp), device_tensor(dout), device_tensor(inp), device_tensor(weight),
     rstd.f32(), s.rows, s.cols);
    CUDA_CHECK_LAUNCH();
  }
  rmsnorm_dweight(ctx, dweight, dout, inp, rstd.f32(), s, stream);
}

}  // namespace dstrain::cuda
