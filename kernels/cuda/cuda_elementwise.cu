// CUDA elementwise kernels: dtype conversion, GELU (tanh approximation), residual, accumulate,
// a bias added to every row, scale. Memory-bound: one grid-stride loop each. Each output element is read (if needed)
// before it is written by the same thread, so an output may alias an input.
#include "kernels/cuda/cuda_common.cuh"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

__global__ void convert_kernel(DeviceTensor dst, DeviceTensor src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(dst, i, load(src, i));
  }
}

__global__ void gelu_forward_kernel(DeviceTensor out, DeviceTensor inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = load(inp, i);
    const float cube = kGeluCubic * x * x * x;
    store(out, i, 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube))));
  }
}

__global__ void gelu_backward_kernel(DeviceTensor dinp, DeviceTensor dout, DeviceTensor inp,
                                     int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = load(inp, i);
    const float cube = kGeluCubic * x * x * x;
    const float tanh_out = tanhf(kGeluScale * (x + cube));
    // sech^2 as 1 - tanh^2: no cosh overflow for large |x| (as the CPU twin).
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    store(dinp, i, local_grad * load(dout, i));
  }
}

// out = a + b; also accumulate (out = a = dst). __fadd_rn: one rounding, bitwise as the CPU.
__global__ void add_kernel(DeviceTensor out, DeviceTensor a, DeviceTensor b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(out, i, __fadd_rn(load(a, i), load(b, i)));
  }
}

// x (rows, cols) += bias (cols) on every row, one rounding: bitwise as the CPU.
__global__ void add_bias_kernel(DeviceTensor x, DeviceTensor bias, int64_t cols, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(x, i, __fadd_rn(load(x, i), load(bias, i % cols)));
  }
}

__global__ void scale_kernel(DeviceTensor x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(x, i, __fmul_rn(load(x, i), s));
  }
}

}  // namespace

void copy_convert(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream) {
  check_float_tensor(ctx, dst, "copy dst");
  check_float_tensor(ctx, src, "copy src");
  const int64_t n = dst.numel();
  DSTRAIN_LAUNCH(convert_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(dst), device_tensor(src), n);
  CUDA_CHECK_LAUNCH();
}

void gelu_forward(const CudaContext& ctx, Tensor out, Tensor inp, cudaStream_t stream) {
  check_float_tensor(ctx, out, "gelu out");
  check_float_tensor(ctx, inp, "gelu inp");
  check_same_numel(out, "gelu out", inp, "inp");
  const int64_t n = out.numel();
  DSTRAIN_LAUNCH(gelu_forward_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(out), device_tensor(inp), n);
  CUDA_CHECK_LAUNCH();
}

void gelu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                   cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "gelu dinp");
  check_float_tensor(ctx, dout, "gelu dout");
  check_float_tensor(ctx, inp, "gelu inp");
  check_same_numel(dinp, "gelu dinp", inp, "inp");
  check_same_numel(dout, "gelu dout", inp, "inp");
  const int64_t n = dinp.numel();
  DSTRAIN_LAUNCH(gelu_backward_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(dinp), device_tensor(dout), device_tensor(inp), n);
  CUDA_CHECK_LAUNCH();
}

void residual_forward(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, cudaStream_t stream) {
  check_float_tensor(ctx, out, "residual out");
  check_float_tensor(ctx, a, "residual a");
  check_float_tensor(ctx, b, "residual b");
  check_same_numel(out, "residual out", a, "a");
  check_same_numel(out, "residual out", b, "b");
  const int64_t n = out.numel();
  DSTRAIN_LAUNCH(add_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(out), device_tensor(a), device_tensor(b), n);
  CUDA_CHECK_LAUNCH();
}

void accumulate(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream) {
  check_float_tensor(ctx, dst, "accumulate dst");
  check_float_tensor(ctx, src, "accumulate src");
  check_same_numel(dst, "accumulate dst", src, "src");
  const int64_t n = dst.numel();
  DSTRAIN_LAUNCH(add_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(dst), device_tensor(dst), device_tensor(src), n);
  CUDA_CHECK_LAUNCH();
}

void add_bias(const CudaContext& ctx, Tensor x, Tensor bias, cudaStream_t stream) {
  check_float_tensor(ctx, x, "add_bias x");
  check_float_tensor(ctx, bias, "add_bias bias");
  const int64_t cols = cols_of(x), n = x.numel();
  DSTRAIN_CHECK(bias.numel() == cols)
      << "bias " << bias.shape_str() << " must have the " << cols << " columns of x "
      << x.shape_str();
  if (n == 0) return;
  DSTRAIN_LAUNCH(add_bias_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(x), device_tensor(bias), cols, n);
  CUDA_CHECK_LAUNCH();
}

void scale(const CudaContext& ctx, Tensor x, float s, cudaStream_t stream) {
  if (x.numel() == 0) return;
  check_float_tensor(ctx, x, "scale x");
  const int64_t n = x.numel();
  DSTRAIN_LAUNCH(scale_kernel, grid_for(ctx, n, kThreads), kThreads, 0, stream)
  (device_tensor(x), s, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
