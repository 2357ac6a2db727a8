#include "topology/shared_memory.h"

#include <sys/statvfs.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/allocator.h"
#include "core/check.h"

namespace dstrain {
namespace {

// How much NCCL's shared-memory transport takes (src/transport/shm.cc). Every receive
// connection of a rank is one /dev/shm segment holding a small header and one buffer per
// protocol; with NCCL's defaults 4096 + 524288 + 4915200 + 4194304 = 9,637,888 bytes (about
// 9.2 MiB), the size NCCL 2.18 reports when it cannot create one ("Error while creating shared
// memory segment /dev/shm/nccl-... (size 9637888)").
constexpr uint64_t kSegmentHeaderBytes = 4096;
// Each GPU receives on every channel of its ring, and NCCL runs at least two channels on a
// PCIe machine (it doubles the one ring it finds). That gives 8 GPUs 147 MiB, 4 GPUs 73.5 MiB and
// 2 GPUs 36.8 MiB: in line with reports that four GPUs fail in Docker's 64 MB where two work. Trees
// and point-to-point channels (pipeline stages) add segments, so this is the least NCCL needs;
// NCCL's own guide asks for --shm-size=1g. NCCL versions that place these buffers elsewhere
// (cuMem host memory) need less: DSTRAIN_SKIP_SHM_CHECK=1 skips the check.
constexpr uint64_t kChannelsAtLeast = 2;

bool environment_says_one(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string_view(value) == "1";
}

// A positive whole number from the environment, else `fallback` (NCCL ignores what it cannot
// parse too).
uint64_t environment_bytes(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value, &end, 0);
  if (errno != 0 || *end != '\0' || parsed <= 0) return fallback;
  return static_cast<uint64_t>(parsed);
}

}  // namespace

NcclProtocolBuffers nccl_protocol_buffers_from_environment() {
  NcclProtocolBuffers buffers;
  buffers.ll = environment_bytes("NCCL_LL_BUFFSIZE", buffers.ll);
  buffers.ll128 = environment_bytes("NCCL_LL128_BUFFSIZE", buffers.ll128);
  buffers.simple = environment_bytes("NCCL_BUFFSIZE", buffers.simple);
  return buffers;
}

uint64_t nccl_shm_bytes_needed(int gpus, const NcclProtocolBuffers& buffers) {
  DSTRAIN_CHECK(gpus >= 0) << gpus << " GPUs";
  const uint64_t segment = kSegmentHeaderBytes + buffers.ll + buffers.ll128 + buffers.simple;
  return static_cast<uint64_t>(gpus) * kChannelsAtLeast * segment;
}

std::optional<SharedMemorySpace> shared_memory_space(const std::string& path, std::string* error) {
  struct statvfs stats {};
  if (statvfs(path.c_str(), &stats) != 0) {
    if (error != nullptr) *error = std::strerror(errno);
    return std::nullopt;
  }
  SharedMemorySpace space;
  space.free_bytes = static_cast<uint64_t>(stats.f_bavail) * stats.f_frsize;
  space.total_bytes = static_cast<uint64_t>(stats.f_blocks) * stats.f_frsize;
  return space;
}

void require_shared_memory(const std::string& path, const SharedMemorySpace& space,
                           uint64_t needed, int gpus) {
  DSTRAIN_USER_CHECK(space.free_bytes >= needed)
      << path << " has " << format_bytes(space.free_bytes) << " free ("
      << format_bytes(space.total_bytes) << " in all), but NCCL's shared-memory transport needs "
      << "at least " << format_bytes(needed) << " for " << gpus
      << " GPUs: start the container with --ipc=host (or --shm-size=1g or more), or set "
      << "DSTRAIN_SKIP_SHM_CHECK=1 to start anyway";
}

void check_shared_memory_for_nccl(int gpus, const std::string& path) {
  if (gpus < 2) return;  // one GPU: NCCL has no peer to connect to
  if (environment_says_one("NCCL_SHM_DISABLE") || environment_says_one("DSTRAIN_SKIP_SHM_CHECK")) {
    return;
  }
  std::string error;
  const std::optional<SharedMemorySpace> space = shared_memory_space(path, &error);
  DSTRAIN_USER_CHECK(space.has_value())
      << "cannot read " << path << " (" << error << "), where NCCL's shared-memory transport "
      << "keeps its buffers: start the container with --ipc=host, or set "
      << "DSTRAIN_SKIP_SHM_CHECK=1 to start anyway";
  require_shared_memory(path, *space,
                        nccl_shm_bytes_needed(gpus, nccl_protocol_buffers_from_environment()), gpus);
}

}  // namespace dstrain
