// What this machine has: GPUs (CUDA runtime when built with CUDA, NVML loaded at run time),
// how they are linked (NVML), host memory and NUMA nodes (/proc, /sys).
//
// Never fails for lack of hardware: with no driver, no GPU and no NVML it returns a topology
// of zero GPUs and a report that says so. NVML is loaded with dlopen and never linked, so
// the binary runs where no NVIDIA driver is installed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "topology/topology.h"

namespace dstrain {

namespace nvml {
struct Api;  // topology/nvml_api.h
}

struct ProbeOptions {
  std::string nvml_library = "libnvidia-ml.so.1";  // the dlopen name
  bool use_cuda_runtime = true;                      // has an effect only in a CUDA build
  std::string sysfs_root = "/sys";                   // NUMA nodes, PCI devices' NUMA node
  std::string meminfo_path = "/proc/meminfo";        // host memory
  const nvml::Api* nvml_api = nullptr;  // tests: a fake NVML used instead of nvml_library
};

// GPUs are CUDA device ordinals when the CUDA runtime sees devices (NVML's facts are matched
// to them by PCI bus id), else NVML's order (nvidia-smi's). Per pair: the NVLink count
// (direct links, plus NVSwitch links: min of the two GPUs' switch links, as nvidia-smi's
// NV#), the PCIe path (NVML's common ancestor), peer access (cudaDeviceCanAccessPeer both
// ways, else NVML's P2P status, else the known-GPU table, else unknown).
// `report`, when not null, receives one line saying what was found, e.g.
// "no NVIDIA driver (libnvidia-ml.so.1 not found); no CUDA device (built without CUDA);
//  0 GPUs; host memory 62.7 GiB; 1 NUMA node".
NodeTopology probe_local_topology(std::string* report);
NodeTopology probe_local_topology(const ProbeOptions& options, std::string* report);

// MemTotal of a /proc/meminfo file in bytes; 0 when it cannot be read.
uint64_t read_host_memory_bytes(const std::string& meminfo_path);
// Number of node<N> directories under <sysfs_root>/devices/system/node; 0 when absent.
int count_numa_nodes(const std::string& sysfs_root);
// "00000000:3B:00.0", "0000:3b:00.0", "3b:00.0" -> "0000:3b:00.0"; "" when not a PCI bus id.
std::string normalize_pci_bus_id(std::string_view bus_id);

}  // namespace dstrain
