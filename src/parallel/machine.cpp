#include "parallel/machine.h"

#include <iterator>

#include "core/allocator.h"
#include "core/check.h"
#include "core/fs.h"
#include "topology/gpu_table.h"
#include "topology/nvidia_smi.h"
#include "topology/probe.h"
#include "topology/topology_json.h"
#include "topology/units.h"

namespace dstrain {

NodeTopology load_machine(const MachineSource& source, std::istream& in, std::string* report) {
  DSTRAIN_USER_CHECK(source.topology_file.empty() || source.nvidia_smi_file.empty())
      << "give either --topology or --from-nvidia-smi, not both";
  NodeTopology topology;
  if (!source.topology_file.empty()) {
    topology = load_topology_file(source.topology_file);
  } else if (source.nvidia_smi_file == "-") {
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    topology = parse_nvidia_smi_topo(text);
    topology.source = "nvidia-smi topo -m (standard input)";
  } else if (!source.nvidia_smi_file.empty()) {
    topology = parse_nvidia_smi_topo(read_file(source.nvidia_smi_file));
    topology.source = "nvidia-smi topo -m (" + source.nvidia_smi_file + ")";
  } else {
    topology = probe_local_topology(report);
  }
  if (!source.gpu.empty()) apply_gpu_model(topology, lookup_gpu(source.gpu));
  if (!source.host_memory.empty()) topology.host_memory_bytes = parse_size(source.host_memory);
  if (!source.gpu_memory.empty()) {
    apply_gpu_memory(topology, source.gpu_memory, !source.names_a_machine());
  }
  infer_unknown_peer_access(topology);
  topology.check_invariants();
  return topology;
}

uint64_t parse_gpu_memory(const std::string& size) {
  const uint64_t bytes = parse_size(size);
  DSTRAIN_USER_CHECK(bytes > 0) << "--gpu-memory " << size << ": give a size above 0, e.g. 24G";
  return bytes;
}

void apply_gpu_memory(NodeTopology& topology, const std::string& size, bool probed) {
  const uint64_t bytes = parse_gpu_memory(size);
  for (GpuInfo& gpu : topology.gpus) {
    DSTRAIN_USER_CHECK(!probed || gpu.memory_bytes == 0 || bytes <= gpu.memory_bytes)
        << "--gpu-memory " << size << " is more than GPU " << gpu.index << " (" << gpu.name
        << ") has: " << format_bytes(gpu.memory_bytes);
    gpu.memory_bytes = bytes;
  }
}

}  // namespace dstrain
