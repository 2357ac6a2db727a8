// CUDA SwiGLU (Llama's MLP activation): out = silu(gate) * up over rows [gate (I) | up (I)].
// Elementwise, one grid-stride thread per output element. The arithmetic is written exactly as
// in the CPU twin (kernels/cpu/cpu_llama_ops.cpp) so the two differ only where nvcc's expf and
// FMA contraction differ from the host's (on the emulator they agree bitwise).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// exp overflows to inf for g < -88 and the quotient is then -0, the right limit: no clamp.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// out (N,I) = silu(gate) * up, inp (N,2I) = [gate | up] per row.
__global__ void swiglu_forward_kernel(DeviceTensor out, DeviceTensor inp, int64_t N, int64_t I) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < N * I; e += stride) {
    const int64_t gate_index = e / I * 2 * I + e % I;
    store(out, e, silu(load(inp, gate_index)) * load(inp, gate_index + I));
  }
}

// dinp (N,2I) = [dgate | dup]: dgate = dout * up * silu'(gate), dup = dout * silu(gate);
// dout (N,I), inp (N,2I).
__global__ void swiglu_backward_kernel(DeviceTensor dinp, DeviceTensor dout, DeviceTensor inp,
                                       int64_t N, int64_t I) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < N * I; e += stride) {
    const int64_t gate_index = e / I * 2 * I + e % I;
    const float gate = load(inp, gate_index), up = load(inp, gate_index + I);
    const float dy = load(dout, e);
    const float sigmoid = 1.0f / (1.0f + expf(-gate));
    // silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    const float dsilu = sigmoid * (1.0f + gate * (1.0f - sigmoid));
    store(dinp, gate_index, dy * up * dsilu);
    store(dinp, gate_index + I, dy * silu(gate));
  }
}

}  // namespace

void swiglu_forward(const CudaContext& ctx, Tensor out, Tensor inp, cudaStream_t stream) {
  check_float_tensor(ctx, out, "swiglu out");
  check_float_tensor(ctx, inp, "swiglu inp");
  const RowShape s = check_swiglu_shapes(out, inp);
  if (s.rows == 0) return;
  DSTRAIN_LAUNCH(swiglu_forward_kernel, grid_for(ctx, s.rows * s.cols, kThreads), kThreads, 0,
                 stream)
  (device_tensor(out), device_tensor(inp), s.rows, s.cols);
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                     cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "swiglu dinp");
  check_float_tensor(ctx, dout, "swiglu dout");
  check_float_tensor(ctx, inp, "swiglu inp");
  const RowShape s = check_swiglu_backward_shapes(dinp, dout, inp);
  if (s.rows == 0) return;
  DSTRAIN_LAUNCH(swiglu_backward_kernel, grid_for(ctx, s.rows * s.cols, kThreads), kThreads, 0,
                 stream)
  (device_tensor(dinp), device_tensor(dout), device_tensor(inp), s.rows, s.cols);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
