// A NodeTopology as text for people (`dstrain topology`).
#pragma once

#include <string>

#include "topology/topology.h"

namespace dstrain {

// A summary line, the GPU list (name, memory, SMs, compute capability, NUMA node, PCI bus),
// the link matrix in nvidia-smi's words ("NV18", "PIX", "SYS*": * = no peer access,
// ? = peer access unknown), its key, and the classification in one sentence.
std::string format_topology_table(const NodeTopology& topology);

// The text of one matrix cell for pair (a, b): "NV4", "PHB*", "SYS?", "PCIe?" (path unknown).
std::string format_link_cell(const Link& link);

}  // namespace dstrain
