// The CUDA emulator's device prelude: included first by the host-C++ build of each kernels/cuda/
// .cu file (the dstrain_kernels_cuda_emu library; see emu_runtime.h for what it is for). It gives
// the kernel language its meaning on the host: __global__/__device__ functions are ordinary
// functions, __shared__ variables are per-block (one block runs at a time on a host thread),
// threadIdx & co. read the running fiber's indices, and the intrinsics the kernels use
// (__syncthreads, warp shuffles and votes, atomics, the _rn arithmetic) are defined with their
// CUDA semantics.
//
// Kernels are written once for both builds: a launch is DSTRAIN_LAUNCH(kernel, grid, block,
// shared_bytes, stream)(args...) and dynamic shared memory is DSTRAIN_DYNAMIC_SHARED(type, name)
// (cuda_common.cuh defines both as <<<...>>> and extern __shared__ for nvcc).
#pragma once

#define DSTRAIN_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda_emu/emu_runtime.h"

// One block runs at a time on a host thread, and all its GPU threads are fibers of that host
// thread: a thread_local is exactly the block's shared memory.
#undef __shared__
#define __shared__ static thread_local
#undef __forceinline__
#define __forceinline__ inline
// Launch bounds guide nvcc's register allocation: nothing to bound on the host.
#undef __launch_bounds__
#define __launch_bounds__(...)

#define threadIdx (::dstrain::emu::current().thread_idx)
#define blockIdx (::dstrain::emu::current().block_idx)
#define blockDim (::dstrain::emu::current().block_dim)
#define gridDim (::dstrain::emu::current().grid_dim)

#define DSTRAIN_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::dstrain::emu::Launch(kernel, #kernel, dim3(grid), dim3(block), shared_bytes, stream)
#define DSTRAIN_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(::dstrain::emu::dynamic_shared())

inline void __syncthreads() { ::dstrain::emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::dstrain::emu::sync_warp(mask); }

namespace dstrain::emu {

template <class T>
inline uint64_t to_bits(T value) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a large type");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <class T>
inline T from_bits(uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
template <class T>
inline T shuffle_as(unsigned mask, T value, ShuffleKind kind, int operand, int width) {
  return from_bits<T>(shuffle(mask, to_bits(value), kind, operand, width));
}

}  // namespace dstrain::emu

template <class T>
inline T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32) {
  return ::dstrain::emu::shuffle_as(mask, value, ::dstrain::emu::ShuffleKind::kIndex, source_lane,
                                    width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return ::dstrain::emu::shuffle_as(mask, value, ::dstrain::emu::ShuffleKind::kXor, lane_mask,
                                    width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::dstrain::emu::shuffle_as(mask, value, ::dstrain::emu::ShuffleKind::kDown,
                                    static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::dstrain::emu::shuffle_as(mask, value, ::dstrain::emu::ShuffleKind::kUp,
                                    static_cast<int>(delta), width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::dstrain::emu::ballot(mask, predicate != 0);
}
inline int __any_sync(unsigned mask, int predicate) {
  return ::dstrain::emu::ballot(mask, predicate != 0) != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  return ::dstrain::emu::ballot(mask, predicate != 0) == mask;
}

// Atomics: simulated ranks may share the emulated GPU from several host threads.
template <class T>
inline T atomicAdd(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
template <class T>
inline T atomicOr(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).fetch_or(value);
}
template <class T>
inline T atomicMax(T* address, std::type_identity_t<T> value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (old < value && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}
template <class T>
inline T atomicCAS(T* address, std::type_identity_t<T> compare,
                   std::type_identity_t<T> value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;
}

// IEEE single-precision operations with one rounding to nearest even: what the host does for
// float arithmetic (the emulator's build has no FMA contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
template <class T>
inline T __ldg(const T* address) {
  return *address;
}

// CUDA's device min/max: overloads for every arithmetic type, usual conversions.
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  using T = std::common_type_t<A, B>;
  return static_cast<T>(b) < static_cast<T>(a) ? static_cast<T>(b) : static_cast<T>(a);
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  using T = std::common_type_t<A, B>;
  return static_cast<T>(a) < static_cast<T>(b) ? static_cast<T>(b) : static_cast<T>(a);
}

// cuda_runtime.h's typed overload (nvcc only) of cudaFuncSetAttribute.
template <class... Params>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute,
                                        int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}
