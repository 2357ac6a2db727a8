// CUDA SwiGLU (Llama's MLP activation): out = silu(gate) * up over rows [gate (I) | up (I)].
// Elementwise, one grid-stride thread per output element, or per 8 where I % 8 == 0 and every
// tensor has one storage dtype and is 16-byte aligned (128-bit loads and stores of gate, up and
// the gradients: cuda_vector.cuh). The arithmetic (one function per direction, shared by both
// forms) is written exactly as in the CPU twin (kernels/cpu/cpu_llama_ops.cpp) so the two differ
// only where nvcc's expf and FMA contraction differ from the host's (on the emulator they agree
// bitwise). Asked for it, each kernel also finds the amax of what it stores (cuda_amax.cuh), for
// the FP8 cast that reads its output next (--precision fp8).
#include <initializer_list>

#include "kernels/cuda/cuda_amax.cuh"
#include "kernels/cuda/cuda_vector.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// exp overflows to inf for g < -88 and the quotient is then -0, the right limit: no clamp.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float swiglu(float gate, float up) { return silu(gate) * up; }

// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
__device__ __forceinline__ void swiglu_grad(float dy, float gate, float up, float& dgate,
                                            float& dup) {
  const float sigmoid = 1.0f / (1.0f + expf(-gate));
  // silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
  const float dsilu = sigmoid * (1.0f + gate * (1.0f - sigmoid));
  dgate = dy * up * dsilu;
  dup = dy * silu(gate);
}

// The magnitude bits of `value` as storage type T holds it.
template <class T>
__device__ __forceinline__ unsigned stored_magnitude(float value) {
  return magnitude_bits(to_float(from_float<T>(value)));
}

// out (N,I) = silu(gate) * up, inp (N,2I) = [gate | up] per row; max |out| into *amax_bits
// unless null.
__global__ void swiglu_forward_kernel(DeviceTensor out, DeviceTensor inp, int64_t N, int64_t I,
                                      unsigned* amax_bits) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  unsigned local = 0;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < N * I; e += stride) {
    const int64_t gate_index = e / I * 2 * I + e % I;
    store(out, e, swiglu(load(inp, gate_index), load(inp, gate_index + I)));
    if (amax_bits != nullptr) local = max(local, magnitude_bits(load(out, e)));
  }
  if (amax_bits != nullptr) block_amax<kThreads>(local, amax_bits);
}

// The same, 8 outputs per thread per step: output pack v = (row, 8 columns). REQUIRES: I % 8 ==
// 0; out and inp of storage type T, 16-byte aligned.
// kAmax: max |out| into *amax_bits (a separate instance, so that without it the code is as before).
template <class T, bool kAmax>
__global__ void swiglu_forward_vector_kernel(T* out, const T* inp, int64_t N, int64_t I,
                                             unsigned* amax_bits) {
  const int64_t row_packs = I / kVectorElements, packs = N * row_packs;
  unsigned local = 0;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < packs;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = v / row_packs, c = v % row_packs * kVectorElements;
    float gate[kVectorElements], up[kVectorElements];
    load_vector(inp + n * 2 * I + c, gate);  // both loads in flight before the math
    load_vector(inp + n * 2 * I + I + c, up);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      gate[j] = swiglu(gate[j], up[j]);
      if constexpr (kAmax) local = max(local, stored_magnitude<T>(gate[j]));
    }
    store_vector(out + n * I + c, gate);
  }
  if constexpr (kAmax) block_amax<kThreads>(local, amax_bits);
}

// dinp (N,2I) = [dgate | dup]: dgate = dout * up * silu'(gate), dup = dout * silu(gate);
// dout (N,I), inp (N,2I).
__global__ void swiglu_backward_kernel(DeviceTensor dinp, DeviceTensor dout, DeviceTensor inp,
                                       int64_t N, int64_t I, unsigned* amax_bits) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  unsigned local = 0;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < N * I; e += stride) {
    const int64_t gate_index = e / I * 2 * I + e % I;
    float dgate, dup;
    swiglu_grad(load(dout, e), load(inp, gate_index), load(inp, gate_index + I), dgate, dup);
    store(dinp, gate_index, dgate);
    store(dinp, gate_index + I, dup);
    if (amax_bits != nullptr) {
      local = max(local, max(magnitude_bits(load(dinp, gate_index)),
                             magnitude_bits(load(dinp, gate_index + I))));
    }
  }
  if (amax_bits != nullptr) block_amax<kThreads>(local, amax_bits);
}

