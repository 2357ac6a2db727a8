#include "topology/bandwidth.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "topology/gpu_table.h"

namespace dstrain {

namespace {

// Per-lane data rate in bytes/s after line coding, by PCIe generation (PCI-SIG base
// specifications): gen1 2.5 GT/s and gen2 5 GT/s with 8b/10b; gen3 8 GT/s, gen4 16 GT/s,
// gen5 32 GT/s with 128b/130b; gen6 64 GT/s PAM4 with 242/256-byte FLITs.
double pcie_lane_bytes_per_s(int generation) {
  switch (generation) {
    case 1: return 2.5e9 * 8 / 10 / 8;
    case 2: return 5.0e9 * 8 / 10 / 8;
    case 3: return 8.0e9 * 128 / 130 / 8;
    case 4: return 16.0e9 * 128 / 130 / 8;
    case 5: return 32.0e9 * 128 / 130 / 8;
    case 6: return 64.0e9 * 242 / 256 / 8;
    default: break;
  }
  DSTRAIN_CHECK(false) << "PCIe generation " << generation;
  return 0;
}

// Large copies reach ~80% of the PCIe rate: gen4 x16 gives ~25 GB/s of 31.5 (an RTX 4090
// pair with peer access measures 50 GB/s bidirectional, tinygrad/open-gpu-kernel-modules
// issue 6), gen5 x16 ~50 GB/s of 63. TLP headers and flow control take the rest.
constexpr double kPcieEfficiency = 0.80;

// NVLink: a pair of H100s over bridges measures 260.9 GB/s bidirectional of the 300 GB/s
// spec (0.87, NVIDIA/cuda-samples issue 392); collectives add protocol overhead, so 0.80.
constexpr double kNvlinkEfficiency = 0.80;

// A SYS path crosses the link between CPU sockets (UPI/xGMI) as well: an L4 pair on a SYS
// path copies 19.87 GB/s with cudaMemcpyPeer (NVIDIA/cuda-samples issue 284) against ~25
// GB/s for gen4 x16 within a socket: 0.8.
constexpr double kCrossSocketFactor = 0.80;

// Without peer access a GPU-to-GPU copy is staged through a pinned host buffer: each byte
// crosses PCIe twice and the two hops share the host's side. Measured 6.60 GB/s peer vs
// 3.10 GB/s staged on one rig (noonghunna/club-3090 pull request 926): one half.
constexpr double kStagedFactor = 0.5;

// Defaults for a GPU nothing is known about: the common PCIe gen4 x16 slot, and the 25 GB/s
// per direction of an NVLink 3/4 link (A100 and H100 datasheets: 600 and 900 GB/s over 12
// and 18 links, both directions).
constexpr int kDefaultPcieGeneration = 4;
constexpr int kDefaultPcieLanes = 16;
constexpr double kDefaultNvlinkBytesPerS = 25e9;
// GA10x (compute capability 8.6) NVLink: 14.0625 GB/s per link per direction (GA102
// whitepaper, "Third-Generation NVLink").
constexpr double kGa10xNvlinkBytesPerS = 14.0625e9;

std::string pcie_name(int generation, int lanes) {
  return "PCIe gen" + std::to_string(generation) + " x" + std::to_string(lanes);
}

}  // namespace

double pcie_theoretical_bytes_per_s(int generation, int lanes) {
  DSTRAIN_CHECK(lanes > 0) << lanes;
  return pcie_lane_bytes_per_s(generation) * lanes;
}

double pcie_achievable_bytes_per_s(int generation, int lanes) {
  return pcie_theoretical_bytes_per_s(generation, lanes) * kPcieEfficiency;
}

int effective_pcie_generation(const GpuInfo& gpu) {
  if (gpu.pcie_generation > 0) return std::min(gpu.pcie_generation, 6);
  if (const KnownGpu* known = find_known_gpu(gpu.name)) return known->pcie_generation;
  return kDefaultPcieGeneration;
}

int effective_pcie_lanes(const GpuInfo& gpu) {
  if (gpu.pcie_lanes > 0) return gpu.pcie_lanes;
  if (const KnownGpu* known = find_known_gpu(gpu.name)) return known->pcie_lanes;
  return kDefaultPcieLanes;
}

double nvlink_link_bytes_per_s(const GpuInfo& gpu) {
  if (const KnownGpu* known = find_known_gpu(gpu.name); known && known->nvlink_bytes_per_s > 0) {
    return known->nvlink_bytes_per_s;
  }
  if (gpu.cc_major == 8 && gpu.cc_minor == 6) return kGa10xNvlinkBytesPerS;
  return kDefaultNvlinkBytesPerS;
}

PathBandwidth gpu_to_gpu_bandwidth(const NodeTopology& topology, int a, int b) {
  const Link& link = topology.link(a, b);
  const GpuInfo& ga = topology.gpus[static_cast<size_t>(a)];
  const GpuInfo& gb = topology.gpus[static_cast<size_t>(b)];
  PathBandwidth result;
  if (link.kind == LinkKind::NVLink) {
    const double per_link = std::min(nvlink_link_bytes_per_s(ga), nvlink_link_bytes_per_s(gb));
    result.bytes_per_s = link.nvlinks * per_link * kNvlinkEfficiency;
    result.route = std::to_string(link.nvlinks) + (link.nvlinks == 1 ? " NVLink" : " NVLinks");
    return result;
  }
  const int generation = std::min(effective_pcie_generation(ga), effective_pcie_generation(gb));
  const int lanes = std::min(effective_pcie_lanes(ga), effective_pcie_lanes(gb));
  double rate = pcie_achievable_bytes_per_s(generation, lanes);
  const bool cross_socket = link.path_known && link.path == PciePath::SYS;
  if (cross_socket) rate *= kCrossSocketFactor;
  const bool peer = link.peer_access_known && link.peer_access;
  if (peer) {
    result.route = pcie_name(generation, lanes) + " peer-to-peer";
  } else {
    rate *= kStagedFactor;
    result.route = pcie_name(generation, lanes) + " staged through host memory";
  }
  if (cross_socket) result.route += " across CPU sockets";
  result.bytes_per_s = rate;
  return result;
}

PathBandwidth gpu_to_host_bandwidth(const NodeTopology& topology, int gpu) {
  DSTRAIN_CHECK(gpu >= 0 && gpu < topology.gpu_count()) << gpu;
  const GpuInfo& info = topology.gpus[static_cast<size_t>(gpu)];
  const int generation = effective_pcie_generation(info);
  const int lanes = effective_pcie_lanes(info);
  return {pcie_achievable_bytes_per_s(generation, lanes), pcie_name(generation, lanes) + " to host"};
}

}  // namespace dstrain
