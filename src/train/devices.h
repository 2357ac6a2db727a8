// The hardware of a training run, decided in one place: the backend and allocators each rank
// makes, and how the ranks are launched and connected.
//
//   cpu    every rank: the CPU backend with its share of the threads, host memory for both
//          its device and host allocators; ranks are threads joined by the local communicator.
//   cuda   rank r: GPU r % gpus, make_cuda_backend of it, its device memory
//          (make_cuda_allocator) and pinned host memory (make_pinned_host_allocator) for the
//          host side (offload state, staging, the token batch as the loader reads it). The ranks
//          are joined by NCCL when this build has it and every rank has a GPU of its own;
//          otherwise (several ranks sharing a GPU, or no NCCL) by the local communicator
//          through host copies (comm/staged_communicator.h).
//
// This header includes no CUDA header; in a build without the CUDA backend, `cuda` is refused
// with a sentence and usable_cuda_devices() is 0.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "kernels/ops.h"

namespace dstrain {

// True when this build has the CUDA backend.
bool cuda_backend_built();
// GPUs the CUDA backend can use here; 0 without the backend, a GPU or a driver. Never throws.
int usable_cuda_devices();

struct RunDevices {
  bool cuda = false;
  int ranks = 1;       // this process's ranks
  int first_rank = 0;  // the world rank of the first (several nodes: node_rank x ranks)
  int gpus = 0;       // cuda: the GPUs used; rank first_rank + i runs on GPU i % gpus
  bool nccl = false;  // cuda: NCCL joins the ranks, else the local communicator through copies
  // --gpu-memory: each rank's device allocator refuses past this many bytes (0: no limit).
  uint64_t memory_limit = 0;
  std::string memory_limit_flag;
  // "the CPU backend", "CUDA on 2 GPUs, NCCL", "CUDA on 1 GPU shared by 2 ranks, local
  // communicator through host copies".
  std::string describe() const;
};

// device: "cpu", "cuda", or "auto" (cuda when the CUDA backend is built and a GPU is usable).
// max_gpus > 0 uses at most that many GPUs (testing: ranks then share them).
// Throws UserError for "cuda" in a build without the CUDA backend or without a usable GPU, and
// when NCCL would join two or more GPUs but /dev/shm is too small for it
// (check_shared_memory_for_nccl in topology/shared_memory.h).
RunDevices choose_devices(const std::string& device, int ranks, int max_gpus = 0);

// What one rank works with. Members are destroyed in reverse order: the communicator wrapper
// (which copies through the backend) before the backend.
struct RankDevices {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Allocator> device;  // memory the backend's ops read and write
  std::unique_ptr<Allocator> host;    // host memory: offload state and staging
  Communicator* comm = nullptr;       // the rank's communicator: the launcher's or comm_wrapper
  std::unique_ptr<Communicator> comm_wrapper;
  OwnedStream compute;  // the stream the rank's model runs on (ShardedModel adds its own for
                        // communication); nullptr on the CPU backend
};

// Runs fn(communicator) on one thread per rank (devices.ranks of them), connected as `devices`
// says: run_local_ranks or run_nccl_ranks. timeout_seconds: as theirs.
void launch_ranks(const RunDevices& devices, double timeout_seconds,
                  const std::function<void(Communicator&)>& fn);

// On the rank's own thread, with the communicator launch_ranks gave it: the rank's backend,
// allocators and the communicator to use. cpu_threads: threads of a CPU backend.
RankDevices make_rank_devices(const RunDevices& devices, Communicator& launched, int cpu_threads);

}  // namespace dstrain
