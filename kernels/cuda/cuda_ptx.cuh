// Tensor-core and async-copy primitives: the only inline PTX of the CUDA backend, one small
// device function per instruction. Under nvcc each wraps its PTX instruction; in the CUDA
// emulator's build (kernels/cuda_emu/emu_device.h included first: DSTRAIN_CUDA_EMULATION) each
// calls the emulator's implementation of the same instruction (kernels/cuda_emu/emu_ptx.h),
// which follows the PTX ISA's fragment layouts and completion rules, so the emulator tests check
// a kernel's use of them.
//
// REQUIRES: sm_80 or later (mma.m16n8k16 with bf16, cp.async).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#if defined(DSTRAIN_CUDA_EMULATION)
#include "kernels/cuda_emu/emu_ptx.h"
#elif !defined(__CUDACC__)
#error "cuda_ptx.cuh is device code: compile it with nvcc, or include emu_device.h first"
#endif

namespace dstrain::cuda {

#if !defined(DSTRAIN_CUDA_EMULATION)
// The 32-bit .shared address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}
#endif

// ---- tensor cores: D (16, 8) = A (16, 16) * B (16, 8) + C (16, 8), fp32 accumulate ----
// Fragments per lane, as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point
// type" lays them out (groupID = lane >> 2, tig = lane % 4; two 16-bit elements per register,
// the lower-indexed one in the low half):
//   a[4]: a0..a7, A[groupID (+8 for a2,a3,a6,a7)][2 * tig + (i & 1) (+8 for a4..a7)]
//   b[2]: b0..b3, B[2 * tig + (i & 1) (+8 for b2,b3)][groupID]
//   c[4], d[4]:   C[groupID (+8 for c2,c3)][2 * tig + (i & 1)]
// Every lane of the warp must call it (.sync.aligned). `d` may be `c`.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::mma_m16n8k16(::dstrain::emu::MmaInput::kBf16, d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

// The same with f16 A and B.
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::mma_m16n8k16(::dstrain::emu::MmaInput::kF16, d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

// ---- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 ----
// kMatrices 8x8 matrices of 16-bit elements from shared memory into mma fragments. Lane l gives
// the address of row l % 8 of matrix l / 8 (only lanes < 8 * kMatrices are read); regs[m]
// receives matrix m's row l / 4, columns 2 * (l % 4) and + 1 (kTranspose: column l / 4, rows
// 2 * (l % 4) and + 1), the first in the low half. Every lane of the warp must call it.
// REQUIRES: each row address used is 16-byte aligned, in shared memory.
template <int kMatrices, bool kTranspose = false>
__device__ __forceinline__ void ldmatrix(uint32_t (&regs)[kMatrices], const void* row_address) {
  static_assert(kMatrices == 1 || kMatrices == 2 || kMatrices == 4, "ldmatrix .x1, .x2 or .x4");
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::ldmatrix(kMatrices, kTranspose, regs, row_address);
#else
  const uint32_t row = shared_address(row_address);
  if constexpr (kMatrices == 1 && !kTranspose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(regs[0])
                 : "r"(row)
                 : "memory");
  } else if constexpr (kMatrices == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(regs[0])
                 : "r"(row)
                 : "memory");
  } else if constexpr (kMatrices == 2 && !kTranspose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row)
                 : "memory");
  } else if constexpr (kMatrices == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row)
                 : "memory");
  } else if constexpr (!kTranspose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row)
                 : "memory");
  }
#endif
}

// ---- cp.async: global -> shared without staging in registers ----
// A copy is complete (its data readable by this thread) only after a cp_async_wait_group /
// cp_async_wait_all that covers its group; other threads see it after that and a barrier.
// REQUIRES: both addresses aligned to the copy size; shared_dst in shared memory.

// cp.async.cg (cache in L2 only: a tile is read once per block) of 16 bytes.
__device__ __forceinline__ void cp_async_cg_16(void* shared_dst, const void* global_src) {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async(shared_dst, global_src, 16, 16, "cp.async.cg.shared.global");
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared_dst)),
               "l"(__cvta_generic_to_global(global_src))
               : "memory");
#endif
}

// The same reading only src_bytes (0..16) and zero-filling the rest: a tile's ragged edge
// without a branch.
__device__ __forceinline__ void cp_async_cg_16_zfill(void* shared_dst, const void* global_src,
                                                     int src_bytes) {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async(shared_dst, global_src, 16, src_bytes, "cp.async.cg.shared.global");
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared_dst)),
               "l"(__cvta_generic_to_global(global_src)), "r"(src_bytes)
               : "memory");
#endif
}

