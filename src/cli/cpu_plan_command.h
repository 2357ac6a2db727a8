// `dstrain plan --device cpu`: the plan of this machine's CPU ranks (cli/cpu_plan_command.cpp).
#pragma once

#include <cstdint>
#include <ostream>

#include "core/dtype.h"
#include "model/config.h"

namespace dstrain {

struct CpuPlanRequest {
  int ranks = 1;  // --gpus: CPU ranks (threads)
  int tp = 1, pp = 1;
  int64_t seq_len = 64;
  int64_t global_batch_tokens = 1024;
  DType precision = DType::F32;
  bool fp8 = false;    // --precision fp8 (precision BF16)
  bool sample = true;  // the run's final sample (its gathered weights count)
};

// Prints the chosen plan (and the flags that run it), what it needs against what this process
// may allocate, and the largest micro-batch that fits each ZeRO stage and recompute mode.
int run_cpu_plan(const ModelConfig& config, const CpuPlanRequest& request, std::ostream& out);

}  // namespace dstrain
