#include "topology/probe.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/allocator.h"  // format_bytes
#include "core/check.h"
#include "topology/gpu_table.h"
#include "topology/nvml_api.h"

#ifdef DSTRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dstrain {

namespace {

// libnvidia-ml opened (or a fake NVML given by a test), initialized, and shut down and closed
// again on destruction.
class NvmlSession {
 public:
  explicit NvmlSession(const ProbeOptions& options) {
    if (options.nvml_api != nullptr) {
      api_ = *options.nvml_api;
    } else {
      handle_ = dlopen(options.nvml_library.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle_ == nullptr) {
        status_ = "no NVIDIA driver (" + options.nvml_library + " not found)";
        return;
      }
      load(api_.init, "nvmlInit_v2");
      load(api_.shutdown, "nvmlShutdown");
      load(api_.error_string, "nvmlErrorString");
      load(api_.driver_version, "nvmlSystemGetDriverVersion");
      load(api_.device_count, "nvmlDeviceGetCount_v2");
      load(api_.handle_by_index, "nvmlDeviceGetHandleByIndex_v2");
      load(api_.name, "nvmlDeviceGetName");
      load(api_.memory_info, "nvmlDeviceGetMemoryInfo");
      load(api_.pci_info, "nvmlDeviceGetPciInfo_v3");
      load(api_.compute_capability, "nvmlDeviceGetCudaComputeCapability");
      load(api_.numa_node_id, "nvmlDeviceGetNumaNodeId");  // newer drivers only
      load(api_.max_pcie_generation, "nvmlDeviceGetMaxPcieLinkGeneration");
      load(api_.max_pcie_width, "nvmlDeviceGetMaxPcieLinkWidth");
      load(api_.nvlink_state, "nvmlDeviceGetNvLinkState");
      load(api_.nvlink_remote_pci, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
      load(api_.nvlink_remote_type, "nvmlDeviceGetNvLinkRemoteDeviceType");
      load(api_.common_ancestor, "nvmlDeviceGetTopologyCommonAncestor");
      load(api_.p2p_status, "nvmlDeviceGetP2PStatus");
    }
    if (api_.init == nullptr || api_.shutdown == nullptr || api_.device_count == nullptr ||
        api_.handle_by_index == nullptr) {
      status_ = options.nvml_library + " lacks nvmlInit_v2/nvmlDeviceGetCount_v2 (driver too old)";
      return;
    }
    const nvml::Return result = api_.init();
    if (result != nvml::kSuccess) {
      status_ = "NVML did not start (nvmlInit: " + error(result) + ")";
      return;
    }
    initialized_ = true;
  }
  ~NvmlSession() {
    if (initialized_) api_.shutdown();
    if (handle_ != nullptr) dlclose(handle_);
  }
  NvmlSession(const NvmlSession&) = delete;
  NvmlSession& operator=(const NvmlSession&) = delete;

  bool ready() const { return initialized_; }
  const std::string& status() const { return status_; }
  const nvml::Api& api() const { return api_; }
  std::string error(nvml::Return result) const {
    const char* text = api_.error_string ? api_.error_string(result) : nullptr;
    return text ? text : "NVML error " + std::to_string(result);
  }

 private:
  template <class Fn>
  void load(Fn& fn, const char* symbol) {
    fn = reinterpret_cast<Fn>(dlsym(handle_, symbol));
  }

  nvml::Api api_{};
  void* handle_ = nullptr;
  bool initialized_ = false;
  std::string status_;
};

// What NVML says about one GPU.
struct NvmlGpu {
  nvml::Device device = nullptr;
  std::string name;
  std::string bus_id;  // normalized
  uint64_t memory_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  int numa_node = -1;
  int pcie_generation = 0, pcie_lanes = 0;
  std::vector<std::string> nvlink_peer_bus_ids;  // one entry per active link to a GPU
  int nvswitch_links = 0;                        // active links to an NVSwitch
};

std::vector<NvmlGpu> query_nvml_gpus(const NvmlSession& session, std::string* status) {
  const nvml::Api& api = session.api();
  std::vector<NvmlGpu> gpus;
  unsigned int count = 0;
  const nvml::Return result = api.device_count(&count);
  if (result != nvml::kSuccess) {
    *status = "NVML could not count GPUs (" + session.error(result) + ")";
    return gpus;
  }
  for (unsigned int i = 0; i < count; ++i) {
    NvmlGpu gpu;
    if (api.handle_by_index(i, &gpu.device) != nvml::kSuccess) continue;
    char name[nvml::kNameBufferSize] = {};
    if (api.name && api.name(gpu.device, name, sizeof(name)) == nvml::kSuccess) gpu.name = name;
    nvml::Memory memory{};
    if (api.memory_info && api.memory_info(gpu.device, &memory) == nvml::kSuccess) {
      gpu.memory_bytes = memory.total;
    }
    nvml::PciInfo pci{};
    if (api.pci_info && api.pci_info(gpu.device, &pci) == nvml::kSuccess) {
      pci.bus_id[sizeof(pci.bus_id) - 1] = '\0';
      gpu.bus_id = normalize_pci_bus_id(pci.bus_id);
    }
    int major = 0, minor = 0;
    if (api.compute_capability &&
        api.compute_capability(gpu.device, &major, &minor) == nvml::kSuccess) {
      gpu.cc_major = major;
      gpu.cc_minor = minor;
    }
    unsigned int value = 0;
    if (api.numa_node_id && api.numa_node_id(gpu.device, &value) == nvml::kSuccess &&
        value < (1u << 16)) {
      gpu.numa_node = static_cast<int>(value);
    }
    if (api.max_pcie_generation && api.max_pcie_generation(gpu.device, &value) == nvml::kSuccess) {
      gpu.pcie_generation = static_cast<int>(value);
    }
    if (api.max_pcie_width && api.max_pcie_width(gpu.device, &value) == nvml::kSuccess) {
      gpu.pcie_lanes = static_cast<int>(value);
    }
    for (unsigned int link = 0; api.nvlink_state && link < nvml::kNvlinkMaxLinks; ++link) {
      int state = 0;
      const nvml::Return r = api.nvlink_state(gpu.device, link, &state);
      if (r != nvml::kSuccess || state != nvml::kFeatureEnabled) continue;
      int remote_type = -1;
      if (api.nvlink_remote_type &&
          api.nvlink_remote_type(gpu.device, link, &remote_type) == nvml::kSuccess &&
          remote_type == nvml::kNvlinkDeviceTypeSwitch) {
        ++gpu.nvswitch_links;
        continue;
      }
      nvml::PciInfo remote{};
      if (!api.nvlink_remote_pci || api.nvlink_remote_pci(gpu.device, link, &remote) != nvml::kSuccess) {
        continue;
      }
      remote.bus_id[sizeof(remote.bus_id) - 1] = '\0';
      const std::string remote_bus = normalize_pci_bus_id(remote.bus_id);
      // Without the remote type (older drivers), a remote that is not one of the GPUs is
      // taken for an NVSwitch: resolved once all GPUs' bus ids are known.
      if (remote_type == nvml::kNvlinkDeviceTypeGpu || remote_type < 0 ||
          remote_type == nvml::kNvlinkDeviceTypeUnknown) {
        gpu.nvlink_peer_bus_ids.push_back(remote_bus);
      }
    }
    gpus.push_back(std::move(gpu));
  }
  // Links recorded as GPU links whose remote is no GPU here go to an NVSwitch.
  for (NvmlGpu& gpu : gpus) {
    std::vector<std::string> to_gpus;
    for (const std::string& remote : gpu.nvlink_peer_bus_ids) {
      const bool is_gpu = std::any_of(gpus.begin(), gpus.end(),
                                      [&](const NvmlGpu& other) { return other.bus_id == remote; });
      if (is_gpu) {
        to_gpus.push_back(remote);
      } else {
        ++gpu.nvswitch_links;
      }
    }
    gpu.nvlink_peer_bus_ids = std::move(to_gpus);
  }
  return gpus;
}

PciePath path_from_nvml_level(int level) {
  if (level <= nvml::kTopologySingle) return PciePath::PIX;  // same board, or one switch
  if (level <= nvml::kTopologyMultiple) return PciePath::PXB;
  if (level <= nvml::kTopologyHostBridge) return PciePath::PHB;
  if (level <= nvml::kTopologyNode) return PciePath::NODE;
  return PciePath::SYS;
}

int sysfs_numa_node(const std::string& sysfs_root, const std::string& bus_id) {
  if (bus_id.empty()) return -1;
  std::ifstream in(sysfs_root + "/bus/pci/devices/" + bus_id + "/numa_node");
  int node = -1;
  if (in >> node && node >= 0) return node;
  return -1;
}

struct CudaFacts {
  std::vector<GpuInfo> gpus;
  std::vector<std::vector<bool>> can_access;  // [i][j]: cudaDeviceCanAccessPeer(i, j)
  std::string status;
};

CudaFacts query_cuda(bool use_cuda_runtime) {
  CudaFacts facts;
#ifdef DSTRAIN_WITH_CUDA
  if (!use_cuda_runtime) {
    facts.status = "no CUDA device (CUDA runtime not used)";
    return facts;
  }
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    facts.status = std::string("no CUDA device (") + cudaGetErrorString(result) + ")";
    cudaGetLastError();  // clear it, so later CUDA calls start clean
    return facts;
  }
  if (count == 0) {
    facts.status = "no CUDA device";
    return facts;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    GpuInfo gpu;
    gpu.index = i;
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      gpu.name = prop.name;
      gpu.memory_bytes = prop.totalGlobalMem;
      gpu.sm_count = prop.multiProcessorCount;
      gpu.cc_major = prop.major;
      gpu.cc_minor = prop.minor;
      char bus[32];
      std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                    prop.pciDeviceID);
      gpu.pci_bus_id = bus;
    } else {
      cudaGetLastError();
    }
    facts.gpus.push_back(gpu);
  }
  facts.can_access.assign(static_cast<size_t>(count), std::vector<bool>(static_cast<size_t>(count), false));
  for (int i = 0; i < count; ++i) {
    for (int j = 0; j < count; ++j) {
      if (i == j) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, i, j) != cudaSuccess) {
        cudaGetLastError();
        can = 0;
      }
      facts.can_access[static_cast<size_t>(i)][static_cast<size_t>(j)] = can != 0;
    }
  }
  facts.status = std::to_string(count) + (count == 1 ? " CUDA device" : " CUDA devices");
