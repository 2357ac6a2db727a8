// How a pipeline cuts the model: layers per stage (the split), and what each stage holds.
//
// The planner's split balances the stages' work: each stage's forward FLOPs per token
// (parallel/model_flops.h) are its layers' (each its own where they differ: a dense layer among
// mixture-of-experts layers) plus the embedding's on the first stage and the LM
// head's on the last (2 C Vp: at GPT-2's vocabulary about 4.5 layers of gpt2-124m, one layer
// of 6b), and the split is the contiguous one whose slowest stage is fastest (then the most
// even; then the one with the fewest layers early, where 1F1B keeps the most micro-batches in
// flight). `--pp-split 7,7,7,7` gives a split of one's own. The same split serves the memory
// model, the cost model and the trainer: what is planned is what runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"
#include "model/stage.h"
#include "parallel/plan.h"

namespace dstrain {

// REQUIRES: 1 <= pp <= n_layer, seq_len >= 1.
std::vector<int64_t> balanced_pipeline_split(const ModelConfig& config, int pp, int64_t seq_len);

// UserError (one sentence naming the numbers) unless `split` has pp entries, each at least 1,
// adding up to the model's layers.
void check_pipeline_split(const ModelConfig& config, int pp, const std::vector<int64_t>& split);

// "7,7,7,7" and back; parse throws UserError naming --pp-split on anything else.
std::string pipeline_split_text(const std::vector<int64_t>& split);
std::vector<int64_t> parse_pipeline_split(const std::string& text);

// plan.pp_split, or the balanced split when it is empty (pp = 1: every layer).
std::vector<int64_t> pipeline_split(const ModelConfig& config, const Plan& plan);
// The layers of stage `stage` of the plan, and whether it is the first / last.
StageRange pipeline_stage(const ModelConfig& config, const Plan& plan, int stage);
StageRange stage_of_split(const std::vector<int64_t>& split, int stage);

// The parameter blocks a stage holds, in order: the embedding block on the first stage (and a
// copy on the last, for a tied LM head), its layers' blocks, the final block (the final norm,
// and an untied LM head) on the last stage.
std::vector<int> pipeline_stage_blocks(const ParamLayout& layout, const StageRange& range);

}  // namespace dstrain
