#include "train/devices.h"

#include <algorithm>

#include "comm/nccl_communicator.h"
#include "comm/staged_communicator.h"
#include "core/check.h"
#include "topology/shared_memory.h"

#ifdef DSTRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include <string_view>

#include "kernels/cuda/cuda_allocator.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace dstrain {

bool cuda_backend_built() {
#ifdef DSTRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int usable_cuda_devices() {
#ifdef DSTRAIN_WITH_CUDA
  return cuda_device_count();
#else
  return 0;
#endif
}

namespace {

// True on the CUDA emulator (DSTRAIN_CUDA=EMULATOR), whose NCCL exchanges through its own host
// memory, not /dev/shm. It names its devices so (kernels/cuda_emu/emu_cuda_api.cpp).
bool gpus_are_emulated() {
#ifdef DSTRAIN_WITH_CUDA
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return std::string_view(properties.name) == "dstrain CUDA emulator";
#else
  return false;
#endif
}

}  // namespace

std::string RunDevices::describe() const {
  if (!cuda) return "the CPU backend";
  std::string text = "CUDA on " + std::to_string(gpus) + (gpus == 1 ? " GPU" : " GPUs");
  if (ranks > gpus) text += " shared by " + std::to_string(ranks) + " ranks";
  text += nccl ? ", NCCL" : ", local communicator through host copies";
  return text;
}

RunDevices choose_devices(const std::string& device, int ranks, int max_gpus) {
  DSTRAIN_CHECK(ranks >= 1) << ranks << " ranks";
  DSTRAIN_USER_CHECK(device == "auto" || device == "cpu" || device == "cuda")
      << "--device must be auto, cpu or cuda, not '" << device << "'";
  RunDevices devices;
  devices.ranks = ranks;
  if (device == "cpu") return devices;
  const int found = usable_cuda_devices();
  if (device == "cuda") {
    DSTRAIN_USER_CHECK(cuda_backend_built())
        << "--device cuda: this dstrain was built without the CUDA backend (DSTRAIN_CUDA=OFF); "
        << "rebuild it with the CUDA toolkit, or train on the CPU with --device cpu";
    DSTRAIN_USER_CHECK(found > 0)
        << "--device cuda: no CUDA device is usable here (no GPU, or no driver)";
  }
  if (found == 0) return devices;  // auto without a GPU: the CPU backend
  devices.cuda = true;
  devices.gpus = std::min(found, ranks);
  if (max_gpus > 0) devices.gpus = std::min(devices.gpus, max_gpus);
  // NCCL cannot put two ranks of one communicator on the same GPU.
  devices.nccl = nccl_available() && ranks <= devices.gpus;
  // Before any NCCL call and before the model is loaded: a container with Docker's 64 MB of
  // /dev/shm fails inside NCCL's initialization, with a message that does not say why.
  // NCCL joins one GPU per rank: the ranks' count, not the machine's GPUs.
  if (devices.nccl && !gpus_are_emulated()) check_shared_memory_for_nccl(ranks);
  return devices;
}

void launch_ranks(const RunDevices& devices, double timeout_seconds,
                  const std::function<void(Communicator&)>& fn) {
  if (devices.cuda && devices.nccl) {
    run_nccl_ranks(devices.ranks, timeout_seconds, fn);
  } else {
    run_local_ranks(devices.ranks, timeout_seconds, fn);
  }
}

RankDevices make_rank_devices(const RunDevices& devices, Communicator& launched, int cpu_threads) {
  RankDevices rank;
  rank.comm = &launched;
  if (!devices.cuda) {
    rank.backend = make_cpu_backend(cpu_threads);
    rank.device = make_cpu_allocator(launched.rank());
    rank.host = make_cpu_allocator(launched.rank());
    if (devices.memory_limit > 0) rank.device->set_limit(devices.memory_limit, devices.memory_limit_flag);
    return rank;
  }
#ifdef DSTRAIN_WITH_CUDA
  const int gpu = (launched.rank() - devices.first_rank) % devices.gpus;
  thread_error_context().device = "cuda:" + std::to_string(gpu);
  rank.backend = make_cuda_backend(gpu);
  rank.device = make_cuda_allocator(gpu);
  if (devices.memory_limit > 0) rank.device->set_limit(devices.memory_limit, devices.memory_limit_flag);
  rank.host = make_pinned_host_allocator();
  if (!devices.nccl) {
    // The local communicator moves host memory: device tensors go through host copies, on
    // the backend's stream, waited for before the collective reads them.
    Backend* backend = rank.backend.get();
    rank.comm_wrapper = make_staged_communicator(
        launched, [backend](void* dst, const void* src, size_t bytes, Stream stream) {
          backend->copy_bytes(dst, src, bytes, stream);
          backend->synchronize(stream);
        });
    rank.comm = rank.comm_wrapper.get();
  }
  rank.compute = OwnedStream(*rank.backend);
  return rank;
#else
  DSTRAIN_CHECK(false) << "a CUDA run in a build without the CUDA backend";
  return rank;
#endif
}

}  // namespace dstrain
