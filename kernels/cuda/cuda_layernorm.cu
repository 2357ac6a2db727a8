// CUDA layernorm (eps 1e-5, biased variance, fp32 statistics) and the deterministic column
// sums it shares with matmul's dbias.
//
// Rows: one warp per row, lanes striding over the channels, reductions by warp butterfly (fixed
// order). Columns (dweight, dbias): the rows are cut into fixed chunks of kPartialRows (a
// function of N only, not of the GPU); one block per (columns, chunk) sums its chunk in a fixed
// order into a partial (8 adjacent columns per thread with 128-bit loads where C % 8 == 0 and
// the rows are aligned, else one column per thread: the same order per column, the same bits),
// and a second kernel adds the partials in chunk order to the gradient. No atomics: the same
// inputs give the same bits on every run.
//
// Row kernels in two forms. Where C % 8 == 0, C <= kMaxRegisterC (8192), and every row tensor
// (inp, out, dout, dinp) has one storage dtype T with 16-byte aligned pointers (weight and bias
// too), a kernel templated on T, the warps per row and the packs per thread holds the row in
// registers (cuda_rows.cuh): each row element is read from memory once, with 128-bit loads, and
// written with 128-bit stores. Otherwise the scalar kernels below, one warp per row, which read
// the row again for each pass.
//
// Reduction order: in the scalar form a lane adds its C / 32 elements in sequence and the warp
// adds the 32 lane sums by butterfly; the vector form differs in which elements a thread holds (8
// consecutive per pack vs a stride of 32) and, for C > 2048, in the 8 warp sums added after the
// butterfly. Each sum is a sequential sum of at most C / 32 terms followed by at most 13
// pairwise levels, so the error bound behind the tests' tolerances (|error| <= (C / 32 + 13) *
// eps * sum of |terms|, against the CPU's sequential sum's C * eps * sum of |terms|) holds.
#include <algorithm>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_columns.cuh"
#include "kernels/cuda/cuda_rows.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

constexpr float kLayernormEps = 1e-5f;
constexpr int kRowsPerBlock = 8;  // warps (rows) per block of the scalar row kernels

// out (N,C), mean (N), rstd (N); one warp per row.
__global__ void layernorm_forward_kernel(DeviceTensor out, float* mean, float* rstd,
                                         DeviceTensor inp, DeviceTensor weight, DeviceTensor bias,
                                         int64_t N, int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C;
  float sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) sum += load(inp, base + c);
  const float m = warp_sum(sum) / static_cast<float>(C);
  float squares = 0.0f;  // two-pass variance: no cancellation
  for (int64_t c = lane; c < C; c += 32) {
    const float d = load(inp, base + c) - m;
    squares += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(squares) / static_cast<float>(C) + kLayernormEps);
  for (int64_t c = lane; c < C; c += 32) {
    store(out, base + c, (load(inp, base + c) - m) * s * load(weight, c) + load(bias, c));
  }
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

// dinp (N,C) += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = w * dout.
__global__ void layernorm_backward_dinp_kernel(DeviceTensor dinp, DeviceTensor dout,
                                               DeviceTensor inp, DeviceTensor weight,
                                               const float* mean, const float* rstd, int64_t N,
                                               int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C;
  const float m = mean[n], s = rstd[n];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float norm = (load(inp, base + c) - m) * s;
    const float dnorm = load(weight, c) * load(dout, base + c);
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean = warp_sum(dnorm_sum) / static_cast<float>(C);
  const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / static_cast<float>(C);
  for (int64_t c = lane; c < C; c += 32) {
    const float norm = (load(inp, base + c) - m) * s;
    const float dnorm = load(weight, c) * load(dout, base + c);
    const float dx = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    store(dinp, base + c, load(dinp, base + c) + dx);
  }
}

// ---- the vector forms: rows in registers (cuda_rows.cuh) ----

