// Is /dev/shm large enough for NCCL? When GPUs cannot reach each other directly (RTX 4090s:
// no peer-to-peer), NCCL's shared-memory transport moves the data through buffers it creates
// in /dev/shm. Docker gives a container 64 MB there unless it is started with --ipc=host or
// --shm-size, too little for four or more GPUs: NCCL then fails during initialization with
// "failed to extend /dev/shm/nccl-..." (NCCL's troubleshooting guide, "Shared memory"). This
// checks the size before the first NCCL call and says what to do in one sentence.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dstrain {

// (bytes) The buffers of one shared-memory connection, one per NCCL protocol; NCCL's defaults
// on x86-64 (src/init.cc: DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE).
struct NcclProtocolBuffers {
  uint64_t ll = 524288;       // 8 lines x 512 threads x 8 steps x 16 B; NCCL_LL_BUFFSIZE
  uint64_t ll128 = 4915200;   // 120 elements x 640 threads x 8 steps x 8 B; NCCL_LL128_BUFFSIZE
  uint64_t simple = 4194304;  // 4 MiB; NCCL_BUFFSIZE
};

// The defaults, each replaced by its NCCL_*BUFFSIZE variable when that is a positive number.
NcclProtocolBuffers nccl_protocol_buffers_from_environment();

// The least /dev/shm NCCL's shared-memory transport takes for `gpus` ranks on one machine:
// per GPU and channel, the segment of the ring's receive connection. An estimate from below
// (see the .cpp): NCCL's trees and point-to-point connections take more.
// REQUIRES: gpus >= 0.
uint64_t nccl_shm_bytes_needed(int gpus, const NcclProtocolBuffers& buffers);

struct SharedMemorySpace {
  uint64_t free_bytes = 0;   // what an unprivileged process may still allocate (f_bavail)
  uint64_t total_bytes = 0;  // the file system's size
};

// statvfs(path); nullopt, with the reason in *error, when it fails (no such directory).
std::optional<SharedMemorySpace> shared_memory_space(const std::string& path, std::string* error);

// Throws UserError (one sentence naming --ipc=host and --shm-size, with the sizes) when
// space.free_bytes < needed. `path` and `gpus` are for the sentence.
void require_shared_memory(const std::string& path, const SharedMemorySpace& space,
                           uint64_t needed, int gpus);

// The start-of-run check of a run whose `gpus` GPUs NCCL joins: nothing for fewer than two GPUs,
// nor with NCCL_SHM_DISABLE=1 (NCCL then uses no shared memory) or DSTRAIN_SKIP_SHM_CHECK=1
// (the user knows better: a machine whose GPUs all reach each other peer-to-peer needs little).
// Throws UserError when `path` cannot be read or is too small.
void check_shared_memory_for_nccl(int gpus, const std::string& path = "/dev/shm");

}  // namespace dstrain
