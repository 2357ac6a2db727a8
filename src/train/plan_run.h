// The plan a training run executes: one Plan object from here to every rank (no flags in
// between).
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "parallel/plan.h"
#include "topology/topology.h"
#include "train/options.h"

namespace dstrain {

// The machine a run plans for: described (--topology / --from-nvidia-smi), or the GPUs found
// here; none (CPU ranks without a description): the plan is what the flags say.
struct RunMachine {
  std::optional<NodeTopology> topology;
  bool described = false;  // --topology / --from-nvidia-smi: not this machine
  std::string report;      // the probe's account of what it found
};
// Probes this machine (unless --device cpu) or loads the described one. UserError for a bad
// description, or --device cuda without a GPU.
RunMachine find_run_machine(const TrainOptions& options);

// What a checkpoint remembers of the machine its plan was made for, and the same of this run
// before it is planned (`ranks`: the world's): {"device": "cpu"|"gpu", "ranks", "nnodes",
// "gpu", "gpu_memory"}. A resume on a machine whose record differs plans anew.
nlohmann::json machine_record(const RunMachine& machine, bool cpu_ranks, int ranks, int nnodes);

// With a machine to plan for (described with --topology / --from-nvidia-smi, or GPUs found on
// this one), the planner chooses what the user did not fix (ranks, pipeline, ZeRO stage,
// offload, recompute, micro-batch, accumulation, precision); parts this build cannot run yet
// (tensor parallelism) are refused with a sentence (UserError), or, when the planner chose
// them unasked, planned without. Without GPUs and without a description, the plan is what the
// flags say (plan_from_options). The chosen plan is printed. A Hugging Face model (a config.json or
// --init-from) without --seq-len trains at the model's context, or the longest power of two
// below it that fits, said on `out`.
// options.device comes out resolved: "cuda" when the plan runs on the GPUs found here (the
// CUDA backend built), "cpu" for simulated ranks (--device cpu, or nothing found). A described
// machine's plan runs only with --device cpu. With options.test.max_gpus > 0 (testing: ranks
// sharing GPUs) nothing is planned. `options` then remember the plan (remember_plan).
Plan plan_run(TrainOptions& options, const ModelConfig& config, const RunMachine& machine,
              std::ostream& out);
// The same for find_run_machine(options).
Plan plan_run(TrainOptions& options, const ModelConfig& config, std::ostream& out);

// The plan the flags describe: --gpus ranks (or --dp x --pp), ZeRO, offload, recompute,
// micro-batch, accumulation, precision, the pipeline's schedule and split (balanced when not
// given). UserError (one sentence) for what cannot run: --tp > 1, --pp not dividing --gpus, a
// bad split.
Plan plan_from_options(const TrainOptions& options, const ModelConfig& config);

// The plan as the run's settings (what a checkpoint remembers and a resume takes back).
void remember_plan(const Plan& plan, TrainOptions& options);

}  // namespace dstrain
