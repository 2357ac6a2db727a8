// CUDA elementwise kernels: dtype conversion, GELU (tanh approximation), residual, accumulate,
// a bias added to every row, scale. Memory-bound: one grid-stride loop each. Each output element
// is read (if needed) before it is written by the same thread, so an output may alias an input.
//
// Two forms of each op, the same fp32 math per element (one functor below): where every tensor
// has one storage dtype T and every pointer is 16-byte aligned, a kernel templated on T moves 8
// elements per thread per step with 128-bit loads and stores (cuda_vector.cuh) and ends in a
// scalar tail; otherwise (mixed dtypes, a misaligned view) the scalar kernel with the run-time
// dtype switch of load()/store().
#include "kernels/cuda/cuda_gelu.cuh"
#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// ---- the per-element math, shared by both forms ----

struct Identity {
  __device__ float operator()(float x) const { return x; }
};

// __fadd_rn / __fmul_rn: one rounding, bitwise as the CPU.
struct Add {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

struct Scale {
  float s;
  __device__ float operator()(float x) const { return __fmul_rn(x, s); }
};

// ---- scalar kernels: any dtype per tensor, any alignment ----

template <class Op>
__global__ void unary_kernel(DeviceTensor out, DeviceTensor in, Op op, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(out, i, op(load(in, i)));
  }
}

template <class Op>
__global__ void binary_kernel(DeviceTensor out, DeviceTensor a, DeviceTensor b, Op op, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(out, i, op(load(a, i), load(b, i)));
  }
}

// x (rows, cols) += bias (cols) on every row.
__global__ void add_bias_kernel(DeviceTensor x, DeviceTensor bias, int64_t cols, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(x, i, __fadd_rn(load(x, i), load(bias, i % cols)));
  }
}

// ---- vector kernels: 8 elements per thread per step, then the scalar tail ----

// out (n) = op(in (n)). REQUIRES: out, in 16-byte aligned.
template <class Out, class In, class Op>
__global__ void unary_vector_kernel(Out* out, const In* in, Op op, int64_t n) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t vectors = n / kVectorElements;
  for (int64_t v = first; v < vectors; v += stride) {
    float x[kVectorElements];
    load_vector(in + v * kVectorElements, x);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) x[j] = op(x[j]);
    store_vector(out + v * kVectorElements, x);
  }
  for (int64_t i = vectors * kVectorElements + first; i < n; i += stride) {
    out[i] = from_float<Out>(op(to_float(in[i])));
  }
}

// out (n) = op(a (n), b (n)). REQUIRES: out, a, b 16-byte aligned.
template <class T, class Op>
__global__ void binary_vector_kernel(T* out, const T* a, const T* b, Op op, int64_t n) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t vectors = n / kVectorElements;
  for (int64_t v = first; v < vectors; v += stride) {
    float x[kVectorElements], y[kVectorElements];
    load_vector(a + v * kVectorElements, x);  // both loads in flight before the math
    load_vector(b + v * kVectorElements, y);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) x[j] = op(x[j], y[j]);
    store_vector(out + v * kVectorElements, x);
  }
  for (int64_t i = vectors * kVectorElements + first; i < n; i += stride) {
    out[i] = from_float<T>(op(to_float(a[i]), to_float(b[i])));
  }
}

// x (rows, cols) += bias (cols). REQUIRES: cols % 8 == 0 (a vector never straddles two rows, so
// n % 8 == 0 and there is no tail); x and bias 16-byte aligned. bias in any float dtype.
template <class T>
__global__ void add_bias_vector_kernel(T* x, DeviceTensor bias, int64_t cols, int64_t n) {
  const int64_t vectors = n / kVectorElements;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors;
       v += int64_t{gridDim.x} * blockDim.x) {
    float values[kVectorElements], b[kVectorElements];
    load_vector(x + v * kVectorElements, values);
    load_vector(bias, (v * kVectorElements) % cols, b);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) values[j] = __fadd_rn(values[j], b[j]);
    store_vector(x + v * kVectorElements, values);
  }
}

// ---- launches: the vector kernel where it applies, else the scalar one ----

unsigned vector_grid(const CudaContext& ctx, int64_t n) {
  return grid_for(ctx, (n + kVectorElements - 1) / kVectorElements, kThreads);
}

bool same_dtype_aligned(std::initializer_list<Tensor> tensors) {
  for (const Tensor& t : tensors) {
    if (t.dtype != tensors.begin()->dtype || !vector_aligned(t.data)) return false;
  }
  return true;
}

