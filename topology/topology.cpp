#include "topology/topology.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include "core/check.h"

namespace dstrain {

size_t link_position(int gpu_count, int a, int b) {
  DSTRAIN_CHECK(0 <= a && a < b && b < gpu_count)
      << "pair (" << a << ", " << b << ") of " << gpu_count << " GPUs";
  // Pairs before row a: (n-1) + (n-2) + ... + (n-a); then the offset of b within row a.
  const size_t n = static_cast<size_t>(gpu_count);
  const size_t row = static_cast<size_t>(a);
  return row * n - row * (row + 1) / 2 + static_cast<size_t>(b - a - 1);
}

NodeTopology make_topology(int gpu_count) {
  DSTRAIN_CHECK(gpu_count >= 0) << gpu_count;
  NodeTopology topology;
  topology.gpus.resize(static_cast<size_t>(gpu_count));
  for (int i = 0; i < gpu_count; ++i) topology.gpus[static_cast<size_t>(i)].index = i;
  for (int a = 0; a < gpu_count; ++a) {
    for (int b = a + 1; b < gpu_count; ++b) {
      Link link;
      link.a = a;
      link.b = b;
      topology.links.push_back(link);
    }
  }
  return topology;
}

const Link& NodeTopology::link(int a, int b) const {
  DSTRAIN_CHECK(a != b) << "a GPU has no link to itself (GPU " << a << ")";
  const int n = gpu_count();
  DSTRAIN_CHECK(0 <= a && a < n && 0 <= b && b < n)
      << "pair (" << a << ", " << b << ") of " << n << " GPUs";
  DSTRAIN_CHECK(links.size() == static_cast<size_t>(n) * static_cast<size_t>(n - 1) / 2)
      << links.size() << " links for " << n << " GPUs";
  const Link& found = links[link_position(n, std::min(a, b), std::max(a, b))];
  DSTRAIN_CHECK(found.a == std::min(a, b) && found.b == std::max(a, b))
      << "links out of order: found (" << found.a << ", " << found.b << ")";
  return found;
}

Link& NodeTopology::link(int a, int b) {
  return const_cast<Link&>(static_cast<const NodeTopology&>(*this).link(a, b));
}

void NodeTopology::check_invariants() const {
  const int n = gpu_count();
  for (int i = 0; i < n; ++i) {
    DSTRAIN_CHECK(gpus[static_cast<size_t>(i)].index == i)
        << "gpus[" << i << "].index is " << gpus[static_cast<size_t>(i)].index;
  }
  DSTRAIN_CHECK(links.size() == static_cast<size_t>(n) * static_cast<size_t>(n > 0 ? n - 1 : 0) / 2)
      << links.size() << " links for " << n << " GPUs";
  size_t position = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b, ++position) {
      const Link& l = links[position];
      DSTRAIN_CHECK(l.a == a && l.b == b) << "links[" << position << "] is (" << l.a << ", " << l.b
                                          << "), expected (" << a << ", " << b << ")";
      DSTRAIN_CHECK((l.kind == LinkKind::NVLink) == (l.nvlinks > 0))
          << "pair " << a << "-" << b << ": kind " << link_kind_name(l.kind) << " with "
          << l.nvlinks << " NVLinks";
    }
  }
}

std::vector<std::vector<int>> NodeTopology::nvlink_islands() const {
  const int n = gpu_count();
  std::vector<int> parent(static_cast<size_t>(n));
  std::iota(parent.begin(), parent.end(), 0);
  auto root = [&](int x) {
    while (parent[static_cast<size_t>(x)] != x) {
      parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
      x = parent[static_cast<size_t>(x)];
    }
    return x;
  };
  for (const Link& l : links) {
    if (l.kind != LinkKind::NVLink) continue;
    const int ra = root(l.a), rb = root(l.b);
    // Keep the smaller index as the root so islands come out ordered by first GPU.
    if (ra != rb) parent[static_cast<size_t>(std::max(ra, rb))] = std::min(ra, rb);
  }
  std::vector<std::vector<int>> islands;
  std::vector<int> island_of_root(static_cast<size_t>(n), -1);
  for (int i = 0; i < n; ++i) {
    const int r = root(i);
    if (island_of_root[static_cast<size_t>(r)] < 0) {
      island_of_root[static_cast<size_t>(r)] = static_cast<int>(islands.size());
      islands.emplace_back();
    }
    islands[static_cast<size_t>(island_of_root[static_cast<size_t>(r)])].push_back(i);
  }
  return islands;
}

