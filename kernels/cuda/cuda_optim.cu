// CUDA optimizer ops: AdamW, sum of squares (fp64), inf/NaN check -- each over a list of
// buffers in one launch (multi-tensor), the single-tensor ops being lists of one.
#include <cmath>
#include <vector>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;
// Gradient statistics: a buffer of n elements gets min(kMaxSumBlocks, ceil(n / kSumChunk))
// blocks that stride over it: the partition depends on n only, so each buffer's sum is the same
// on every GPU and run, and the same whether it is checked alone or in a list.
constexpr int64_t kSumChunk = 16384;
constexpr int64_t kMaxSumBlocks = 2048;
constexpr int kSumThreads = 1024;  // the block that adds one buffer's partials
// AdamW: one block per kAdamChunk elements of a buffer (4 vector steps per thread). A multiple
// of kVectorElements, so every chunk of an aligned buffer starts aligned.
constexpr int64_t kAdamChunk = int64_t{kThreads} * kVectorElements * 4;

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
__device__ __forceinline__ float adamw_update(const AdamWConstants& k, float decay, float param,
                                              float grad, float& m, float& v) {
  const float g = __fmul_rn(grad, k.grad_scale);
  const float param_decayed = __fmul_rn(param, decay);
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

// A row of a launch's buffer table: the blocks [first_block, next row's first_block) work on
// this buffer. Tables are sorted by first_block.
struct AdamWBuffer {
  float* param;             // (n)
  DeviceTensor grad;        // (n)
  float* m;                 // (n)
  float* v;                 // (n)
  DeviceTensor param_copy;  // (n) or data == nullptr
  float decay;              // 1 - lr * the buffer's weight decay
  int64_t n;
  int64_t first_block;
  bool vector;  // every pointer 16-byte aligned, grad and copy of the launch's types
};

struct StatsBuffer {
  DeviceTensor x;  // (n)
  int64_t n;
  int64_t first_block;
  int64_t blocks;  // min(kMaxSumBlocks, ceil(n / kSumChunk))
  bool count_squares;
  bool vector;  // x 16-byte aligned
};

// The row of `table` (count rows) whose blocks include `block`: a binary search, the same
// for every thread of the block.
template <class Row>
__device__ __forceinline__ const Row& row_of_block(const Row* table, int count, int64_t block) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_block <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return table[lo];
}

// Each block updates one kAdamChunk-element chunk of one buffer: with 128-bit accesses where
// the buffer allows (Grad/Copy: the storage types of the launch's vector buffers), else element
// by element through the run-time dtype.
template <class Grad, class Copy>
__global__ void adamw_multi_kernel(const AdamWBuffer* table, int count, AdamWConstants k) {
  const AdamWBuffer& b = row_of_block(table, count, blockIdx.x);
  const int64_t begin = (blockIdx.x - b.first_block) * kAdamChunk;
  const int64_t end = begin + kAdamChunk < b.n ? begin + kAdamChunk : b.n;
  int64_t scalar_from = begin;
  if (b.vector) {
    const auto* grad = static_cast<const Grad*>(b.grad.data);
    auto* copy = static_cast<Copy*>(b.param_copy.data);
    const int64_t vectors = (end - begin) / kVectorElements;
    for (int64_t vec = threadIdx.x; vec < vectors; vec += blockDim.x) {
      const int64_t i = begin + vec * kVectorElements;
      float p[kVectorElements], g[kVectorElements], m8[kVectorElements], v8[kVectorElements];
      load_vector(b.param + i, p);  // all four loads in flight before the math
      load_vector(grad + i, g);
      load_vector(b.m + i, m8);
      load_vector(b.v + i, v8);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        p[j] = adamw_update(k, b.decay, p[j], g[j], m8[j], v8[j]);
      }
      store_vector(b.param + i, p);
      store_vector(b.m + i, m8);
      store_vector(b.v + i, v8);
      if (copy) store_vector(copy + i, p);
    }
    scalar_from = begin + vectors * kVectorElements;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    const float p = adamw_update(k, b.decay, b.param[i], load(b.grad, i), b.m[i], b.v[i]);
    b.param[i] = p;
    if (b.param_copy.data) store(b.param_copy, i, p);
  }
}

// x's elements for the statistics: squares summed in double (when counted), any non-finite
// value remembered.
struct StatsAccumulator {
  double squares = 0.0;
  bool bad = false;
  __device__ __forceinline__ void add(float value, bool count_squares) {
    bad |= !isfinite(value);
    if (count_squares) squares += static_cast<double>(value) * value;
  }
};