#else
  (void)use_cuda_runtime;
  facts.status = "no CUDA device (built without CUDA)";
#endif
  return facts;
}

}  // namespace

std::string normalize_pci_bus_id(std::string_view bus_id) {
  // [domain:]bus:device.function, hexadecimal.
  std::vector<std::string> parts;
  std::string current;
  std::vector<char> separators;
  for (char c : bus_id) {
    if (c == ':' || c == '.') {
      parts.push_back(current);
      separators.push_back(c);
      current.clear();
    } else if (std::isxdigit(static_cast<unsigned char>(c))) {
      current += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      return "";
    }
  }
  parts.push_back(current);
  unsigned long domain = 0, bus = 0, device = 0, function = 0;
  auto hex = [](const std::string& text, unsigned long* value) {
    if (text.empty() || text.size() > 8) return false;
    *value = std::stoul(text, nullptr, 16);
    return true;
  };
  bool ok = false;
  if (parts.size() == 4 && separators == std::vector<char>{':', ':', '.'}) {
    ok = hex(parts[0], &domain) && hex(parts[1], &bus) && hex(parts[2], &device) &&
         hex(parts[3], &function);
  } else if (parts.size() == 3 && separators == std::vector<char>{':', '.'}) {
    ok = hex(parts[0], &bus) && hex(parts[1], &device) && hex(parts[2], &function);
  }
  if (!ok || bus > 0xff || device > 0x1f || function > 0x7) return "";
  char text[32];
  std::snprintf(text, sizeof(text), "%04lx:%02lx:%02lx.%lx", domain, bus, device, function);
  return text;
}

