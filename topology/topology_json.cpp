#include "topology/topology_json.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "core/fs.h"
#include "topology/nvidia_smi.h"

namespace dstrain {

using nlohmann::json;

nlohmann::json to_json(const NodeTopology& topology) {
  json gpus = json::array();
  for (const GpuInfo& gpu : topology.gpus) {
    json g;
    g["index"] = gpu.index;
    if (!gpu.name.empty()) g["name"] = gpu.name;
    if (gpu.memory_bytes > 0) g["memory_bytes"] = gpu.memory_bytes;
    if (gpu.sm_count > 0) g["sm_count"] = gpu.sm_count;
    if (gpu.cc_major > 0) {
      g["compute_capability"] = std::to_string(gpu.cc_major) + "." + std::to_string(gpu.cc_minor);
    }
    if (!gpu.pci_bus_id.empty()) g["pci_bus_id"] = gpu.pci_bus_id;
    g["numa_node"] = gpu.numa_node;
    if (gpu.gpu_numa_id >= 0) g["gpu_numa_id"] = gpu.gpu_numa_id;
    if (!gpu.cpu_affinity.empty()) g["cpu_affinity"] = gpu.cpu_affinity;
    if (gpu.pcie_generation > 0) g["pcie_generation"] = gpu.pcie_generation;
    if (gpu.pcie_lanes > 0) g["pcie_lanes"] = gpu.pcie_lanes;
    gpus.push_back(std::move(g));
  }
  json links = json::array();
  for (const Link& link : topology.links) {
    json l;
    l["a"] = link.a;
    l["b"] = link.b;
    l["kind"] = link_kind_name(link.kind);
    if (link.kind == LinkKind::NVLink) l["nvlinks"] = link.nvlinks;
    if (link.path_known) l["path"] = pcie_path_name(link.path);
    // NVLink pairs always have peer access: written only when it says something.
    if (link.peer_access_known && !(link.kind == LinkKind::NVLink && link.peer_access)) {
      l["peer_access"] = link.peer_access;
    }
    links.push_back(std::move(l));
  }
  const Classification classification = topology.classify();
  json out;
  out["gpus"] = std::move(gpus);
  out["links"] = std::move(links);
  out["islands"] = classification.islands;
  out["host_memory_bytes"] = topology.host_memory_bytes;
  out["numa_nodes"] = topology.numa_nodes;
  out["classification"] = classification.label();
  out["source"] = topology.source;
  if (topology.nics_known) out["nics"] = topology.nics;
  return out;
}

namespace {

const json* member(const json& object, const char* key) {
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

int64_t int_member(const json& object, const char* key, const std::string& where, int64_t min,
                   int64_t max, int64_t fallback) {
  const json* value = member(object, key);
  if (value == nullptr) return fallback;
  DSTRAIN_USER_CHECK(value->is_number_integer())
      << "topology JSON: " << where << "." << key << " must be an integer";
  const int64_t v = value->is_number_unsigned()
                        ? static_cast<int64_t>(std::min<uint64_t>(value->get<uint64_t>(), INT64_MAX))
                        : value->get<int64_t>();
  DSTRAIN_USER_CHECK(v >= min && v <= max) << "topology JSON: " << where << "." << key << " is "
                                           << v << ", outside " << min << ".." << max;
  return v;
}

uint64_t bytes_member(const json& object, const char* key, const std::string& where) {
  const json* value = member(object, key);
  if (value == nullptr) return 0;
  DSTRAIN_USER_CHECK(value->is_number_unsigned() || (value->is_number_integer() && value->get<int64_t>() >= 0))
      << "topology JSON: " << where << "." << key << " must be a non-negative integer (bytes)";
  return value->get<uint64_t>();
}

std::string string_member(const json& object, const char* key, const std::string& where) {
  const json* value = member(object, key);
  if (value == nullptr || value->is_null()) return "";
  DSTRAIN_USER_CHECK(value->is_string())
      << "topology JSON: " << where << "." << key << " must be a string";
  return value->get<std::string>();
}

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

GpuInfo gpu_from_json(const json& g, size_t position) {
  const std::string where = "gpus[" + std::to_string(position) + "]";
  DSTRAIN_USER_CHECK(g.is_object()) << "topology JSON: " << where << " must be an object";
  DSTRAIN_USER_CHECK(member(g, "index") != nullptr)
      << "topology JSON: " << where << " has no \"index\"";
  GpuInfo gpu;
  gpu.index = static_cast<int>(int_member(g, "index", where, 0, 1 << 20, 0));
  gpu.name = string_member(g, "name", where);
  gpu.memory_bytes = bytes_member(g, "memory_bytes", where);
  gpu.sm_count = static_cast<int>(int_member(g, "sm_count", where, 0, 1 << 20, 0));
  const std::string cc = string_member(g, "compute_capability", where);
  if (!cc.empty()) {
    int major = 0, minor = 0;
    char dot = 0;
    std::istringstream in(cc);
    const bool ok = static_cast<bool>(in >> major >> dot >> minor) && dot == '.' && in.peek() == EOF &&
                    major > 0 && minor >= 0;
    DSTRAIN_USER_CHECK(ok) << "topology JSON: " << where << ".compute_capability is '" << cc
                           << "', expected MAJOR.MINOR such as \"8.9\"";
    gpu.cc_major = major;
    gpu.cc_minor = minor;
  }
  gpu.pci_bus_id = string_member(g, "pci_bus_id", where);
  gpu.numa_node = static_cast<int>(int_member(g, "numa_node", where, -1, 1 << 20, -1));
  gpu.gpu_numa_id = static_cast<int>(int_member(g, "gpu_numa_id", where, -1, 1 << 20, -1));
  gpu.cpu_affinity = string_member(g, "cpu_affinity", where);
  gpu.pcie_generation = static_cast<int>(int_member(g, "pcie_generation", where, 0, 64, 0));
  gpu.pcie_lanes = static_cast<int>(int_member(g, "pcie_lanes", where, 0, 64, 0));
  return gpu;
}

}  // namespace

NodeTopology topology_from_json(const nlohmann::json& json_in) {
  DSTRAIN_USER_CHECK(json_in.is_object()) << "topology JSON must be an object with \"gpus\" and \"links\"";
  const json* gpus = member(json_in, "gpus");
  DSTRAIN_USER_CHECK(gpus != nullptr && gpus->is_array())
      << "topology JSON has no \"gpus\" array";
  const int n = static_cast<int>(gpus->size());
  NodeTopology topology = make_topology(n);
  std::vector<bool> seen_index(static_cast<size_t>(n), false);
  for (size_t i = 0; i < gpus->size(); ++i) {
    GpuInfo gpu = gpu_from_json((*gpus)[i], i);
    DSTRAIN_USER_CHECK(gpu.index < n)
        << "topology JSON: gpus[" << i << "] has index " << gpu.index << " but there are only "
        << n << " GPUs (indices must be 0.." << n - 1 << ")";
    DSTRAIN_USER_CHECK(!seen_index[static_cast<size_t>(gpu.index)])
        << "topology JSON: GPU index " << gpu.index << " appears twice";
    seen_index[static_cast<size_t>(gpu.index)] = true;
    topology.gpus[static_cast<size_t>(gpu.index)] = std::move(gpu);
  }

  const json* links = member(json_in, "links");
  const size_t pairs = static_cast<size_t>(n) * static_cast<size_t>(n > 0 ? n - 1 : 0) / 2;
  DSTRAIN_USER_CHECK(pairs == 0 || (links != nullptr && links->is_array()))
      << "topology JSON has no \"links\" array; " << n << " GPUs need one link per pair ("
      << pairs << ")";
  std::vector<bool> seen_pair(pairs, false);
  if (links != nullptr) {
    DSTRAIN_USER_CHECK(links->is_array()) << "topology JSON: \"links\" must be an array";
    for (size_t i = 0; i < links->size(); ++i) {
      const json& l = (*links)[i];
      const std::string where = "links[" + std::to_string(i) + "]";
      DSTRAIN_USER_CHECK(l.is_object()) << "topology JSON: " << where << " must be an object";
      DSTRAIN_USER_CHECK(member(l, "a") != nullptr && member(l, "b") != nullptr)
          << "topology JSON: " << where << " needs GPU indices \"a\" and \"b\"";
      const int64_t a = int_member(l, "a", where, INT32_MIN, INT32_MAX, -1);
      const int64_t b = int_member(l, "b", where, INT32_MIN, INT32_MAX, -1);
      for (int64_t gpu : {a, b}) {
        DSTRAIN_USER_CHECK(gpu >= 0 && gpu < n)
            << "topology JSON: " << where << " (" << a << "-" << b << ") refers to GPU " << gpu
            << ", but there are " << n << " GPUs";
      }
      DSTRAIN_USER_CHECK(a != b) << "topology JSON: " << where << " links GPU " << a
                                 << " to itself";
      const int lo = static_cast<int>(std::min(a, b)), hi = static_cast<int>(std::max(a, b));
      const size_t position = link_position(n, lo, hi);
      DSTRAIN_USER_CHECK(!seen_pair[position])
          << "topology JSON: GPU pair " << lo << "-" << hi << " has more than one link";
      seen_pair[position] = true;

      Link& link = topology.link(lo, hi);
      const std::string kind = lower(string_member(l, "kind", where));
      if (kind == "nvlink") {
        link.kind = LinkKind::NVLink;
        link.nvlinks = static_cast<int>(int_member(l, "nvlinks", where, 0, 1 << 16, 0));
        DSTRAIN_USER_CHECK(link.nvlinks > 0)
            << "topology JSON: " << where << " is an NVLink link without a positive \"nvlinks\" count";
        link.peer_access = true;
        link.peer_access_known = true;
      } else {
        DSTRAIN_USER_CHECK(kind == "pcie")
            << "topology JSON: " << where << " has kind '" << string_member(l, "kind", where)
            << "'; expected \"nvlink\" or \"pcie\"";
        link.kind = LinkKind::PCIe;
      }
      const std::string path = string_member(l, "path", where);
      if (!path.empty()) {
        std::string upper = path;
        for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        const std::optional<PciePath> parsed = parse_pcie_path(upper);
        DSTRAIN_USER_CHECK(parsed.has_value())
            << "topology JSON: " << where << " has path '" << path
            << "'; expected PIX, PXB, PHB, NODE or SYS";
        link.path = *parsed;
        link.path_known = true;
      }
      if (const json* peer = member(l, "peer_access"); peer != nullptr && !peer->is_null()) {
        DSTRAIN_USER_CHECK(peer->is_boolean())
            << "topology JSON: " << where << ".peer_access must be true or false";
        link.peer_access = peer->get<bool>();
        link.peer_access_known = true;
      }
    }
  }
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      DSTRAIN_USER_CHECK(seen_pair[link_position(n, a, b)])
          << "topology JSON has no link for GPU pair " << a << "-" << b
          << "; it needs one link per pair";
    }
  }
  topology.host_memory_bytes = bytes_member(json_in, "host_memory_bytes", "topology");
  topology.numa_nodes = static_cast<int>(int_member(json_in, "numa_nodes", "topology", 0, 1 << 16, 0));
  topology.source = string_member(json_in, "source", "topology");
  if (const json* nics = member(json_in, "nics"); nics != nullptr && !nics->is_null()) {
    DSTRAIN_USER_CHECK(nics->is_array())
        << "topology JSON: \"nics\" must be an array of network device names";
    for (const json& name : *nics) {
      DSTRAIN_USER_CHECK(name.is_string())
          << "topology JSON: \"nics\" must be an array of network device names";
      topology.nics.push_back(name.get<std::string>());
    }
    topology.nics_known = true;
  }
  return topology;
}

NodeTopology load_topology_file(const std::string& path) {
  const std::string text = read_file(path);  // UserError naming the path when unreadable
  size_t first = 0;
  while (first < text.size() && std::isspace(static_cast<unsigned char>(text[first]))) ++first;
  if (first < text.size() && text[first] == '{') {
    json parsed;
    try {
      parsed = json::parse(text);
    } catch (const json::parse_error& e) {
      DSTRAIN_USER_ERROR() << "topology file '" << path << "' is not valid JSON (error at byte "
                           << e.byte << ")";
    } catch (const json::exception& e) {  // a number too large for a double, ...
      DSTRAIN_USER_ERROR() << "topology file '" << path << "' is not valid JSON (" << e.what()
                           << ")";
    }
    NodeTopology topology = topology_from_json(parsed);
    if (topology.source.empty()) topology.source = path;
    return topology;
  }
  return parse_nvidia_smi_topo(text);
}

}  // namespace dstrain