// out (N,C), mean (N), rstd (N) as layernorm_forward_kernel of the rows inp; weight, bias (C) in
// any float dtype. With residual_b (not null) the rows are inp + residual_b, stored to residual
// (N,C) on the way: the residual add fused in.
template <class T, int kWarps, int kPacks, bool kResidual>
__global__ void layernorm_forward_vector_kernel(T* out, float* mean, float* rstd, const T* inp,
                                                const T* residual_b, T* residual,
                                                DeviceTensor weight, DeviceTensor bias, int64_t N,
                                                int64_t C) {
  const RowThread<kWarps> row;
  if (row.n >= N) return;
  const int64_t n = row.n, base = n * C, packs = C / kVectorElements;
  float x[kPacks][kVectorElements];
  load_row<T, kWarps, kPacks, kResidual>(x, inp, residual_b, residual, base, packs, row);
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (row.pack(k) >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) sum += x[k][j];
  }
  const float m = row_sum<kWarps>(sum) / static_cast<float>(C);
  float squares = 0.0f;  // two-pass variance over the registers: no cancellation, no re-read
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (row.pack(k) >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      const float d = x[k][j] - m;
      squares += d * d;
    }
  }
  const float s = 1.0f / sqrtf(row_sum<kWarps>(squares) / static_cast<float>(C) + kLayernormEps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    float w[kVectorElements], b[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
    load_vector(bias, p * kVectorElements, b);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) x[k][j] = (x[k][j] - m) * s * w[j] + b[j];
    store_vector(out + base + p * kVectorElements, x[k]);
  }
  if (row.t == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

// dinp (N,C) += ... as layernorm_backward_dinp_kernel, with inp and dout read once: x holds
// norm and dy holds dnorm after the first pass. weight (C) in any float dtype.
template <class T, int kWarps, int kPacks>
__global__ void layernorm_backward_dinp_vector_kernel(T* dinp, const T* dout, const T* inp,
                                                      DeviceTensor weight, const float* mean,
                                                      const float* rstd, int64_t N, int64_t C) {
  const RowThread<kWarps> row;
  if (row.n >= N) return;
  const int64_t n = row.n, base = n * C, packs = C / kVectorElements;
  const float m = mean[n], s = rstd[n];
  float x[kPacks][kVectorElements], dy[kPacks][kVectorElements];
  load_rows(x, dy, inp, dout, base, packs, row);
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = row.pack(k);
    if (p >= packs) continue;
    float w[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      x[k][j] = (x[k][j] - m) * s;  // norm
      dy[k][j] = w[j] * dy[k][j];   // dnorm
      dnorm_sum += dy[k][j];
      dnorm_norm_sum += dy[k][j] * x[k][j];
    }
  }
  const float dnorm_mean = row_sum<kWarps>(dnorm_sum) / static_cast<float>(C);
  const float dnorm_norm_mean = row_sum<kWarps>(dnorm_norm_sum) / static_cast<float>(C);
  add_to_row<kPacks>(dinp, base, packs, row, [&](int k, int j) {
    return (dy[k][j] - dnorm_mean - x[k][j] * dnorm_norm_mean) * s;
  });
}

// Partial column sums of one chunk of rows, 16 bits at a time (the fallback of the vector
// kernel below). Block (32, kColumnThreadsY), grid (column blocks,
// chunks). partial_dy (chunks, C) = sum of dout; with kWithNorm also partial_dw (chunks, C) =
// sum of norm * dout, norm = (inp - mean) * rstd.
template <bool kWithNorm>
__global__ void column_partials_kernel(float* partial_dy, float* partial_dw, DeviceTensor dout,
                                       DeviceTensor inp, const float* mean, const float* rstd,
                                       int64_t N, int64_t C) {
  __shared__ float dy_sums[kColumnThreadsY][32];
  __shared__ float dw_sums[kColumnThreadsY][32];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  const int64_t row_begin = blockIdx.y * int64_t{kPartialRows};
  const int64_t row_end = min(row_begin + kPartialRows, N);
  float dy_sum = 0.0f, dw_sum = 0.0f;
  if (c < C) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kColumnThreadsY) {
      const float dy = load(dout, r * C + c);
      dy_sum += dy;
      if constexpr (kWithNorm) dw_sum += (load(inp, r * C + c) - mean[r]) * rstd[r] * dy;
    }
  }
  dy_sums[threadIdx.y][threadIdx.x] = dy_sum;
  dw_sums[threadIdx.y][threadIdx.x] = dw_sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float dy_total = 0.0f, dw_total = 0.0f;
  for (int y = 0; y < kColumnThreadsY; ++y) {  // fixed order
    dy_total += dy_sums[y][threadIdx.x];
    dw_total += dw_sums[y][threadIdx.x];
  }
  partial_dy[blockIdx.y * C + c] = dy_total;
  if constexpr (kWithNorm) partial_dw[blockIdx.y * C + c] = dw_total;
}