uint64_t read_host_memory_bytes(const std::string& meminfo_path) {
  std::ifstream in(meminfo_path);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, 9, "MemTotal:") != 0) continue;
    std::istringstream fields(line.substr(9));
    uint64_t kib = 0;
    std::string unit;
    if (fields >> kib >> unit && unit == "kB") return kib * 1024;
  }
  return 0;
}

int count_numa_nodes(const std::string& sysfs_root) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path dir = fs::path(sysfs_root) / "devices" / "system" / "node";
  int count = 0;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
        std::all_of(name.begin() + 4, name.end(),
                    [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      ++count;
    }
  }
  return count;
}

NodeTopology probe_local_topology(std::string* report) {
  return probe_local_topology(ProbeOptions{}, report);
}

NodeTopology probe_local_topology(const ProbeOptions& options, std::string* report) {
  std::vector<std::string> lines;
  const CudaFacts cuda = query_cuda(options.use_cuda_runtime);

  NvmlSession nvml_session(options);
  const nvml::Api& nvml_api = nvml_session.api();
  std::vector<NvmlGpu> nvml_gpus;
  std::string nvml_status = nvml_session.status();
  if (nvml_session.ready()) {
    nvml_gpus = query_nvml_gpus(nvml_session, &nvml_status);
    if (nvml_status.empty()) {
      char version[96] = {};
      std::string driver;
      if (nvml_api.driver_version &&
          nvml_api.driver_version(version, sizeof(version)) == nvml::kSuccess) {
        driver = std::string("driver ") + version + ", ";
      }
      nvml_status = "NVML: " + driver + std::to_string(nvml_gpus.size()) +
                    (nvml_gpus.size() == 1 ? " GPU" : " GPUs");
    }
  }
  lines.push_back(nvml_status);
  lines.push_back(cuda.status);

  // The GPU list: CUDA ordinals when the runtime sees devices, else NVML's order.
  const bool from_cuda = !cuda.gpus.empty();
  const int n = static_cast<int>(from_cuda ? cuda.gpus.size() : nvml_gpus.size());
  NodeTopology topology = make_topology(n);
  std::vector<const NvmlGpu*> nvml_of(static_cast<size_t>(n), nullptr);
  for (int i = 0; i < n; ++i) {
    GpuInfo& gpu = topology.gpus[static_cast<size_t>(i)];
    if (from_cuda) {
      gpu = cuda.gpus[static_cast<size_t>(i)];
      for (const NvmlGpu& candidate : nvml_gpus) {
        if (!gpu.pci_bus_id.empty() && candidate.bus_id == gpu.pci_bus_id) nvml_of[static_cast<size_t>(i)] = &candidate;
      }
    } else {
      nvml_of[static_cast<size_t>(i)] = &nvml_gpus[static_cast<size_t>(i)];
    }
    gpu.index = i;
    if (const NvmlGpu* facts = nvml_of[static_cast<size_t>(i)]) {
      if (gpu.name.empty()) gpu.name = facts->name;
      if (gpu.memory_bytes == 0) gpu.memory_bytes = facts->memory_bytes;
      if (gpu.cc_major == 0) {
        gpu.cc_major = facts->cc_major;
        gpu.cc_minor = facts->cc_minor;
      }
      if (gpu.pci_bus_id.empty()) gpu.pci_bus_id = facts->bus_id;
      gpu.numa_node = facts->numa_node;
      gpu.pcie_generation = facts->pcie_generation;
      gpu.pcie_lanes = facts->pcie_lanes;
    }
    if (gpu.numa_node < 0) gpu.numa_node = sysfs_numa_node(options.sysfs_root, gpu.pci_bus_id);
    if (gpu.sm_count == 0) {
      if (const KnownGpu* known = find_known_gpu(gpu.name)) gpu.sm_count = known->sm_count;
    }
  }

  bool any_peer_unknown = false;
  for (Link& link : topology.links) {
    const NvmlGpu* a = nvml_of[static_cast<size_t>(link.a)];
    const NvmlGpu* b = nvml_of[static_cast<size_t>(link.b)];
    if (a != nullptr && b != nullptr) {
      const auto direct = [](const NvmlGpu* from, const NvmlGpu* to) {
        return static_cast<int>(std::count(from->nvlink_peer_bus_ids.begin(),
                                           from->nvlink_peer_bus_ids.end(), to->bus_id));
      };
      int nvlinks = std::max(direct(a, b), direct(b, a));
      if (a->nvswitch_links > 0 && b->nvswitch_links > 0) {
        nvlinks += std::min(a->nvswitch_links, b->nvswitch_links);
      }
      if (nvlinks > 0) {
        link.kind = LinkKind::NVLink;
        link.nvlinks = nvlinks;
      }
      int level = 0;
      if (nvml_api.common_ancestor &&
          nvml_api.common_ancestor(a->device, b->device, &level) == nvml::kSuccess) {
        link.path = path_from_nvml_level(level);
        link.path_known = true;
      }
    }
    if (link.kind == LinkKind::NVLink) {
      link.peer_access = true;
      link.peer_access_known = true;
    } else if (from_cuda) {
      link.peer_access = cuda.can_access[static_cast<size_t>(link.a)][static_cast<size_t>(link.b)] &&
                         cuda.can_access[static_cast<size_t>(link.b)][static_cast<size_t>(link.a)];
      link.peer_access_known = true;
    } else if (a != nullptr && b != nullptr && nvml_api.p2p_status) {
      int ab = -1, ba = -1;
      const bool asked =
          nvml_api.p2p_status(a->device, b->device, nvml::kP2pCapsIndexRead, &ab) == nvml::kSuccess &&
          nvml_api.p2p_status(b->device, a->device, nvml::kP2pCapsIndexRead, &ba) == nvml::kSuccess;
      if (asked) {
        link.peer_access = ab == nvml::kP2pStatusOk && ba == nvml::kP2pStatusOk;
        link.peer_access_known = true;
      }
    }
    any_peer_unknown = any_peer_unknown || !link.peer_access_known;
  }
  if (any_peer_unknown) infer_unknown_peer_access(topology);

  topology.host_memory_bytes = read_host_memory_bytes(options.meminfo_path);
  if (topology.host_memory_bytes == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page_size > 0) {
      topology.host_memory_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
    }
  }
  topology.numa_nodes = count_numa_nodes(options.sysfs_root);

  std::string source = "probe";
  if (from_cuda && nvml_session.ready()) {
    source += " (CUDA runtime, NVML)";
  } else if (from_cuda) {
    source += " (CUDA runtime)";
  } else if (nvml_session.ready()) {
    source += " (NVML)";
  }
  topology.source = source;

  lines.push_back(std::to_string(n) + (n == 1 ? " GPU" : " GPUs"));
  lines.push_back(topology.host_memory_bytes ? "host memory " + format_bytes(topology.host_memory_bytes)
                                             : "host memory unknown");
  lines.push_back(topology.numa_nodes == 0
                      ? "NUMA nodes unknown"
                      : std::to_string(topology.numa_nodes) +
                            (topology.numa_nodes == 1 ? " NUMA node" : " NUMA nodes"));
  if (report != nullptr) {
    std::string text;
    for (const std::string& line : lines) {
      if (line.empty()) continue;
      if (!text.empty()) text += "; ";
      text += line;
    }
    *report = text;
  }
  topology.check_invariants();
  return topology;
}

}  // namespace dstrain
