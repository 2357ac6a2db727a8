// The machine a plan is made for: this one (probed), a saved topology file, or the text of
// `nvidia-smi topo -m`, completed by what the user says (--gpu NAME, --host-memory SIZE).
// Used by `dstrain topo`, `dstrain plan` and training.
#pragma once

#include <istream>
#include <string>

#include "topology/topology.h"

namespace dstrain {

struct MachineSource {
  std::string topology_file;    // --topology FILE: JSON from `dstrain topo --json`, or the text
                                // of `nvidia-smi topo -m`
  std::string nvidia_smi_file;  // --from-nvidia-smi FILE, "-": standard input
  std::string gpu;              // --gpu NAME: fills what the source left unknown (gpu_table.h)
  std::string host_memory;      // --host-memory SIZE ("256G"): replaces the source's value
  std::string gpu_memory;       // --gpu-memory SIZE: every GPU's memory, as if it had only SIZE

  bool names_a_machine() const { return !topology_file.empty() || !nvidia_smi_file.empty(); }
};

// Loads the topology. Neither file: probes this machine (`report`, when not null, receives
// the probe's one-line account of what it found). Then applies --gpu, --host-memory and
// --gpu-memory (on this machine's GPUs at most what they have) and
// infers unknown peer access from known GPU names. `in` is read for "-".
// Throws UserError on both files given, an unreadable or unparsable file, an unknown GPU
// name, a bad size.
NodeTopology load_machine(const MachineSource& source, std::istream& in, std::string* report);

// --gpu-memory SIZE in bytes. Throws UserError on a bad size or 0.
uint64_t parse_gpu_memory(const std::string& size);

// --gpu-memory SIZE on `topology`'s GPUs (`probed`: this machine's, which SIZE may not exceed).
// Throws UserError on a bad size.
void apply_gpu_memory(NodeTopology& topology, const std::string& size, bool probed);

}  // namespace dstrain