// The same partial sums with 128-bit loads: a thread sums 8 adjacent columns (one pack of
// dout, and of inp with kWithNorm) in the order of cuda_columns.cuh: per column the same terms
// in the same order as column_partials_kernel, so the same partials.
// REQUIRES: C % 8 == 0; dout (and inp) of storage type T, 16-byte aligned.
template <class T, bool kWithNorm>
__global__ void column_partials_vector_kernel(float* partial_dy, float* partial_dw, const T* dout,
                                              const T* inp, const float* mean, const float* rstd,
                                              int64_t N, int64_t C) {
  const int64_t c = vector_column();
  float dy_sum[kVectorElements] = {}, dw_sum[kVectorElements] = {};
  for_chunk_rows(N, c, C, [&](int64_t r) {
    float dy[kVectorElements], x[kVectorElements];
    load_vector(dout + r * C + c, dy);
    if constexpr (kWithNorm) load_vector(inp + r * C + c, x);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      dy_sum[j] += dy[j];
      if constexpr (kWithNorm) dw_sum[j] += (x[j] - mean[r]) * rstd[r] * dy[j];
    }
  });
  column_block_sum(partial_dy + blockIdx.y * C, dy_sum, c, C);
  if constexpr (kWithNorm) column_block_sum(partial_dw + blockIdx.y * C, dw_sum, c, C);
}

// The partials of column_sums: the vector kernel where dout (and inp) allow, else the scalar.
void launch_column_partials(float* partial_dy, float* partial_dw, Tensor dout, Tensor inp,
                            const float* mean, const float* rstd, int64_t N, int64_t C,
                            int64_t chunks, cudaStream_t stream) {
  const bool with_norm = partial_dw != nullptr;
  const bool vector = C % kVectorElements == 0 && vector_aligned(dout.data) &&
                      (!with_norm || (inp.dtype == dout.dtype && vector_aligned(inp.data)));
  if (vector) {
    const dim3 grid(ceil_div(C, kColumnPacks * kVectorElements), static_cast<unsigned>(chunks));
    const dim3 block(kColumnPacks, kColumnThreadsY);
    with_storage_type(dout.dtype, [&](auto tag) {
      using T = decltype(tag);
      const auto* dy = static_cast<const T*>(dout.data);
      const auto* x = static_cast<const T*>(inp.data);
      if (with_norm) {
        DSTRAIN_LAUNCH((column_partials_vector_kernel<T, true>), grid, block, 0, stream)
        (partial_dy, partial_dw, dy, x, mean, rstd, N, C);
      } else {
        DSTRAIN_LAUNCH((column_partials_vector_kernel<T, false>), grid, block, 0, stream)
        (partial_dy, nullptr, dy, nullptr, nullptr, nullptr, N, C);
      }
    });
  } else {
    const dim3 grid(ceil_div(C, 32), static_cast<unsigned>(chunks));
    const dim3 block(32, kColumnThreadsY);
    if (with_norm) {
      DSTRAIN_LAUNCH(column_partials_kernel<true>, grid, block, 0, stream)
      (partial_dy, partial_dw, device_tensor(dout), device_tensor(inp), mean, rstd, N, C);
    } else {
      DSTRAIN_LAUNCH(column_partials_kernel<false>, grid, block, 0, stream)
      (partial_dy, nullptr, device_tensor(dout), DeviceTensor{nullptr, DType::F32}, nullptr,
       nullptr, N, C);
    }
  }
  CUDA_CHECK_LAUNCH();
}

// dst (C) += the partials (chunks, C) added in chunk order; one thread per column.
__global__ void add_partials_kernel(DeviceTensor dst, const float* partials, int64_t chunks,
                                    int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float sum = 0.0f;
  for (int64_t p = 0; p < chunks; ++p) sum += partials[p * C + c];
  store(dst, c, load(dst, c) + sum);
}

// dy_sum (C) += column sums of dout (N,C); with inp/mean/rstd also dw_sum += sums of norm*dout.
void column_sums(const CudaContext& ctx, Tensor dy_sum, Tensor dw_sum, Tensor dout, Tensor inp,
                 const float* mean, const float* rstd, int64_t N, int64_t C, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  const bool with_norm = !dw_sum.empty();
  const int64_t chunks = (N + kPartialRows - 1) / kPartialRows;
  DSTRAIN_CHECK(chunks <= 65535) << "column sums over " << N << " rows: at most "
                                 << 65535 * int64_t{kPartialRows} << " rows";
  const size_t partial_bytes = align_up(static_cast<size_t>(chunks * C) * sizeof(float));
  Scratch scratch(ctx, (with_norm ? 2 : 1) * partial_bytes, stream);
  float* partial_dy = scratch.as<float>();
  float* partial_dw = with_norm ? partial_dy + partial_bytes / sizeof(float) : nullptr;
  launch_column_partials(partial_dy, partial_dw, dout, inp, mean, rstd, N, C, chunks, stream);
  DSTRAIN_LAUNCH(add_partials_kernel, ceil_div(C, 256), 256, 0, stream)
  (device_tensor(dy_sum), partial_dy, chunks, C);
  CUDA_CHECK_LAUNCH();
  if (with_norm) {
    DSTRAIN_LAUNCH(add_partials_kernel, ceil_div(C, 256), 256, 0, stream)
    (device_tensor(dw_sum), partial_dw, chunks, C);
    CUDA_CHECK_LAUNCH();
  }
}

