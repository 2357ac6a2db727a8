// GELU, tanh approximation, per element in fp32: the one definition of its math on the GPU,
// used by cuda_elementwise.cu (gelu_forward, gelu_backward) and cuda_gelu_bias.cu (the backward
// with the bias gradient fused in), which must give the same bits.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace dstrain::cuda {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

struct GeluForward {
  __device__ float operator()(float x) const {
    const float cube = kGeluCubic * x * x * x;
    return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
  }
};

// dinp = gelu'(x) * dout.
struct GeluBackward {
  __device__ float operator()(float dout, float x) const {
    const float cube = kGeluCubic * x * x * x;
    const float tanh_out = tanhf(kGeluScale * (x + cube));
    // sech^2 as 1 - tanh^2: no cosh overflow for large |x| (as the CPU twin).
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    return local_grad * dout;
  }
};

}  // namespace dstrain::cuda
