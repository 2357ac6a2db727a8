// The planner's part of a training run.
#pragma once

#include <ostream>

#include "model/config.h"
#include "train/options.h"

namespace dstrain {

// With a machine to plan for (described with --topology / --from-nvidia-smi, or GPUs found on
// this one), the planner chooses what the user did not fix (ranks, ZeRO stage, offload,
// recompute, micro-batch, accumulation, precision) and `options` take it; parts this build
// cannot run yet are refused with a sentence (UserError). Without GPUs and without a
// description, the CPU backend runs what the flags say and `options` stay as they are.
// options.device comes out resolved: "cuda" when the plan runs on the GPUs found here (the
// CUDA backend built), "cpu" for simulated ranks (--device cpu, or nothing found). A described
// machine's plan runs only with --device cpu.
// With options.max_gpus > 0 (testing: ranks sharing GPUs) nothing is planned.
void plan_run(TrainOptions& options, const ModelConfig& config, std::ostream& out);

}  // namespace dstrain
