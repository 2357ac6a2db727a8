// 128-bit global access for the memory-bound kernels: a thread moves kVectorElements (8)
// elements per step, widened to fp32 in registers. 8 bf16/f16 are one 16-byte access (one
// LDG.E.128 / STG.E.128), 8 fp32 are two. The storage type is a template parameter, so the
// kernels that use these have no dtype switch per element; the dtype-switching load()/store()
// of cuda_common.cuh stay for the scalar fallbacks (mixed dtypes, misaligned pointers).
//
// A kernel built on these takes a pointer of storage type T (float, __half, __nv_bfloat16);
// its host side checks vector_aligned() for every pointer and falls back to the scalar kernel
// where any is not 16-byte aligned. Counts that are not a multiple of kVectorElements end in a
// scalar tail over the same typed pointers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ptx.cuh"

namespace dstrain::cuda {

// Elements per thread per vector step: one 128-bit access of bf16/f16, two of fp32.
constexpr int kVectorElements = 8;
constexpr uintptr_t kVectorAlignment = 16;

// 16 bytes of storage type T: what one 128-bit access moves.
template <class T>
struct alignas(16) Pack16 {
  static constexpr int kCount = 16 / static_cast<int>(sizeof(T));
  T values[kCount];
};

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

// value rounded to T (RNE, as store() and core/dtype.h's store_as).
template <class T>
__device__ __forceinline__ T from_float(float value) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(value);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(value);
  } else {
    static_assert(std::is_same_v<T, float>, "storage type: float, __half or __nv_bfloat16");
    return value;
  }
}

// values (8) = address[0..8) as fp32. REQUIRES: address 16-byte aligned, global.
template <class T>
__device__ __forceinline__ void load_vector(const T* address, float (&values)[kVectorElements]) {
  constexpr int kPer = Pack16<T>::kCount;
  const auto* packs = reinterpret_cast<const Pack16<T>*>(address);
#pragma unroll
  for (int a = 0; a < kVectorElements / kPer; ++a) {
    const Pack16<T> pack = load_128(packs + a);
#pragma unroll
    for (int j = 0; j < kPer; ++j) values[a * kPer + j] = to_float(pack.values[j]);
  }
}

// address[0..8) = values rounded to T. REQUIRES: address 16-byte aligned, global.
template <class T>
__device__ __forceinline__ void store_vector(T* address, const float (&values)[kVectorElements]) {
  constexpr int kPer = Pack16<T>::kCount;
  auto* packs = reinterpret_cast<Pack16<T>*>(address);
#pragma unroll
  for (int a = 0; a < kVectorElements / kPer; ++a) {
    Pack16<T> pack;
#pragma unroll
    for (int j = 0; j < kPer; ++j) pack.values[j] = from_float<T>(values[a * kPer + j]);
    store_128(packs + a, pack);
  }
}

// The same for a tensor whose dtype is known only at run time (a layernorm weight, a bias: small
// vectors that may be stored in another dtype than the activations). One uniform branch per 8
// elements. REQUIRES: t.data + i elements 16-byte aligned (i a multiple of 8, t.data aligned).
__device__ __forceinline__ void load_vector(const DeviceTensor& t, int64_t i,
                                            float (&values)[kVectorElements]) {
  switch (t.dtype) {
    case DType::F16:
      load_vector(static_cast<const __half*>(t.data) + i, values);
      break;
    case DType::BF16:
      load_vector(static_cast<const __nv_bfloat16*>(t.data) + i, values);
      break;
    default:
      load_vector(static_cast<const float*>(t.data) + i, values);
  }
}

// True when a 128-bit access may start at `pointer` (null counts as aligned: an absent
// optional tensor).
inline bool vector_aligned(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % kVectorAlignment == 0;
}

// Calls f(T{}) with T the storage type of `dtype` (a float dtype): the host side's one switch
// from a run-time dtype to a kernel's template parameter.
template <class F>
void with_storage_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F16:
      f(__half{});
      break;
    case DType::BF16:
      f(__nv_bfloat16{});
      break;
    default:
      f(float{});
  }
}

}  // namespace dstrain::cuda
