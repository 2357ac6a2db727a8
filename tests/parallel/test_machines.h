// Machines and helpers for the planner's tests. Machines: real `nvidia-smi topo -m` outputs
// (tests/topology/fixtures) completed with --gpu and --host-memory, as a user would.
#pragma once

#include <functional>
#include <sstream>
#include <string>

#include "core/check.h"
#include "parallel/machine.h"
#include "parallel/plan.h"

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

// The message of the UserError `body` throws, or "no error".
inline std::string user_error(const std::function<void()>& body) {
  try {
    body();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

// A bf16 plan of sequences of 1024 tokens, ZeRO-0, no offload, no recompute.
inline Plan bf16_plan(int dp, int tp, int pp, int64_t micro_batch, int64_t grad_accum) {
  Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.micro_batch = micro_batch;
  p.grad_accum = grad_accum;
  p.seq_len = 1024;
  p.param_dtype = DType::BF16;
  return p;
}

}  // namespace dstrain::testing
