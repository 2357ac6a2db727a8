// The CUDA backend: every op of kernels/ops.h on one GPU, with hand-written kernels
// (kernels/cuda/*.cu) and cuBLAS / cuBLASLt (bias epilogue) for the GEMMs. Include only in builds
// with DSTRAIN_WITH_CUDA; this header itself includes no CUDA header.
//
// How to use it
// - One backend per device and per thread (a rank thread): it owns a cuBLAS handle whose
//   stream is set per call, so two threads must not share one backend.
// - Each op first makes the backend's device current on the calling thread (and leaves it so).
// - `Stream` is a cudaStream_t (nullptr: the legacy default stream). Ops are asynchronous:
//   they enqueue work on the stream and return; sum_squares, has_inf_or_nan and synchronize
//   wait for the stream.
// - Every tensor argument must be device memory of this backend's GPU (Device{CUDA, device}),
//   e.g. a view of a Buffer from make_cuda_allocator(device). copy_bytes accepts host memory
//   on either side (pinned host memory from make_pinned_host_allocator() for async copies).
// - Op scratch comes from a stream-ordered memory pool owned by the backend (no sync, no race
//   between streams), not from an Allocator, so the Allocator's stats do not count it:
//   embedding_backward 16 B per position + CUB's sort space; layernorm_backward,
//   rmsnorm_backward, gelu_backward_bias and dbias ceil(N/128) * C * 4 B (x2 for layernorm);
//   attention_backward B*NH*T*4 B; a matmul whose operands differ in dtype, or whose output dtype
//   cuBLAS cannot write from them (e.g. F16 out of F32 operands, or a bias of another dtype than
//   the output), stages in fp32: up to 4 B * (N*C + C*OC + N*OC). Same-dtype GEMMs need none. The
//   pool keeps up to 256 MiB of freed scratch for reuse. Fixed: the cuBLAS workspace (32 MiB) and a
//   4-byte flag word.
// - Bad token or target ids are detected on the device (NaN where they were used, and a
//   flag): the next call that waits for the stream (synchronize, sum_squares, has_inf_or_nan)
//   throws UserError saying which kind of id was out of range.
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/ops.h"

namespace dstrain {

// REQUIRES: 0 <= device < cudaGetDeviceCount(); throws dstrain::Error otherwise (also when the
// build has a CUDA toolkit but the machine has no GPU or no driver).
std::unique_ptr<Backend> make_cuda_backend(int device);

// Number of usable CUDA devices; 0 when there is no GPU or no driver (never throws).
int cuda_device_count();

// The norm kernels hold a row in one warp or, wider, in a block of 8 warps (up to 8192 elements;
// kernels/cuda/cuda_rows.cuh). By default the forward takes one warp up to C = 2048 and the
// backward up to 1024, the faster forms on an H200. This puts the bound of both at `C` (at most
// 2048, the one-warp form's limit), so that a benchmark can time both forms on one shape and a
// test can check both; a negative `C` restores the defaults. Process-wide: set it while no norm
// kernel is being launched.
void set_cuda_norm_block_rows_above(int64_t C);

// The tensor-core attention forward gives each warp 16 query rows (the default), or 32 at head
// dims 64 and 128 (`rows` = 32; any other value restores 16; hd 256 always has 16): each K and V
// fragment read from shared memory then feeds twice the mma, for twice the accumulator registers
// (kernels/cuda/cuda_attention_mma.cu). Same contract and bound either way, other bits; for a
// benchmark to time both and a test to check both. Process-wide, like the norms' bound.
void set_cuda_attention_warp_rows(int rows);

}  // namespace dstrain
