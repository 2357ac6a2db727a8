#include "topology/format.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/allocator.h"  // format_bytes

namespace dstrain {

namespace {

// Left-aligned columns separated by two spaces, no trailing spaces.
std::string render_columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (row.size() > width.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string or_unknown(const std::string& text) { return text.empty() ? "?" : text; }

}  // namespace

std::string format_link_cell(const Link& link) {
  std::string cell;
  if (link.kind == LinkKind::NVLink) {
    cell = "NV" + std::to_string(link.nvlinks);
  } else {
    cell = link.path_known ? pcie_path_name(link.path) : "PCIe";
  }
  if (!link.peer_access_known) {
    cell += "?";
  } else if (!link.peer_access) {
    cell += "*";
  }
  return cell;
}

std::string format_topology_table(const NodeTopology& topology) {
  const int n = topology.gpu_count();
  std::ostringstream out;
  out << n << (n == 1 ? " GPU" : " GPUs") << ", host memory "
      << (topology.host_memory_bytes ? format_bytes(topology.host_memory_bytes) : "unknown")
      << ", " << (topology.numa_nodes ? std::to_string(topology.numa_nodes) : "unknown")
      << (topology.numa_nodes == 1 ? " NUMA node" : " NUMA nodes");
  if (!topology.source.empty()) out << " (source: " << topology.source << ")";
  out << "\n";
  if (n > 0) {
    std::vector<std::vector<std::string>> gpu_rows = {
        {"GPU", "name", "memory", "SMs", "cc", "NUMA", "PCI bus"}};
    for (const GpuInfo& gpu : topology.gpus) {
      gpu_rows.push_back(
          {std::to_string(gpu.index), or_unknown(gpu.name),
           gpu.memory_bytes ? format_bytes(gpu.memory_bytes) : "?",
           gpu.sm_count ? std::to_string(gpu.sm_count) : "?",
           gpu.cc_major ? std::to_string(gpu.cc_major) + "." + std::to_string(gpu.cc_minor) : "?",
           gpu.numa_node >= 0 ? std::to_string(gpu.numa_node) : "?", or_unknown(gpu.pci_bus_id)});
    }
    out << "\n" << render_columns(gpu_rows);
  }
  if (n > 1) {
    std::vector<std::vector<std::string>> matrix;
    std::vector<std::string> header = {""};
    for (int b = 0; b < n; ++b) header.push_back("GPU" + std::to_string(b));
    matrix.push_back(header);
    for (int a = 0; a < n; ++a) {
      std::vector<std::string> row = {"GPU" + std::to_string(a)};
      for (int b = 0; b < n; ++b) row.push_back(a == b ? "X" : format_link_cell(topology.link(a, b)));
      matrix.push_back(row);
    }
    out << "\n" << render_columns(matrix)
        << "NV# = # bonded NVLinks; PIX, PXB, PHB, NODE, SYS = PCIe path, nearest first; "
           "* = no peer access; ? = peer access unknown\n";
  }
  out << "\n" << topology.classify().sentence() << "\n";
  return out.str();
}

}  // namespace dstrain
