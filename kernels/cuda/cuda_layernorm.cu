// CUDA layernorm (eps 1e-5, biased variance, fp32 statistics) and the deterministic column
// sums it shares with matmul's dbias.
//
// Rows: one warp per row, lanes striding over the channels, reductions by warp butterfly (fixed
// order). Columns (dweight, dbias): the rows are cut into fixed chunks of kPartialRows (a
// function of N only, not of the GPU); one block per (32 columns, chunk) sums its chunk in a
// fixed order into a partial, and a second kernel adds the partials in chunk order to the
// gradient. No atomics: the same inputs give the same bits on every run.
//
// Row kernels in two forms. Where C % 8 == 0, C <= kMaxRegisterC, and every row tensor (inp,
// out, dout, dinp) has one storage dtype T with 16-byte aligned pointers (weight and bias too),
// a kernel templated on T and on the packs per lane holds its lanes' share of the row in
// registers: each row element is read from memory once, with 128-bit loads (8 elements per
// lane per pack, packs lane, lane + 32, ...), and written with 128-bit stores. Otherwise the
// scalar kernels below, which read the row again for each pass.
//
// Reduction order: in both forms a lane adds its C / 32 elements in sequence and the warp adds
// the 32 lane sums by butterfly; only which elements a lane holds differs (8 consecutive per pack
// vs a stride of 32). Each sum is still a sequential sum of C / 32 terms followed by 5 pairwise
// levels, so the error bound behind the tests' tolerances (|error| <= (C / 32 + 5) * eps * sum
// of |terms|, against the CPU's sequential sum's C * eps * sum of |terms|) is the same.
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

namespace {

constexpr float kLayernormEps = 1e-5f;
constexpr int kRowsPerBlock = 8;   // warps per block of the row kernels
constexpr int kPartialRows = 128;  // rows per partial of the column sums
constexpr int kColumnThreadsY = 8;
// Register-held rows: up to kMaxPacks packs of 8 elements per lane, so C <= 32 * 8 * kMaxPacks.
constexpr int kMaxPacks = 8;
constexpr int64_t kMaxRegisterC = int64_t{32} * kVectorElements * kMaxPacks;

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

// ---- the vector forms: lane `lane` holds packs p = lane + 32 * k (k < kPacks, p < C / 8) of its
// row, elements 8p .. 8p + 7, as fp32 in registers ----

// out (N,C), mean (N), rstd (N) as layernorm_forward_kernel; weight, bias (C) in any float dtype.
template <class T, int kPacks>
__global__ void layernorm_forward_vector_kernel(T* out, float* mean, float* rstd, const T* inp,
                                                DeviceTensor weight, DeviceTensor bias, int64_t N,
                                                int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C, packs = C / kVectorElements;
  float x[kPacks][kVectorElements];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {  // every load issued before the first use
    const int64_t p = lane + 32 * k;
    if (p < packs) load_vector(inp + base + p * kVectorElements, x[k]);
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (lane + 32 * k >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) sum += x[k][j];
  }
  const float m = warp_sum(sum) / static_cast<float>(C);
  float squares = 0.0f;  // two-pass variance over the registers: no cancellation, no re-read
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (lane + 32 * k >= packs) continue;
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      const float d = x[k][j] - m;
      squares += d * d;
    }
  }
  const float s = 1.0f / sqrtf(warp_sum(squares) / static_cast<float>(C) + kLayernormEps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    float w[kVectorElements], b[kVectorElements];
    load_vector(weight, p * kVectorElements, w);
    load_vector(bias, p * kVectorElements, b);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) x[k][j] = (x[k][j] - m) * s * w[j] + b[j];
    store_vector(out + base + p * kVectorElements, x[k]);
  }
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

// dinp (N,C) += ... as layernorm_backward_dinp_kernel, with inp and dout read once: x holds
// norm and dy holds dnorm after the first pass. weight (C) in any float dtype.
template <class T, int kPacks>
__global__ void layernorm_backward_dinp_vector_kernel(T* dinp, const T* dout, const T* inp,
                                                      DeviceTensor weight, const float* mean,
                                                      const float* rstd, int64_t N, int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t base = n * C, packs = C / kVectorElements;
  const float m = mean[n], s = rstd[n];
  float x[kPacks][kVectorElements], dy[kPacks][kVectorElements];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    load_vector(inp + base + p * kVectorElements, x[k]);
    load_vector(dout + base + p * kVectorElements, dy[k]);
  }
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
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
  const float dnorm_mean = warp_sum(dnorm_sum) / static_cast<float>(C);
  const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / static_cast<float>(C);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    float d[kVectorElements];
    load_vector(dinp + base + p * kVectorElements, d);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      d[j] = d[j] + (dy[k][j] - dnorm_mean - x[k][j] * dnorm_norm_mean) * s;
    }
    store_vector(dinp + base + p * kVectorElements, d);
  }
}

