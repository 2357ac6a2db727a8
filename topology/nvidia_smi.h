// The text of `nvidia-smi topo -m` (and `-mp`, and `-p2p r|w|rw`) as a NodeTopology.
//
// Takes what the tool prints and what people paste: tab- or space-separated cells, the self
// cell " X ", NIC columns and rows (NIC0.. with a "NIC Legend:" block, or mlx5_0.. on older
// drivers; never GPUs), trailing "CPU Affinity" / "NUMA Affinity" / "GPU NUMA ID" columns
// with empty or N/A cells, ANSI colour codes, NV# (a bonded set of # NVLinks, a count, not a
// version), the -mp view (PCIe paths only, no NV#), SOC (older drivers' SYS), the legend at
// the end, and a shell prompt or other lines before the header.
#pragma once

#include <string>

#include "topology/topology.h"

namespace dstrain {

// GPUs, their NUMA node, CPU affinity and GPU NUMA ID when the text has those columns, and
// every pair's link: NV# -> NVLink (path unknown, peer access yes); PIX..SYS -> PCIe with
// that path (peer access unknown: the matrix does not say; see apply_nvidia_smi_p2p and
// apply_gpu_model). GPU names, memory and host memory stay unknown. numa_nodes is the number
// of distinct NUMA nodes the GPUs name (0 when the text has no NUMA column).
// Throws UserError with one sentence on text that is not such a matrix: no GPU rows, a row
// with too few cells, a missing or repeated GPU row, a cell that is not a link type, a
// matrix that is not symmetric.
NodeTopology parse_nvidia_smi_topo(const std::string& text);

// `nvidia-smi topo -p2p r` (or w, rw): sets peer access on the PCIe links. OK -> yes;
// CNS, GNS, TNS, NS, DR -> no; U -> left unknown. NVLink pairs keep peer access yes.
// REQUIRES: the matrix has as many GPUs as `topology`; throws UserError otherwise or on text
// that is not such a matrix.
void apply_nvidia_smi_p2p(NodeTopology& topology, const std::string& text);

}  // namespace dstrain