// The same, 8 outputs per thread per step. REQUIRES: I % 8 == 0; dinp, dout and inp of storage
// type T, 16-byte aligned.
template <class T, bool kAmax>
__global__ void swiglu_backward_vector_kernel(T* dinp, const T* dout, const T* inp, int64_t N,
                                              int64_t I, unsigned* amax_bits) {
  const int64_t row_packs = I / kVectorElements, packs = N * row_packs;
  unsigned local = 0;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < packs;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = v / row_packs, c = v % row_packs * kVectorElements;
    float dy[kVectorElements], gate[kVectorElements], up[kVectorElements];
    load_vector(dout + n * I + c, dy);
    load_vector(inp + n * 2 * I + c, gate);
    load_vector(inp + n * 2 * I + I + c, up);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      swiglu_grad(dy[j], gate[j], up[j], gate[j], up[j]);
      if constexpr (kAmax) {
        local = max(local, max(stored_magnitude<T>(gate[j]), stored_magnitude<T>(up[j])));
      }
    }
    store_vector(dinp + n * 2 * I + c, gate);
    store_vector(dinp + n * 2 * I + I + c, up);
  }
  if constexpr (kAmax) block_amax<kThreads>(local, amax_bits);
}

// True where the vector kernels apply: I % 8 == 0, one dtype, every pointer aligned.
bool vector_rows(int64_t I, std::initializer_list<Tensor> tensors) {
  if (I % kVectorElements != 0) return false;
  for (const Tensor& t : tensors) {
    if (t.dtype != tensors.begin()->dtype || !vector_aligned(t.data)) return false;
  }
  return true;
}

// The amax word of an op's optional amax output, cleared on the stream (null: none).
unsigned* cleared_amax(const CudaContext& ctx, Tensor amax, const char* op, cudaStream_t stream) {
  check_amax_output(amax, op);
  if (amax.empty()) return nullptr;
  check_tensor_dtype(ctx, amax, DType::F32, op);
  CUDA_CHECK(cudaMemsetAsync(amax.data, 0, sizeof(unsigned), stream));
  return static_cast<unsigned*>(amax.data);
}

}  // namespace

void swiglu_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor amax,
                    cudaStream_t stream) {
  check_float_tensor(ctx, out, "swiglu out");
  check_float_tensor(ctx, inp, "swiglu inp");
  const RowShape s = check_swiglu_shapes(out, inp);
  unsigned* amax_bits = cleared_amax(ctx, amax, "swiglu_forward amax", stream);
  if (s.rows == 0) return;
  if (vector_rows(s.cols, {out, inp})) {
    with_storage_type(out.dtype, [&](auto tag) {
      using T = decltype(tag);
      const unsigned grid = grid_for(ctx, s.rows * s.cols / kVectorElements, kThreads);
      auto* o = static_cast<T*>(out.data);
      const auto* in = static_cast<const T*>(inp.data);
      if (amax_bits != nullptr) {
        DSTRAIN_LAUNCH((swiglu_forward_vector_kernel<T, true>), grid, kThreads, 0, stream)
        (o, in, s.rows, s.cols, amax_bits);
      } else {
        DSTRAIN_LAUNCH((swiglu_forward_vector_kernel<T, false>), grid, kThreads, 0, stream)
        (o, in, s.rows, s.cols, amax_bits);
      }
    });
  } else {
    DSTRAIN_LAUNCH(swiglu_forward_kernel, grid_for(ctx, s.rows * s.cols, kThreads), kThreads, 0,
                   stream)
    (device_tensor(out), device_tensor(inp), s.rows, s.cols, amax_bits);
  }
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp, Tensor amax,
                     cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "swiglu dinp");
  check_float_tensor(ctx, dout, "swiglu dout");
  check_float_tensor(ctx, inp, "swiglu inp");
  const RowShape s = check_swiglu_backward_shapes(dinp, dout, inp);
  unsigned* amax_bits = cleared_amax(ctx, amax, "swiglu_backward amax", stream);
  if (s.rows == 0) return;
  if (vector_rows(s.cols, {dinp, dout, inp})) {
    with_storage_type(dinp.dtype, [&](auto tag) {
      using T = decltype(tag);
      const unsigned grid = grid_for(ctx, s.rows * s.cols / kVectorElements, kThreads);
      auto* d = static_cast<T*>(dinp.data);
      const auto* dy = static_cast<const T*>(dout.data);
      const auto* in = static_cast<const T*>(inp.data);
      if (amax_bits != nullptr) {
        DSTRAIN_LAUNCH((swiglu_backward_vector_kernel<T, true>), grid, kThreads, 0, stream)
        (d, dy, in, s.rows, s.cols, amax_bits);
      } else {
        DSTRAIN_LAUNCH((swiglu_backward_vector_kernel<T, false>), grid, kThreads, 0, stream)
        (d, dy, in, s.rows, s.cols, amax_bits);
      }
    });
  } else {
    DSTRAIN_LAUNCH(swiglu_backward_kernel, grid_for(ctx, s.rows * s.cols, kThreads), kThreads, 0,
                   stream)
    (device_tensor(dinp), device_tensor(dout), device_tensor(inp), s.rows, s.cols, amax_bits);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
