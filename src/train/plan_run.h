// The plan a training run executes: one Plan object from here to every rank (no flags in
// between).
#pragma once

#include <ostream>

#include "model/config.h"
#include "parallel/plan.h"
#include "train/options.h"

namespace dstrain {

// With a machine to plan for (described with --topology / --from-nvidia-smi, or GPUs found on
// this one), the planner chooses what the user did not fix (ranks, pipeline, ZeRO stage,
// offload, recompute, micro-batch, accumulation, precision); parts this build cannot run yet
// (tensor parallelism) are refused with a sentence (UserError), or, when the planner chose
// them unasked, planned without. Without GPUs and without a description, the plan is what the
// flags say (plan_from_options). The chosen plan is printed.
// options.device comes out resolved: "cuda" when the plan runs on the GPUs found here (the
// CUDA backend built), "cpu" for simulated ranks (--device cpu, or nothing found). A described
// machine's plan runs only with --device cpu. With options.max_gpus > 0 (testing: ranks
// sharing GPUs) nothing is planned. `options` then remember the plan (remember_plan).
Plan plan_run(TrainOptions& options, const ModelConfig& config, std::ostream& out);

// The plan the flags describe: --gpus ranks (or --dp x --pp), ZeRO, offload, recompute,
// micro-batch, accumulation, precision, the pipeline's schedule and split (balanced when not
// given). UserError (one sentence) for what cannot run: --tp > 1, --pp not dividing --gpus, a
// bad split.
Plan plan_from_options(const TrainOptions& options, const ModelConfig& config);

// The plan as the run's settings (what a checkpoint remembers and a resume takes back).
void remember_plan(const Plan& plan, TrainOptions& options);

}  // namespace dstrain