// Partial column sums of one chunk of rows. Block (32, kColumnThreadsY), grid (column blocks,
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
  const dim3 grid(ceil_div(C, 32), static_cast<unsigned>(chunks));
  const dim3 block(32, kColumnThreadsY);
  if (with_norm) {
    DSTRAIN_LAUNCH(column_partials_kernel<true>, grid, block, 0, stream)
    (partial_dy, partial_dw, device_tensor(dout), device_tensor(inp), mean, rstd, N, C);
  } else {
    DSTRAIN_LAUNCH(column_partials_kernel<false>, grid, block, 0, stream)
    (partial_dy, nullptr, device_tensor(dout), DeviceTensor{nullptr, DType::F32}, nullptr, nullptr,
     N, C);
  }
  CUDA_CHECK_LAUNCH();
  DSTRAIN_LAUNCH(add_partials_kernel, ceil_div(C, 256), 256, 0, stream)
  (device_tensor(dy_sum), partial_dy, chunks, C);
  CUDA_CHECK_LAUNCH();
  if (with_norm) {
    DSTRAIN_LAUNCH(add_partials_kernel, ceil_div(C, 256), 256, 0, stream)
    (device_tensor(dw_sum), partial_dw, chunks, C);
    CUDA_CHECK_LAUNCH();
  }
}

// Packs per lane of the register-held vector form for rows of C elements in `rows` (one dtype,
// 16-byte aligned) with `params` (aligned); 0 where that form does not apply. Instantiated for
// 2, 4 and 8 packs (C <= 512, 1024, 2048).
int register_packs(int64_t C, std::initializer_list<Tensor> rows,
                   std::initializer_list<Tensor> params) {
  if (C % kVectorElements != 0 || C > kMaxRegisterC) return 0;
  for (const Tensor& t : rows) {
    if (t.dtype != rows.begin()->dtype || !vector_aligned(t.data)) return 0;
  }
  for (const Tensor& t : params) {
    if (!vector_aligned(t.data)) return 0;
  }
  const int64_t per_lane = (C / kVectorElements + 31) / 32;
  return per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : kMaxPacks;
}

// Calls f(std::integral_constant<int, packs>{}) for packs 2, 4 or 8.
template <class F>
void with_packs(int packs, F&& f) {
  if (packs == 2) {
    f(std::integral_constant<int, 2>{});
  } else if (packs == 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, kMaxPacks>{});
  }
}

void launch_forward_vector(int packs, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                           Tensor weight, Tensor bias, int64_t N, int64_t C, cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_packs(packs, [&](auto kPacks) {
      DSTRAIN_LAUNCH((layernorm_forward_vector_kernel<T, decltype(kPacks)::value>),
                     ceil_div(N, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream)
      (static_cast<T*>(out.data), mean.f32(), rstd.f32(), static_cast<const T*>(inp.data),
       device_tensor(weight), device_tensor(bias), N, C);
    });
  });
}

void launch_backward_dinp_vector(int packs, Tensor dinp, Tensor dout, Tensor inp, Tensor weight,
                                 Tensor mean, Tensor rstd, int64_t N, int64_t C,
                                 cudaStream_t stream) {
  with_storage_type(inp.dtype, [&](auto tag) {
    using T = decltype(tag);
    with_packs(packs, [&](auto kPacks) {
      DSTRAIN_LAUNCH((layernorm_backward_dinp_vector_kernel<T, decltype(kPacks)::value>),
                     ceil_div(N, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream)
      (static_cast<T*>(dinp.data), static_cast<const T*>(dout.data),
       static_cast<const T*>(inp.data), device_tensor(weight), mean.f32(), rstd.f32(), N, C);
    });
  });
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias, cudaStream_t stream) {
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
  if (N == 0) return;
  if (const int packs = register_packs(C, {out, inp}, {weight, bias})) {
    launch_forward_vector(packs, out, mean, rstd, inp, weight, bias, N, C, stream);
  } else {
    DSTRAIN_LAUNCH(layernorm_forward_kernel, ceil_div(N, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                   stream)
    (device_tensor(out), mean.f32(), rstd.f32(), device_tensor(inp), device_tensor(weight),
     device_tensor(bias), N, C);
  }
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
  if (const int packs = register_packs(C, {dinp, dout, inp}, {weight})) {
    launch_backward_dinp_vector(packs, dinp, dout, inp, weight, mean, rstd, N, C, stream);
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