Classification NodeTopology::classify() const {
  Classification c;
  const int n = gpu_count();
  c.islands = nvlink_islands();
  std::set<int> numa;
  for (const GpuInfo& gpu : gpus) {
    if (gpu.numa_node >= 0) numa.insert(gpu.numa_node);
  }
  c.gpu_numa_nodes = static_cast<int>(numa.size());
  c.numa_split = numa.size() > 1;
  for (const Link& l : links) {
    if (l.path_known && l.path == PciePath::SYS) c.numa_split = true;
  }
  if (n == 0) {
    c.kind = TopologyKind::NoGpus;
    return c;
  }
  if (n == 1) {
    c.kind = TopologyKind::SingleGpu;
    return c;
  }
  size_t nvlink_pairs = 0;
  int peer_yes = 0, peer_no = 0, peer_unknown = 0;
  for (const Link& l : links) {
    if (l.kind == LinkKind::NVLink) {
      ++nvlink_pairs;
    } else if (!l.peer_access_known) {
      ++peer_unknown;
    } else if (l.peer_access) {
      ++peer_yes;
    } else {
      ++peer_no;
    }
  }
  if (nvlink_pairs == 0) {
    c.kind = TopologyKind::PCIeOnly;
  } else if (nvlink_pairs == links.size()) {
    c.kind = TopologyKind::NVLinkIsland;
  } else if (std::all_of(c.islands.begin(), c.islands.end(),
                         [](const std::vector<int>& island) { return island.size() == 2; })) {
    c.kind = TopologyKind::NVLinkPairs;
  } else {
    c.kind = TopologyKind::NVLinkPartial;
  }
  if (peer_yes + peer_no + peer_unknown == 0) {
    c.pcie_peer_access = PeerAccess::NotApplicable;
  } else if (peer_yes > 0 && peer_no > 0) {
    c.pcie_peer_access = PeerAccess::Some;
  } else if (peer_unknown > 0) {
    c.pcie_peer_access = PeerAccess::Unknown;
  } else {
    c.pcie_peer_access = peer_yes > 0 ? PeerAccess::All : PeerAccess::None;
  }
  return c;
}

namespace {

std::string island_text(const std::vector<int>& island) {
  std::ostringstream out;
  out << "{";
  for (size_t i = 0; i < island.size(); ++i) out << (i ? "," : "") << island[i];
  out << "}";
  return out.str();
}

std::string islands_text(const std::vector<std::vector<int>>& islands, size_t min_size) {
  std::string text;
  for (const auto& island : islands) {
    if (island.size() < min_size) continue;
    if (!text.empty()) text += " ";
    text += island_text(island);
  }
  return text;
}

const char* peer_phrase(PeerAccess access) {
  switch (access) {
    case PeerAccess::All: return "peer access over PCIe";
    case PeerAccess::None: return "no peer access over PCIe";
    case PeerAccess::Some: return "peer access over PCIe between some pairs only";
    case PeerAccess::Unknown: return "peer access over PCIe unknown";
    case PeerAccess::NotApplicable: return "";
  }
  return "";
}

}  // namespace

std::string Classification::label() const {
  std::string text = topology_kind_name(kind);
  if (pcie_peer_access != PeerAccess::NotApplicable) {
    text += "+";
    text += peer_access_name(pcie_peer_access);
  }
  if (numa_split) text += "+numa-split";
  return text;
}

std::string Classification::sentence() const {
  size_t n = 0;
  for (const auto& island : islands) n += island.size();
  std::ostringstream out;
  switch (kind) {
    case TopologyKind::NoGpus:
      return "No GPUs.";
    case TopologyKind::SingleGpu:
      out << "1 GPU";
      break;
    case TopologyKind::NVLinkIsland:
      out << n << " GPUs in one NVLink island " << islands_text(islands, 1)
          << " (every pair joined by NVLink)";
      break;
    case TopologyKind::NVLinkPairs:
      out << n << " GPUs in " << islands.size() << " NVLink-bridged pairs "
          << islands_text(islands, 2) << ", PCIe between the pairs";
      break;
    case TopologyKind::NVLinkPartial:
      out << n << " GPUs with NVLink between some pairs only, NVLink islands "
          << islands_text(islands, 1) << ", PCIe elsewhere";
      break;
    case TopologyKind::PCIeOnly:
      out << n << " GPUs joined only by PCIe (no NVLink)";
      break;
  }
  if (pcie_peer_access != PeerAccess::NotApplicable) {
    out << "; " << peer_phrase(pcie_peer_access);
  }
  if (numa_split) {
    if (gpu_numa_nodes > 1) {
      out << "; GPUs split across " << gpu_numa_nodes << " NUMA nodes";
    } else {
      out << "; some GPU pairs cross the link between CPU sockets (SYS)";
    }
  }
  out << ".";
  return out.str();
}

const char* link_kind_name(LinkKind kind) {
  return kind == LinkKind::NVLink ? "nvlink" : "pcie";
}

const char* pcie_path_name(PciePath path) {
  switch (path) {
    case PciePath::PIX: return "PIX";
    case PciePath::PXB: return "PXB";
    case PciePath::PHB: return "PHB";
    case PciePath::NODE: return "NODE";
    case PciePath::SYS: return "SYS";
  }
  return "?";
}

std::optional<PciePath> parse_pcie_path(std::string_view text) {
  if (text == "PIX") return PciePath::PIX;
  if (text == "PXB") return PciePath::PXB;
  if (text == "PHB") return PciePath::PHB;
  if (text == "NODE") return PciePath::NODE;
  if (text == "SYS" || text == "SOC") return PciePath::SYS;  // SOC: older drivers' name for SYS
  return std::nullopt;
}

const char* topology_kind_name(TopologyKind kind) {
  switch (kind) {
    case TopologyKind::NoGpus: return "no-gpu";
    case TopologyKind::SingleGpu: return "single-gpu";
    case TopologyKind::NVLinkIsland: return "nvlink-island";
    case TopologyKind::NVLinkPairs: return "nvlink-pairs";
    case TopologyKind::NVLinkPartial: return "nvlink-partial";
    case TopologyKind::PCIeOnly: return "pcie";
  }
  return "?";
}

const char* peer_access_name(PeerAccess access) {
  switch (access) {
    case PeerAccess::NotApplicable: return "n/a";
    case PeerAccess::All: return "peer";
    case PeerAccess::None: return "no-peer";
    case PeerAccess::Some: return "some-peer";
    case PeerAccess::Unknown: return "peer-unknown";
  }
  return "?";
}

}  // namespace dstrain