// partials[block] = this block's sum of squares of its buffer (0 when not counted); *found = 1
// when it met an inf or NaN. Block b of a buffer with B blocks takes, per thread, the
// elements (or 8-element vectors) b * blockDim + t, + B * blockDim, ...; a vector buffer's
// tail (n % 8 elements) the same way by element.
__global__ void gradient_partials_kernel(const StatsBuffer* table, int count, double* partials,
                                         unsigned* found) {
  __shared__ double shared[32];
  const StatsBuffer& b = row_of_block(table, count, blockIdx.x);
  const int64_t first = (blockIdx.x - b.first_block) * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = b.blocks * blockDim.x;
  StatsAccumulator acc;
  int64_t tail_from = 0;
  if (b.vector) {
    const int64_t vectors = b.n / kVectorElements;
    for (int64_t vec = first; vec < vectors; vec += stride) {
      float values[kVectorElements];
      load_vector(b.x, vec * kVectorElements, values);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) acc.add(values[j], b.count_squares);
    }
    tail_from = vectors * kVectorElements;
  }
  for (int64_t i = tail_from + first; i < b.n; i += stride) acc.add(load(b.x, i), b.count_squares);
  const double sum = block_sum(acc.squares, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
  if (__any_sync(0xffffffffu, acc.bad) && threadIdx.x % 32 == 0) *found = 1u;  // no race: 1
}

// sums[buffer] = its partials added in a fixed order: one block of kSumThreads per buffer.
__global__ void buffer_sums_kernel(const StatsBuffer* table, const double* partials, double* sums) {
  __shared__ double shared[32];
  const StatsBuffer& b = table[blockIdx.x];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < b.blocks; i += blockDim.x) sum += partials[b.first_block + i];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

// A host table copied into stream-ordered scratch (the copy reads the host rows before it
// returns: pageable memory).
template <class Row>
const Row* upload_table(const std::vector<Row>& rows, const Scratch& scratch, cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(scratch.as<Row>(), rows.data(), rows.size() * sizeof(Row),
                             cudaMemcpyHostToDevice, stream));
  return scratch.as<Row>();
}

AdamWConstants adamw_constants(const AdamWStep& step) {
  // Scalars exactly as the CPU twin computes them (double, then float where the op uses them).
  const double lr = step.lr, beta1 = step.beta1, beta2 = step.beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step.step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step.step));
  AdamWConstants k;
  k.decay = 1.0f;  // per buffer: AdamWBuffer::decay
  k.lerp_weight = static_cast<float>(1.0 - beta1);
  k.lerp_weight_small = std::abs(k.lerp_weight) < 0.5f;
  k.beta2 = step.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  k.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  k.eps = step.eps;
  k.grad_scale = step.grad_scale;
  return k;
}

void check_adamw_buffer(const CudaContext& ctx, const AdamWTensors& b) {
  check_tensor_dtype(ctx, b.param, DType::F32, "adamw param");
  check_tensor_dtype(ctx, b.m, DType::F32, "adamw m");
  check_tensor_dtype(ctx, b.v, DType::F32, "adamw v");
  check_float_tensor(ctx, b.grad, "adamw grad");
  const int64_t n = b.param.numel();
  DSTRAIN_CHECK(b.grad.numel() == n && b.m.numel() == n && b.v.numel() == n)
      << "adamw param " << b.param.shape_str() << ", grad " << b.grad.shape_str() << ", m "
      << b.m.shape_str() << ", v " << b.v.shape_str() << " must have the same number of elements";
  if (!b.param_copy.empty()) {
    check_float_tensor(ctx, b.param_copy, "adamw param_copy");
    DSTRAIN_CHECK(b.param_copy.numel() == n)
        << "adamw param_copy " << b.param_copy.shape_str() << " must have " << n << " elements";
  }
}

// The launch's vector types: those of the first buffer with a gradient (and the first with a
// copy); a buffer of other dtypes or with a misaligned pointer takes the scalar path.
struct VectorTypes {
  DType grad = DType::F32, copy = DType::F32;
};
VectorTypes vector_types(std::span<const AdamWTensors> buffers) {
  VectorTypes types;
  bool grad_set = false, copy_set = false;
  for (const AdamWTensors& b : buffers) {
    if (!grad_set && b.param.numel() > 0) types.grad = b.grad.dtype, grad_set = true;
    if (!copy_set && !b.param_copy.empty()) types.copy = b.param_copy.dtype, copy_set = true;
  }
  return types;
}

AdamWBuffer adamw_row(const AdamWTensors& b, const AdamWStep& step, const VectorTypes& types,
                      int64_t first_block) {
  AdamWBuffer row;
  row.param = b.param.f32();
  row.grad = device_tensor(b.grad);
  row.m = b.m.f32();
  row.v = b.v.f32();
  row.param_copy =
      b.param_copy.empty() ? DeviceTensor{nullptr, DType::F32} : device_tensor(b.param_copy);
  row.decay =
      static_cast<float>(1.0 - static_cast<double>(step.lr) * static_cast<double>(b.weight_decay));
  row.n = b.param.numel();
  row.first_block = first_block;
  row.vector = vector_aligned(b.param.data) && vector_aligned(b.grad.data) &&
               vector_aligned(b.m.data) && vector_aligned(b.v.data) &&
               vector_aligned(b.param_copy.data) && b.grad.dtype == types.grad &&
               (b.param_copy.empty() || b.param_copy.dtype == types.copy);
  return row;
}

}  // namespace

