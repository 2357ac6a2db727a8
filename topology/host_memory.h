// How much host memory this process may still allocate: the least of what the kernel has
// available (MemAvailable), what the process's cgroup allows beyond what it uses (v2
// memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes), and its
// address-space limit (RLIMIT_AS, ulimit -v) beyond its current size. On CPU ranks the whole
// run lives in host memory, so this is their budget (train/plan_run.h checks it before
// anything is allocated).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dstrain {

struct HostMemorySources {
  std::string meminfo = "/proc/meminfo";
  std::string cgroup_root = "/sys/fs/cgroup";  // v2 files at the root, v1 under memory/
  std::string self_status = "/proc/self/status";  // VmSize, for the address-space limit
  bool read_rlimit = true;  // getrlimit(RLIMIT_AS); tests turn it off
  uint64_t rlimit_as = 0;   // when !read_rlimit: the limit to assume (0: none)
};

struct HostMemoryBudget {
  uint64_t bytes = 0;       // what may still be allocated; 0 when nothing could be read
  std::string limited_by;   // "MemAvailable", "the cgroup's memory limit (24.00 GiB)", ...
};

HostMemoryBudget available_host_memory(const HostMemorySources& sources = {});

// The most this process may lock in memory (RLIMIT_MEMLOCK's soft limit, ulimit -l), or nullopt
// when unlimited or unknown. Containers start with a small one unless given --ulimit memlock.
std::optional<uint64_t> locked_memory_limit();

}  // namespace dstrain
