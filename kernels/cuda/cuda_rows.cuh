// Rows held in registers by one warp, for the layernorm and RMSNorm vector kernels: lane `lane`
// holds packs p = lane + 32 * k (k < kPacks, p < C / 8) of its row, elements 8p .. 8p + 7, as
// fp32. Each row element is read from memory once, with 128-bit loads, and written with 128-bit
// stores. The host side picks the packs per lane (register_packs) and instantiates the kernel
// for it (with_packs).
#pragma once

#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

// Up to kMaxPacks packs of 8 elements per lane: C <= 32 * 8 * kMaxPacks.
constexpr int kMaxPacks = 8;
constexpr int64_t kMaxRegisterC = int64_t{32} * kVectorElements * kMaxPacks;

// x = this lane's share of the row at a + base (packs = C / 8 packs). With
// kResidual the row is a + b rounded to T, exactly residual_forward's sum, and is also stored at
// sum + base (b and sum unused otherwise): the residual add fused into the norm that reads its
// result. The loads of `a` are all issued before the first use; b is read one pack at a time (8
// registers, not 8 per pack: the row already takes 8 per pack).
template <class T, int kPacks, bool kResidual>
__device__ __forceinline__ void load_row(float (&x)[kPacks][kVectorElements], const T* a,
                                         const T* b, T* sum, int64_t base, int64_t packs,
                                         int lane) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p < packs) load_vector(a + base + p * kVectorElements, x[k]);
  }
  if constexpr (kResidual) {
    b += base;
    sum += base;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      float y[kVectorElements];
      load_vector(b + p * kVectorElements, y);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        x[k][j] = to_float(from_float<T>(__fadd_rn(x[k][j], y[j])));  // the stored sum
      }
      store_vector(sum + p * kVectorElements, x[k]);
    }
  }
}

// Calls f(std::bool_constant<residual>{}): the plain norm kernels keep their registers.
template <class F>
void with_residual(bool residual, F&& f) {
  if (residual) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Packs per lane of the register-held form for rows of C elements in `rows` (one dtype, 16-byte
// aligned; empty tensors ignored) with `params` (aligned); 0 where that form does not apply.
// Kernels are instantiated for 2, 4 and 8 packs (C <= 512, 1024, 2048).
inline int register_packs(int64_t C, std::initializer_list<Tensor> rows,
                          std::initializer_list<Tensor> params) {
  if (C % kVectorElements != 0 || C > kMaxRegisterC) return 0;
  for (const Tensor& t : rows) {
    if (t.empty()) continue;
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

}  // namespace dstrain::cuda
