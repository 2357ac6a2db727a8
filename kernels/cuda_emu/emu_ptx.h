// The emulator's side of kernels/cuda/cuda_ptx.cuh: the PTX instructions that cuda_ptx.cuh wraps
// in inline assembly for nvcc (tensor-core mma, ldmatrix, cp.async, 128-bit global accesses),
// implemented as the PTX ISA documents them, so a kernel's fragment layouts and its async-copy
// waits are checked without a GPU.
//
// Where the ISA leaves a choice, the emulator takes the one that exposes a bug:
// - cp.async copies land at the cp.async.wait_group / wait_all that covers them (or when the
//   thread exits), never earlier: shared memory read before the wait holds stale data.
// - mma and ldmatrix are .sync.aligned: every lane of a full warp must reach the same
//   instruction (same shape, type, .trans); an exited lane, a partial warp, or lanes waiting in a
//   different warp operation is an error, as for shuffles.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace dstrain::emu {

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 ----
enum class MmaInput { kBf16, kF16 };

// d = a * b + c for the warp's (16, 16) A, (16, 8) B and (16, 8) C/D, each lane passing its
// fragments: a: 4 registers of 2 packed 16-bit elements, b: 2 such registers, c, d: 4 floats.
// `d` may alias `c`. Every D element is c + sum over k = 0..15 of a[k] * b[k], accumulated in
// fp32 in that order (C first, then k ascending) with one rounding to nearest per addition;
// each product is exact in fp32. The hardware's internal order and rounding are unspecified,
// so tests compare against a float64 product with a tolerance that covers any order.
void mma_m16n8k16(MmaInput input, float d[4], const uint32_t a[4], const uint32_t b[2],
                  const float c[4]);

// ---- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 ----
// `matrices` (1, 2 or 4) 8x8 matrices of 16-bit elements; this lane's `row_address` is row
// (lane % 8) of matrix (lane / 8) and is read only for lanes < 8 * matrices. regs[m] receives
// two elements of matrix m: row lane / 4, columns 2 * (lane % 4) and + 1 (transposed: column
// lane / 4, rows 2 * (lane % 4) and + 1), the first in the low half.
// REQUIRES: every row address used is 16-byte aligned and in shared memory.
void ldmatrix(int matrices, bool transpose, uint32_t regs[], const void* row_address);

// ---- cp.async (per GPU thread) ----
// cp.async.{ca,cg}.shared.global [dst], [src], copy_bytes, src_bytes: copies src_bytes from
// global memory and zero-fills up to copy_bytes. `what` names the instruction in errors.
// REQUIRES: copy_bytes is 4, 8 or 16 (16 for .cg), 0 <= src_bytes <= copy_bytes, both
// addresses aligned to copy_bytes, dst in shared memory.
void cp_async(void* shared_dst, const void* global_src, int copy_bytes, int src_bytes,
              const char* what);
// cp.async.commit_group: the copies issued since the last commit become one group.
void cp_async_commit_group();
// cp.async.wait_group n: performs the oldest committed groups until at most n are pending.
void cp_async_wait_group(int n);
// cp.async.wait_all: commit_group then wait_group 0.
void cp_async_wait_all();

// ---- ex2.approx.ftz.f32 ----
// 2^x with subnormal inputs read as +-0 (2^x = 1) and subnormal results flushed to +0; -inf ->
// +0, +inf -> +inf, NaN -> NaN. The hardware's approximation is not documented to the bit: this
// is the host's exp2f.
float ex2_approx_ftz(float x);

// A thread's copies not yet performed (kept by the runtime with each GPU thread).
struct AsyncCopy {
  void* dst;
  const void* src;
  int copy_bytes, src_bytes;
};
struct AsyncCopies {
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> committed;  // oldest first
};
// At the thread's exit: its outstanding copies still land (they do on the GPU).
void finish_async_copies(AsyncCopies& copies);

// ---- 128-bit global accesses ----
// Checks that `address` is 16-byte aligned (a vector access faults otherwise).
void check_vector_address(const void* address, const char* what);

}  // namespace dstrain::emu
