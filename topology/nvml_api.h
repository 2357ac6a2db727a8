// The few NVML declarations the probe needs (internal to the topology layer and its tests).
//
// NVML is a stable C API (nvml.h, shipped with the driver). dstrain opens libnvidia-ml.so.1
// with dlopen at run time and never links it, so neither the header nor the library is
// needed to build, and the binary runs where no NVIDIA driver is installed. Enums are C enums
// (int-sized) and are passed as int here.
#pragma once

namespace dstrain::nvml {

using Return = int;  // nvmlReturn_t
constexpr Return kSuccess = 0;
constexpr Return kErrorNotSupported = 3;
constexpr Return kErrorDriverNotLoaded = 9;

struct DeviceStruct;
using Device = DeviceStruct*;  // nvmlDevice_t

// nvmlPciInfo_t as filled by nvmlDeviceGetPciInfo_v3 and nvmlDeviceGetNvLinkRemotePciInfo_v2.
struct PciInfo {
  char bus_id_legacy[16];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_subsystem_id;
  char bus_id[32];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE: "00000000:3B:00.0"
};

struct Memory {  // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};

// nvmlGpuTopologyLevel_t
constexpr int kTopologyInternal = 0;     // same board (dual-GPU cards)
constexpr int kTopologySingle = 10;      // one PCIe switch
constexpr int kTopologyMultiple = 20;    // several PCIe switches, no host bridge
constexpr int kTopologyHostBridge = 30;  // the same host bridge
constexpr int kTopologyNode = 40;        // the same NUMA node (was NVML_TOPOLOGY_CPU)
constexpr int kTopologySystem = 50;      // across NUMA nodes

constexpr int kFeatureEnabled = 1;            // nvmlEnableState_t
constexpr int kP2pCapsIndexRead = 0;          // nvmlGpuP2PCapsIndex_t
constexpr int kP2pStatusOk = 0;               // nvmlGpuP2PStatus_t; 1..5: not supported; 6: unknown
constexpr int kP2pStatusGpuNotSupported = 2;
constexpr int kNvlinkDeviceTypeGpu = 0;       // nvmlIntNvLinkDeviceType_t
constexpr int kNvlinkDeviceTypeIbmNpu = 1;
constexpr int kNvlinkDeviceTypeSwitch = 2;
constexpr int kNvlinkDeviceTypeUnknown = 0xFF;
constexpr unsigned int kNvlinkMaxLinks = 18;  // NVML_NVLINK_MAX_LINKS
constexpr unsigned int kNameBufferSize = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE

// The entry points, by their NVML names. Any may be null (an older driver lacks it) except
// init, shutdown, device_count and handle_by_index.
struct Api {
  Return (*init)();                                                  // nvmlInit_v2
  Return (*shutdown)();                                              // nvmlShutdown
  const char* (*error_string)(Return);                               // nvmlErrorString
  Return (*driver_version)(char*, unsigned int);                     // nvmlSystemGetDriverVersion
  Return (*device_count)(unsigned int*);                             // nvmlDeviceGetCount_v2
  Return (*handle_by_index)(unsigned int, Device*);                  // nvmlDeviceGetHandleByIndex_v2
  Return (*name)(Device, char*, unsigned int);                       // nvmlDeviceGetName
  Return (*memory_info)(Device, Memory*);                            // nvmlDeviceGetMemoryInfo
  Return (*pci_info)(Device, PciInfo*);                              // nvmlDeviceGetPciInfo_v3
  Return (*compute_capability)(Device, int*, int*);                  // nvmlDeviceGetCudaComputeCapability
  Return (*numa_node_id)(Device, unsigned int*);                     // nvmlDeviceGetNumaNodeId
  Return (*max_pcie_generation)(Device, unsigned int*);              // nvmlDeviceGetMaxPcieLinkGeneration
  Return (*max_pcie_width)(Device, unsigned int*);                   // nvmlDeviceGetMaxPcieLinkWidth
  Return (*nvlink_state)(Device, unsigned int, int*);                // nvmlDeviceGetNvLinkState
  Return (*nvlink_remote_pci)(Device, unsigned int, PciInfo*);       // nvmlDeviceGetNvLinkRemotePciInfo_v2
  Return (*nvlink_remote_type)(Device, unsigned int, int*);          // nvmlDeviceGetNvLinkRemoteDeviceType
  Return (*common_ancestor)(Device, Device, int*);                   // nvmlDeviceGetTopologyCommonAncestor
  Return (*p2p_status)(Device, Device, int, int*);                   // nvmlDeviceGetP2PStatus
};

}  // namespace dstrain::nvml