// cp.async.ca (cache in L1 too) of kBytes = 4, 8 or 16.
template <int kBytes>
__device__ __forceinline__ void cp_async_ca(void* shared_dst, const void* global_src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async(shared_dst, global_src, kBytes, kBytes, "cp.async.ca.shared.global");
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(shared_dst)),
               "l"(__cvta_generic_to_global(global_src)), "n"(kBytes)
               : "memory");
#endif
}

// The copies issued since the last commit become one group.
__device__ __forceinline__ void cp_async_commit_group() {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async_commit_group();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's most recent groups are incomplete (a pipeline
// of kPending + 1 stages keeps kPending in flight).
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a count >= 0");
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async_wait_group(kPending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Waits for every copy this thread issued, committed or not.
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(DSTRAIN_CUDA_EMULATION)
  ::dstrain::emu::cp_async_wait_all();
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// ---- ex2.approx.ftz.f32: 2^x, one MUFU.EX2 ----
// exp2f without fast-math compiles to MUFU.EX2 plus a guard for results below 2^-126 (a compare
// and two multiplies); the .ftz form flushes those to +0 instead, and a subnormal x counts as 0
// (2^x = 1). -inf gives +0, +inf gives +inf, NaN gives NaN. The ISA documents an approximation
// (its bits are the hardware's); the emulator returns the host's exp2f with the same flushes.
__device__ __forceinline__ float exp2_approx_ftz(float x) {
#if defined(DSTRAIN_CUDA_EMULATION)
  return ::dstrain::emu::ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---- 128-bit global loads and stores (one LDG.128 / STG.128 per thread) ----
// T is any 16-byte type: uint4, float4, Bf16x8. REQUIRES: address 16-byte aligned, global.

// Eight bf16 values, one 128-bit access.
struct alignas(16) Bf16x8 {
  __nv_bfloat16 values[8];
};

#if defined(DSTRAIN_CUDA_EMULATION)
#define DSTRAIN_PTX_LOAD_128(name, instruction)                         \
  template <class T>                                                    \
  __device__ __forceinline__ T name(const T* address) {                 \
    static_assert(sizeof(T) == 16, "a 128-bit load of a 16-byte type"); \
    ::dstrain::emu::check_vector_address(address, instruction);         \
    T value;                                                            \
    std::memcpy(&value, address, 16);                                   \
    return value;                                                       \
  }
#define DSTRAIN_PTX_STORE_128(name, instruction)                         \
  template <class T>                                                     \
  __device__ __forceinline__ void name(T* address, const T& value) {     \
    static_assert(sizeof(T) == 16, "a 128-bit store of a 16-byte type"); \
    ::dstrain::emu::check_vector_address(address, instruction);          \
    std::memcpy(address, &value, 16);                                    \
  }
#else
#define DSTRAIN_PTX_LOAD_128(name, instruction)                           \
  template <class T>                                                      \
  __device__ __forceinline__ T name(const T* address) {                   \
    static_assert(sizeof(T) == 16, "a 128-bit load of a 16-byte type");   \
    uint4 bits;                                                           \
    asm volatile(instruction " {%0, %1, %2, %3}, [%4];\n"                 \
                 : "=r"(bits.x), "=r"(bits.y), "=r"(bits.z), "=r"(bits.w) \
                 : "l"(__cvta_generic_to_global(address))                 \
                 : "memory");                                             \
    T value;                                                              \
    memcpy(&value, &bits, 16);                                            \
    return value;                                                         \
  }
#define DSTRAIN_PTX_STORE_128(name, instruction)                                        \
  template <class T>                                                                    \
  __device__ __forceinline__ void name(T* address, const T& value) {                    \
    static_assert(sizeof(T) == 16, "a 128-bit store of a 16-byte type");                \
    uint4 bits;                                                                         \
    memcpy(&bits, &value, 16);                                                          \
    asm volatile(instruction                                                            \
                 " [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(address)), \
                 "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)                     \
                 : "memory");                                                           \
  }
#endif

// Default caching.
DSTRAIN_PTX_LOAD_128(load_128, "ld.global.v4.u32")
DSTRAIN_PTX_STORE_128(store_128, "st.global.v4.u32")
// .cs, streaming: data read or written once (an activation copied through), evicted first.
DSTRAIN_PTX_LOAD_128(load_128_cs, "ld.global.cs.v4.u32")
DSTRAIN_PTX_STORE_128(store_128_cs, "st.global.cs.v4.u32")
// .lu, last use: the line will not be read again (the last pass over a buffer).
DSTRAIN_PTX_LOAD_128(load_128_lu, "ld.global.lu.v4.u32")

#undef DSTRAIN_PTX_LOAD_128
#undef DSTRAIN_PTX_STORE_128

}  // namespace dstrain::cuda
