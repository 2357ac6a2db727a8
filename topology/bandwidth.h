// Achievable bandwidth of each link class, for the planner's cost model.
//
// Every number is one direction, bytes per second, what a large copy or a ring collective
// reaches rather than the signalling rate. The constants and their sources are in
// bandwidth.cpp. Keep it simple: no contention model here; the cost model decides how many
// transfers share a link.
#pragma once

#include <string>

#include "topology/topology.h"

namespace dstrain {

// PCIe x`lanes` of generation `generation` (1..6): raw rate after line coding.
// Gen4 x16: 31.5 GB/s.
double pcie_theoretical_bytes_per_s(int generation, int lanes);
// What a copy reaches: the theoretical rate times the PCIe efficiency (gen4 x16: ~25 GB/s).
double pcie_achievable_bytes_per_s(int generation, int lanes);

struct PathBandwidth {
  double bytes_per_s = 0;  // achievable, one direction
  std::string route;       // "18 NVLinks", "PCIe gen4 x16 peer-to-peer", "staged through host"
};

// From GPU a to GPU b (REQUIRES a != b, both valid):
//   NVLink pair:               nvlinks x per-link rate x NVLink efficiency
//   PCIe pair, peer access:    PCIe rate of the slower GPU (x the cross-socket factor on SYS)
//   PCIe pair, no peer access: half of that: every byte crosses PCIe twice, through a pinned
//                              host buffer, and shares the host link
// Peer access unknown counts as none (the planner should not count on it).
PathBandwidth gpu_to_gpu_bandwidth(const NodeTopology& topology, int a, int b);

// Between GPU `gpu` and pinned host memory, one direction (offload, host staging).
PathBandwidth gpu_to_host_bandwidth(const NodeTopology& topology, int gpu);

// The PCIe generation, width and NVLink per-link rate used for a GPU: its own (probe) values,
// else the known-GPU table by name, else PCIe gen4 x16 and 25 GB/s per NVLink.
int effective_pcie_generation(const GpuInfo& gpu);
int effective_pcie_lanes(const GpuInfo& gpu);
double nvlink_link_bytes_per_s(const GpuInfo& gpu);

}  // namespace dstrain
