// NodeTopology <-> JSON, so a machine's topology can be saved, edited, and planned for
// elsewhere (a planner run for a machine one is not on).
//
//   {"gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_bytes": 25769803776,
//              "sm_count": 128, "compute_capability": "8.9", "pci_bus_id": "0000:01:00.0",
//              "numa_node": 0}, ...],
//    "links": [{"a": 0, "b": 1, "kind": "nvlink", "nvlinks": 12},
//              {"a": 0, "b": 4, "kind": "pcie", "path": "SYS", "peer_access": false}, ...],
//    "islands": [[0, 1], ...], "host_memory_bytes": 274877906944, "numa_nodes": 2,
//    "classification": "pcie+no-peer+numa-split", "source": "nvidia-smi topo -m"}
//
// One link object per unordered GPU pair. Unknown values are left out: a GPU without "name",
// a PCIe link without "path" or without "peer_access". Optional GPU fields: "gpu_numa_id",
// "cpu_affinity", "pcie_generation", "pcie_lanes"; an NVLink link may carry "path" and
// "peer_access" too. "islands" and "classification" are written for people and tools; they
// are derived, so topology_from_json ignores them. "nics": the network devices `nvidia-smi
// topo -m` listed (["mlx5_0", ...]), written when known (an empty list: none).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "topology/topology.h"

namespace dstrain {

nlohmann::json to_json(const NodeTopology& topology);

// Validates as it reads; throws UserError with one sentence on: a missing or non-array
// "gpus", GPU indices that are not 0..n-1 once each, a field of the wrong type, a link that
// names a missing GPU or itself, a duplicate pair, a missing pair, a kind other than
// "nvlink"/"pcie", an NVLink link without a positive "nvlinks", a path other than
// PIX/PXB/PHB/NODE/SYS (SOC is read as SYS).
NodeTopology topology_from_json(const nlohmann::json& json);

// Reads a topology file: JSON (as written by to_json) or the text of `nvidia-smi topo -m`.
// Throws UserError when the file cannot be read or parsed.
NodeTopology load_topology_file(const std::string& path);

}  // namespace dstrain
