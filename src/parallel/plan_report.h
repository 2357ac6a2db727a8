// A PlanResult for people (`dstrain plan`, and training's opening lines) and for tools
// (`dstrain plan --plan-json`).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "parallel/planner.h"
#include "topology/topology.h"

namespace dstrain {

// The chosen plan, its memory per GPU by category (with and without recompute), its step
// time and tokens/s with the parts that make them up, the alternatives with why each lost,
// and the shapes the rules exclude.
std::string format_plan_report(const ModelConfig& config, const NodeTopology& topology,
                               const PlanResult& result);

// {"model", "gpus", "dp", "tp", "pp", "zero", "offload", "offload_params", "recompute",
//  "micro_batch",
//  "grad_accum", "seq_len", "precision", "global_batch_tokens", "memory_bytes_per_gpu",
//  "memory_by_category", "host_memory_bytes", "usable_memory_bytes_per_gpu", "step_seconds",
//  "tokens_per_second", "step_breakdown", "alternatives": [{plan..., "fits",
//  "memory_bytes_per_gpu", "step_seconds", "why"}], "excluded": [...], "nnodes",
//  "gpus_per_node", and across nodes "inter_node": {"bytes_per_s", "kind", "source",
//  "tensor_parallel"}}, "ep_choice" and "offload_choice" where the plan has them;
//  "host_memory_bytes" is the fullest node's across nodes.
nlohmann::json plan_result_to_json(const ModelConfig& config, const PlanResult& result);

}  // namespace dstrain
