#include "topology/host_memory.h"

#include <sys/resource.h>

#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "core/allocator.h"

namespace dstrain {

namespace {

// The value of `key` ("MemAvailable:") in a /proc file of "key: value kB" lines, in bytes.
std::optional<uint64_t> kib_field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream fields(line.substr(key.size()));
    uint64_t kib = 0;
    std::string unit;
    if (fields >> kib >> unit && unit == "kB") return kib * 1024;
  }
  return std::nullopt;
}

// A cgroup file holding one number ("max" or an absurdly high value: no limit).
std::optional<uint64_t> cgroup_number(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return std::nullopt;
  try {
    size_t used = 0;
    const unsigned long long value = std::stoull(text, &used);
    if (used != text.size() || value >= (uint64_t{1} << 60)) return std::nullopt;
    return value;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

struct Limit {
  uint64_t free = 0;
  std::string what;
};

std::optional<Limit> cgroup_limit(const std::string& root) {
  for (const auto& [limit_file, usage_file] :
       {std::pair<std::string, std::string>{"/memory.max", "/memory.current"},
        {"/memory/memory.limit_in_bytes", "/memory/memory.usage_in_bytes"}}) {
    const std::optional<uint64_t> limit = cgroup_number(root + limit_file);
    if (!limit) continue;
    const uint64_t usage = cgroup_number(root + usage_file).value_or(0);
    return Limit{*limit > usage ? *limit - usage : 0,
                 "the cgroup's memory limit (" + format_bytes(*limit) + ", " +
                     format_bytes(usage) + " in use)"};
  }
  return std::nullopt;
}

std::optional<Limit> address_space_limit(const HostMemorySources& sources) {
  uint64_t limit = sources.rlimit_as;
  if (sources.read_rlimit) {
    rlimit value{};
    if (::getrlimit(RLIMIT_AS, &value) != 0 || value.rlim_cur == RLIM_INFINITY) return std::nullopt;
    limit = value.rlim_cur;
  }
  if (limit == 0) return std::nullopt;
  const uint64_t used = kib_field(sources.self_status, "VmSize:").value_or(0);
  return Limit{limit > used ? limit - used : 0,
               "the address-space limit (ulimit -v: " + format_bytes(limit) + ", " +
                   format_bytes(used) + " mapped)"};
}

}  // namespace

std::optional<uint64_t> locked_memory_limit() {
  rlimit value{};
  if (::getrlimit(RLIMIT_MEMLOCK, &value) != 0 || value.rlim_cur == RLIM_INFINITY) {
    return std::nullopt;
  }
  return static_cast<uint64_t>(value.rlim_cur);
}

HostMemoryBudget available_host_memory(const HostMemorySources& sources) {
  HostMemoryBudget budget;
  const auto take = [&budget](const std::optional<Limit>& limit) {
    if (!limit) return;
    if (budget.limited_by.empty() || limit->free < budget.bytes) {
      budget.bytes = limit->free;
      budget.limited_by = limit->what;
    }
  };
  if (const std::optional<uint64_t> available = kib_field(sources.meminfo, "MemAvailable:")) {
    take(Limit{*available, "MemAvailable in " + sources.meminfo});
  }
  take(cgroup_limit(sources.cgroup_root));
  take(address_space_limit(sources));
  return budget;
}

}  // namespace dstrain
