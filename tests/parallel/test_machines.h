// Machines for the planner's tests: real `nvidia-smi topo -m` outputs
// (tests/topology/fixtures) completed with --gpu and --host-memory, as a user would.
#pragma once

#include <sstream>
#include <string>

#include "parallel/machine.h"

namespace dstrain::testing {

// host_memory: as --host-memory ("256G"); "" leaves it unknown. gpu "" leaves names unknown.
inline NodeTopology fixture_machine(const std::string& fixture, const std::string& gpu,
                                    const std::string& host_memory) {
  MachineSource source;
  source.nvidia_smi_file = std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/" + fixture;
  source.gpu = gpu;
  source.host_memory = host_memory;
  std::istringstream no_input;
  return load_machine(source, no_input, nullptr);
}

}  // namespace dstrain::testing