// out = op(in), elementwise; the vector form for any pair of dtypes (kAnyDTypes: a conversion)
// or only where both are the same.
template <bool kAnyDTypes, class Op>
void launch_unary(const CudaContext& ctx, Tensor out, Tensor in, Op op, cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const bool aligned = vector_aligned(out.data) && vector_aligned(in.data);
  if (aligned && (kAnyDTypes || out.dtype == in.dtype)) {
    with_storage_type(out.dtype, [&](auto out_tag) {
      using Out = decltype(out_tag);
      auto launch = [&](auto in_tag) {
        using In = decltype(in_tag);
        DSTRAIN_LAUNCH((unary_vector_kernel<Out, In, Op>), vector_grid(ctx, n), kThreads, 0, stream)
        (static_cast<Out*>(out.data), static_cast<const In*>(in.data), op, n);
      };
      if constexpr (kAnyDTypes) {
        with_storage_type(in.dtype, launch);
      } else {
        launch(out_tag);
      }
    });
  } else {
    DSTRAIN_LAUNCH(unary_kernel<Op>, grid_for(ctx, n, kThreads), kThreads, 0, stream)
    (device_tensor(out), device_tensor(in), op, n);
  }
  CUDA_CHECK_LAUNCH();
}

// out = op(a, b), elementwise.
template <class Op>
void launch_binary(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, Op op,
                   cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  if (same_dtype_aligned({out, a, b})) {
    with_storage_type(out.dtype, [&](auto tag) {
      using T = decltype(tag);
      DSTRAIN_LAUNCH((binary_vector_kernel<T, Op>), vector_grid(ctx, n), kThreads, 0, stream)
      (static_cast<T*>(out.data), static_cast<const T*>(a.data), static_cast<const T*>(b.data), op,
       n);
    });
  } else {
    DSTRAIN_LAUNCH(binary_kernel<Op>, grid_for(ctx, n, kThreads), kThreads, 0, stream)
    (device_tensor(out), device_tensor(a), device_tensor(b), op, n);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void copy_convert(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream) {
  check_float_tensor(ctx, dst, "copy dst");
  check_float_tensor(ctx, src, "copy src");
  launch_unary<true>(ctx, dst, src, Identity{}, stream);
}

void gelu_forward(const CudaContext& ctx, Tensor out, Tensor inp, cudaStream_t stream) {
  check_float_tensor(ctx, out, "gelu out");
  check_float_tensor(ctx, inp, "gelu inp");
  check_same_numel(out, "gelu out", inp, "inp");
  launch_unary<false>(ctx, out, inp, GeluForward{}, stream);
}

void gelu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                   cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "gelu dinp");
  check_float_tensor(ctx, dout, "gelu dout");
  check_float_tensor(ctx, inp, "gelu inp");
  check_same_numel(dinp, "gelu dinp", inp, "inp");
  check_same_numel(dout, "gelu dout", inp, "inp");
  launch_binary(ctx, dinp, dout, inp, GeluBackward{}, stream);
}

void residual_forward(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, cudaStream_t stream) {
  check_float_tensor(ctx, out, "residual out");
  check_float_tensor(ctx, a, "residual a");
  check_float_tensor(ctx, b, "residual b");
  check_same_numel(out, "residual out", a, "a");
  check_same_numel(out, "residual out", b, "b");
  launch_binary(ctx, out, a, b, Add{}, stream);
}

void accumulate(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream) {
  check_float_tensor(ctx, dst, "accumulate dst");
  check_float_tensor(ctx, src, "accumulate src");
  check_same_numel(dst, "accumulate dst", src, "src");
  launch_binary(ctx, dst, dst, src, Add{}, stream);
}

void add_bias(const CudaContext& ctx, Tensor x, Tensor bias, cudaStream_t stream) {
  check_float_tensor(ctx, x, "add_bias x");
  check_float_tensor(ctx, bias, "add_bias bias");
  const int64_t cols = cols_of(x), n = x.numel();
  DSTRAIN_CHECK(bias.numel() == cols) << "bias " << bias.shape_str() << " must have the " << cols
                                      << " columns of x " << x.shape_str();
  if (n == 0) return;
  if (cols % kVectorElements == 0 && vector_aligned(x.data) && vector_aligned(bias.data)) {
    with_storage_type(x.dtype, [&](auto tag) {
      using T = decltype(tag);
      DSTRAIN_LAUNCH(add_bias_vector_kernel<T>, vector_grid(ctx, n), kThreads, 0, stream)
      (static_cast<T*>(x.data), device_tensor(bias), cols, n);
    });
  } else {
    DSTRAIN_LAUNCH(add_bias_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
    (device_tensor(x), device_tensor(bias), cols, n);
  }
  CUDA_CHECK_LAUNCH();
}

void scale(const CudaContext& ctx, Tensor x, float s, cudaStream_t stream) {
  if (x.numel() == 0) return;
  check_float_tensor(ctx, x, "scale x");
  launch_unary<false>(ctx, x, x, Scale{s}, stream);
}

}  // namespace dstrain::cuda