void adamw_multi(const CudaContext& ctx, std::span<const AdamWTensors> buffers,
                 const AdamWStep& step, cudaStream_t stream) {
  DSTRAIN_CHECK(step.step >= 1) << "adamw step " << step.step << " must be >= 1 (1-based)";
  const VectorTypes types = vector_types(buffers);
  std::vector<AdamWBuffer> rows;
  int64_t blocks = 0;
  for (const AdamWTensors& b : buffers) {
    check_adamw_buffer(ctx, b);
    if (b.param.numel() == 0) continue;
    rows.push_back(adamw_row(b, step, types, blocks));
    blocks += (b.param.numel() + kAdamChunk - 1) / kAdamChunk;
  }
  if (rows.empty()) return;
  DSTRAIN_CHECK(blocks <= int64_t{0x7fffffff}) << "adamw over " << blocks << " chunks";
  Scratch scratch(ctx, rows.size() * sizeof(AdamWBuffer), stream);
  const AdamWBuffer* table = upload_table(rows, scratch, stream);
  const AdamWConstants k = adamw_constants(step);
  const int count = static_cast<int>(rows.size());
  with_storage_type(types.grad, [&](auto grad_tag) {
    with_storage_type(types.copy, [&](auto copy_tag) {
      using Grad = decltype(grad_tag);
      using Copy = decltype(copy_tag);
      DSTRAIN_LAUNCH((adamw_multi_kernel<Grad, Copy>), static_cast<unsigned>(blocks), kThreads, 0,
                     stream)
      (table, count, k);
    });
  });
  CUDA_CHECK_LAUNCH();
}

void adamw(const CudaContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
           const AdamWStep& step, cudaStream_t stream) {
  const AdamWTensors buffer{param, grad, m, v, param_copy, step.weight_decay};
  adamw_multi(ctx, {&buffer, 1}, step, stream);
}

GradientReadback gradient_stats(const CudaContext& ctx, std::span<const GradientTensor> buffers,
                                cudaStream_t stream) {
  std::vector<StatsBuffer> rows;
  std::vector<size_t> row_of;  // buffers[i]'s row, or SIZE_MAX for an empty one
  int64_t blocks = 0;
  for (const GradientTensor& b : buffers) {
    if (b.x.numel() == 0) {
      row_of.push_back(SIZE_MAX);
      continue;
    }
    check_float_tensor(ctx, b.x, "gradient check buffer");
    const int64_t n = b.x.numel();
    const int64_t buffer_blocks = std::min(kMaxSumBlocks, (n + kSumChunk - 1) / kSumChunk);
    row_of.push_back(rows.size());
    rows.push_back(
        {device_tensor(b.x), n, blocks, buffer_blocks, b.count_squares, vector_aligned(b.x.data)});
    blocks += buffer_blocks;
  }
  // Device results, then read back in one copy: sums (rows) | found | the error word.
  const size_t result_bytes = rows.size() * sizeof(double) + 2 * sizeof(unsigned);
  auto* readback = static_cast<char*>(pinned_readback(result_bytes));
  if (!rows.empty()) {
    const size_t table_bytes = align_up(rows.size() * sizeof(StatsBuffer));
    const size_t partial_bytes = align_up(static_cast<size_t>(blocks) * sizeof(double));
    Scratch scratch(ctx, table_bytes + partial_bytes + result_bytes, stream);
    const StatsBuffer* table = upload_table(rows, scratch, stream);
    auto* partials = reinterpret_cast<double*>(scratch.as<char>() + table_bytes);
    char* results = scratch.as<char>() + table_bytes + partial_bytes;
    auto* sums = reinterpret_cast<double*>(results);
    auto* found = reinterpret_cast<unsigned*>(results + rows.size() * sizeof(double));
    CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(unsigned), stream));
    const int count = static_cast<int>(rows.size());
    DSTRAIN_LAUNCH(gradient_partials_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)
    (table, count, partials, found);
    CUDA_CHECK_LAUNCH();
    DSTRAIN_LAUNCH(buffer_sums_kernel, static_cast<unsigned>(count), kSumThreads, 0, stream)
    (table, partials, sums);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaMemcpyAsync(found + 1, ctx.error_word, sizeof(unsigned),
                               cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(readback, results, result_bytes, cudaMemcpyDeviceToHost, stream));
  } else {  // only the error word (flags[1]; flags[0] is not read)
    CUDA_CHECK(cudaMemcpyAsync(readback + sizeof(unsigned), ctx.error_word, sizeof(unsigned),
                               cudaMemcpyDeviceToHost, stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the one wait

  GradientReadback out;
  out.stats.squares.assign(buffers.size(), 0.0);
  const auto* sums = reinterpret_cast<const double*>(readback);
  const auto* flags = reinterpret_cast<const unsigned*>(readback + rows.size() * sizeof(double));
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (row_of[i] != SIZE_MAX && buffers[i].count_squares) out.stats.squares[i] = sums[row_of[i]];
  }
  out.stats.found_inf = !rows.empty() && flags[0] != 0;
  out.device_error = flags[1];
  return out;
}

}  // namespace dstrain::cuda
