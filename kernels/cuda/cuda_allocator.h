// Allocators of CUDA memory, behind core/allocator.h's Allocator (categories, peaks, and the
// out-of-memory sentence naming the category that did not fit). This header includes no
// CUDA header: a layer that only holds Buffers needs none.
#pragma once

#include <memory>

#include "core/allocator.h"

namespace dstrain {

// Device memory of GPU `device` (cudaMalloc). Its Buffers are on Device{CUDA, device}.
// Allocation and release may run on any thread: the allocator selects `device` itself and
// restores the thread's current device afterwards. Throws dstrain::Error when `device` does not
// exist.
std::unique_ptr<Allocator> make_cuda_allocator(int device);

// Page-locked host memory (cudaHostAlloc, portable to every device): the staging and offload
// memory of asynchronous copies. Its Buffers are on Device{CPU, 0}.
std::unique_ptr<Allocator> make_pinned_host_allocator();

}  // namespace dstrain