// residual and residual_b: empty, or the fused residual add (see the kernel).
void launch_forward_vector(RowForm form, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                           Tensor residual_b, Tensor residual, Tensor weight, Tensor bias,
                           int64_t N, int64_t C, cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_row_form(form, [&](auto kWarps, auto kPacks) {
      with_residual(!residual_b.empty(), [&](auto kResidual) {
        DSTRAIN_LAUNCH(
            (layernorm_forward_vector_kernel<T, decltype(kWarps)::value, decltype(kPacks)::value,
                                             decltype(kResidual)::value>),
            form.blocks(N), kRowBlockThreads, 0, stream)
        (static_cast<T*>(out.data), mean.f32(), rstd.f32(), static_cast<const T*>(inp.data),
         static_cast<const T*>(residual_b.data), static_cast<T*>(residual.data),
         device_tensor(weight), device_tensor(bias), N, C);
      });
    });
  });
}

void launch_backward_dinp_vector(RowForm form, Tensor dinp, Tensor dout, Tensor inp, Tensor weight,
                                 Tensor mean, Tensor rstd, int64_t N, int64_t C,
                                 cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_row_form(form, [&](auto kWarps, auto kPacks) {
      DSTRAIN_LAUNCH((layernorm_backward_dinp_vector_kernel<T, decltype(kWarps)::value,
                                                            decltype(kPacks)::value>),
                     form.blocks(N), kRowBlockThreads, 0, stream)
      (static_cast<T*>(dinp.data), static_cast<const T*>(dout.data),
       static_cast<const T*>(inp.data), device_tensor(weight), mean.f32(), rstd.f32(), N, C);
    });
  });
}

}  // namespace

