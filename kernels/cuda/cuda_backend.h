// The CUDA backend: every op of kernels/ops.h on one GPU, with hand-written kernels
// (kernels/cuda/*.cu) and cuBLAS for the GEMMs. Include only in builds with
// DSTRAIN_WITH_CUDA; this header itself includes no CUDA header.
//
// How to use it
// - One backend per device and per thread (a rank thread): it owns a cuBLAS handle whose
//   stream is set per call, so two threads must not share one backend.
// - `Stream` is a cudaStream_t (nullptr: the legacy default stream). Ops are asynchronous:
//   they enqueue work on the stream and return; sum_squares, has_inf_or_nan and synchronize
//   wait for the stream.
// - Every tensor argument must be device memory of this backend's GPU (Device{CUDA, device}),
//   e.g. a view of a Buffer from make_cuda_allocator(device). copy_bytes accepts host memory
//   on either side (pinned host memory from make_pinned_host_allocator() for async copies).
// - Op scratch (sort buffers of embedding_backward, partial sums, fp32 staging of mixed-dtype
//   GEMMs, the flag word) comes from a stream-ordered memory pool owned by the backend, not
//   from an Allocator: at most a few (N, OC) fp32 tiles at a time; the cuBLAS workspace is
//   32 MiB.
// - Bad token or target ids are detected on the device (the kernel skips them and raises a
//   flag): the next call that waits for the stream (synchronize, sum_squares, has_inf_or_nan)
//   throws UserError saying which kind of id was out of range.
#pragma once

#include <memory>

#include "kernels/ops.h"

namespace dstrain {

// REQUIRES: 0 <= device < cudaGetDeviceCount(); throws dstrain::Error otherwise (also when the
// build has a CUDA toolkit but the machine has no GPU or no driver).
std::unique_ptr<Backend> make_cuda_backend(int device);

// Number of usable CUDA devices; 0 when there is no GPU or no driver (never throws).
int cuda_device_count();

}  // namespace dstrain
