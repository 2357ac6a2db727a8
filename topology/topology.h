// NodeTopology: the GPUs of one machine and how every pair of them is wired.
//
// Where it comes from: a probe of this machine (probe.h: CUDA runtime + NVML), the text of
// `nvidia-smi topo -m` (nvidia_smi.h), or a saved JSON file (topology_json.h). The planner
// reads it through link(), nvlink_islands(), classify() and bandwidth.h.
//
// Unknown is a value here, not a guess: a field the source did not give keeps its "unknown"
// value (0, -1, empty, *_known = false) until an override (gpu_table.h: apply_gpu_model)
// fills it from the known-GPU table.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

struct GpuInfo {
  int index = 0;                  // CUDA device ordinal (nvidia-smi order when no CUDA runtime)
  std::string name;               // "NVIDIA GeForce RTX 4090"; empty: unknown
  uint64_t memory_bytes = 0;      // total device memory; 0: unknown
  int sm_count = 0;               // streaming multiprocessors; 0: unknown
  int cc_major = 0, cc_minor = 0; // compute capability; 0.0: unknown
  std::string pci_bus_id;         // "0000:3b:00.0" (lower case, 4-digit domain); empty: unknown
  int numa_node = -1;             // host NUMA node the GPU hangs off; -1: unknown
  int gpu_numa_id = -1;           // NUMA node of the GPU's own memory (Grace Hopper); -1: none
  std::string cpu_affinity;       // CPUs close to the GPU, "0-35,72-107"; empty: unknown
  int pcie_generation = 0;        // max PCIe generation of the GPU's link; 0: unknown
  int pcie_lanes = 0;             // max PCIe width of the GPU's link; 0: unknown
};

enum class LinkKind : uint8_t { NVLink, PCIe };

// The PCIe path between two GPUs, nearest first (the nvidia-smi legend):
//   PIX  at most one PCIe bridge (both under one PCIe switch)
//   PXB  several PCIe bridges, no host bridge
//   PHB  through a PCIe host bridge (the CPU)
//   NODE between host bridges within one NUMA node
//   SYS  across the SMP interconnect between NUMA nodes (QPI/UPI, xGMI); older drivers: SOC
enum class PciePath : uint8_t { PIX, PXB, PHB, NODE, SYS };

// One unordered GPU pair.
struct Link {
  int a = -1, b = -1;              // GPU indices, a < b
  LinkKind kind = LinkKind::PCIe;  // NVLink when the pair shares at least one NVLink
  int nvlinks = 0;                 // NVLink: bonded links between the pair (nvidia-smi's NV#)
  PciePath path = PciePath::SYS;   // meaningful only when path_known
  bool path_known = false;         // nvidia-smi -m prints NV# instead of the PCIe path
  bool peer_access = false;        // cudaDeviceCanAccessPeer both ways; only when ..._known
  bool peer_access_known = false;
};

// How the GPUs are joined, for the planner and for people.
enum class TopologyKind : uint8_t {
  NoGpus,
  SingleGpu,
  NVLinkIsland,   // every pair joined directly by NVLink (NVSwitch or full mesh)
  NVLinkPairs,    // every GPU in an NVLink island of exactly 2 (bridged pairs), PCIe between
  NVLinkPartial,  // NVLink between some pairs only (a mesh that is not all-to-all, mixed)
  PCIeOnly,       // no NVLink at all
};

// Peer access over the pairs that are not joined by NVLink.
enum class PeerAccess : uint8_t {
  NotApplicable,  // no PCIe-only pair (one NVLink island, or fewer than 2 GPUs)
  All,
  None,
  Some,           // some PCIe pairs yes, some no
  Unknown,        // at least one PCIe pair unknown and none contradicting
};

struct Classification {
  TopologyKind kind = TopologyKind::NoGpus;
  PeerAccess pcie_peer_access = PeerAccess::NotApplicable;
  bool numa_split = false;  // GPUs under more than one NUMA node, or a SYS path between two
  int gpu_numa_nodes = 0;   // distinct known NUMA nodes of the GPUs
  std::vector<std::vector<int>> islands;  // nvlink_islands()

  // Short machine-readable label: "nvlink-island", "pcie+no-peer+numa-split", ...
  std::string label() const;
  // One sentence for people: "8 GPUs joined only by PCIe, without peer access, ..."
  std::string sentence() const;
};

struct NodeTopology {
  std::vector<GpuInfo> gpus;     // gpus[i].index == i
  std::vector<Link> links;       // one per unordered pair, sorted by (a, b): n*(n-1)/2
  uint64_t host_memory_bytes = 0;  // 0: unknown
  int numa_nodes = 0;              // host NUMA nodes; 0: unknown
  std::string source;              // "nvidia-smi topo -m", "probe (CUDA runtime, NVML)", ...
  // The network devices `nvidia-smi topo -m` lists ("mlx5_0", ...: its NIC legend's names, or
  // the column names of older drivers), for the inter-node link (topology/cluster.h). Known
  // only from that text: nics_known with no names means the machine has none it lists.
  std::vector<std::string> nics;
  bool nics_known = false;

  int gpu_count() const { return static_cast<int>(gpus.size()); }
  // REQUIRES: 0 <= a, b < gpu_count(), a != b (order does not matter).
  const Link& link(int a, int b) const;
  Link& link(int a, int b);
  // Connected components of the NVLink graph, each sorted, ordered by first GPU. Every GPU is
  // in exactly one island; a GPU without NVLink is an island of one.
  std::vector<std::vector<int>> nvlink_islands() const;
  Classification classify() const;
  // Internal invariants (indices, pair order, a < b, NVLink counts); throws dstrain::Error.
  void check_invariants() const;
};

// A topology of `gpu_count` GPUs (index set, nothing else known) with every pair a PCIe link
// of unknown path and unknown peer access.
NodeTopology make_topology(int gpu_count);

// Position of pair (a, b), a < b, in NodeTopology::links.
size_t link_position(int gpu_count, int a, int b);

const char* link_kind_name(LinkKind kind);          // "nvlink", "pcie"
const char* pcie_path_name(PciePath path);          // "PIX", ..., "SYS"
// "PIX", "PXB", "PHB", "NODE", "SYS", and "SOC" (older drivers) = SYS; case-sensitive.
std::optional<PciePath> parse_pcie_path(std::string_view text);
const char* topology_kind_name(TopologyKind kind);  // "nvlink-island", "pcie", ...
const char* peer_access_name(PeerAccess access);    // "peer", "no-peer", ...

}  // namespace dstrain