namespace {

// The checks of layernorm_forward; returns the rows (N, C).
RowShape check_layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd,
                                 Tensor inp, Tensor weight, Tensor bias) {
  check_float_tensor(ctx, out, "layernorm out");
  check_float_tensor(ctx, inp, "layernorm inp");
  check_float_tensor(ctx, weight, "layernorm weight");
  check_float_tensor(ctx, bias, "layernorm bias");
  check_tensor_dtype(ctx, mean, DType::F32, "layernorm mean");
  check_tensor_dtype(ctx, rstd, DType::F32, "layernorm rstd");
  const int64_t C = cols_of(inp), N = rows_of(inp);
  DSTRAIN_CHECK(C > 0) << "layernorm inp " << inp.shape_str();
  check_same_numel(out, "layernorm out", inp, "inp");
  DSTRAIN_CHECK(cols_of(out) == C) << "layernorm out " << out.shape_str();
  DSTRAIN_CHECK(mean.numel() == N && rstd.numel() == N)
      << "layernorm mean " << mean.shape_str() << " and rstd " << rstd.shape_str() << " must have "
      << N << " elements";
  DSTRAIN_CHECK(weight.numel() == C && bias.numel() == C)
      << "layernorm weight " << weight.shape_str() << " and bias " << bias.shape_str()
      << " must have " << C << " elements";
  return {N, C};
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias, cudaStream_t stream) {
  const auto [N, C] = check_layernorm_forward(ctx, out, mean, rstd, inp, weight, bias);
  if (N == 0) return;
  if (const RowForm form = row_form(RowPass::kForward, C, {out, inp}, {weight, bias})) {
    launch_forward_vector(form, out, mean, rstd, inp, Tensor(), Tensor(), weight, bias, N, C,
                          stream);
  } else {
    DSTRAIN_LAUNCH(layernorm_forward_kernel, ceil_div(N, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                   stream)
    (device_tensor(out), mean.f32(), rstd.f32(), device_tensor(inp), device_tensor(weight),
     device_tensor(bias), N, C);
  }
  CUDA_CHECK_LAUNCH();
}

// One pass where the rows fit the register-held form, else the two ops (the same bits).
void residual_layernorm_forward(const CudaContext& ctx, Tensor residual, Tensor out, Tensor mean,
                                Tensor rstd, Tensor a, Tensor b, Tensor weight, Tensor bias,
                                cudaStream_t stream) {
  check_residual_operands(ctx, residual, a, b);
  const auto [N, C] = check_layernorm_forward(ctx, out, mean, rstd, a, weight, bias);
  const RowForm form = row_form(RowPass::kForward, C, {out, a, b, residual}, {weight, bias});
  if (!form) {
    residual_forward(ctx, residual, a, b, stream);
    layernorm_forward(ctx, out, mean, rstd, residual, weight, bias, stream);
    return;
  }
  if (N == 0) return;
  launch_forward_vector(form, out, mean, rstd, a, b, residual, weight, bias, N, C, stream);
  CUDA_CHECK_LAUNCH();
}

void layernorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                        cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "layernorm dinp");
  check_float_tensor(ctx, dweight, "layernorm dweight");
  check_float_tensor(ctx, dbias, "layernorm dbias");
  check_float_tensor(ctx, dout, "layernorm dout");
  check_float_tensor(ctx, inp, "layernorm inp");
  check_float_tensor(ctx, weight, "layernorm weight");
  check_tensor_dtype(ctx, mean, DType::F32, "layernorm mean");
  check_tensor_dtype(ctx, rstd, DType::F32, "layernorm rstd");
  const int64_t C = cols_of(inp), N = rows_of(inp);
  DSTRAIN_CHECK(C > 0) << "layernorm inp " << inp.shape_str();
  check_same_numel(dinp, "layernorm dinp", inp, "inp");
  check_same_numel(dout, "layernorm dout", inp, "inp");
  DSTRAIN_CHECK(cols_of(dinp) == C && cols_of(dout) == C)
      << "layernorm dinp " << dinp.shape_str() << ", dout " << dout.shape_str();
  DSTRAIN_CHECK(mean.numel() == N && rstd.numel() == N)
      << "layernorm mean " << mean.shape_str() << " and rstd " << rstd.shape_str() << " must have "
      << N << " elements";
  DSTRAIN_CHECK(weight.numel() == C && dweight.numel() == C && dbias.numel() == C)
      << "layernorm weight " << weight.shape_str() << ", dweight " << dweight.shape_str()
      << ", dbias " << dbias.shape_str() << " must have " << C << " elements";
  if (N == 0) return;
  if (const RowForm form = row_form(RowPass::kBackward, C, {dinp, dout, inp}, {weight})) {
    launch_backward_dinp_vector(form, dinp, dout, inp, weight, mean, rstd, N, C, stream);
  } else {
    DSTRAIN_LAUNCH(layernorm_backward_dinp_kernel, ceil_div(N, kRowsPerBlock), 32 * kRowsPerBlock,
                   0, stream)
    (device_tensor(dinp), device_tensor(dout), device_tensor(inp), device_tensor(weight),
     mean.f32(), rstd.f32(), N, C);
  }
  CUDA_CHECK_LAUNCH();
  column_sums(ctx, dbias, dweight, dout, inp, mean.f32(), rstd.f32(), N, C, stream);
}

void column_sums_accumulate(const CudaContext& ctx, Tensor dsum, Tensor x, cudaStream_t stream) {
  check_float_tensor(ctx, dsum, "column sums dst");
  check_float_tensor(ctx, x, "column sums x");
  const int64_t C = cols_of(x), N = rows_of(x);
  DSTRAIN_CHECK(dsum.numel() == C) << "column sums dst " << dsum.shape_str() << " must have " << C
                                   << " elements for x " << x.shape_str();
  column_sums(ctx, dsum, Tensor(), x, Tensor(), nullptr, nullptr, N, C, stream);
}

void add_column_partials(Tensor dst, const float* partials, int64_t chunks, cudaStream_t stream) {
  const int64_t C = dst.numel();
  if (C == 0) return;
  DSTRAIN_LAUNCH(add_partials_kernel, ceil_div(C, 256), 256, 0, stream)
  (device_tensor(dst), partials, chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda

namespace dstrain {

void set_cuda_norm_block_rows_above(int64_t C) {
  for (const auto pass : {cuda::RowPass::kForward, cuda::RowPass::kBackward}) {
    cuda::block_rows_above(pass) = C < 0 ? cuda::kDefaultBlockRowsAbove[static_cast<int>(pass)]
                                         : std::min(C, cuda::kMaxWarpRowC);
  }
}

}  // namespace dstrain
