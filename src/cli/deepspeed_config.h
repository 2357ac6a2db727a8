// `--deepspeed-config ds_config.json`: what DeepSpeed users bring, mapped onto dstrain's flags
// as DeepSpeed reads it (its defaults for what a section leaves out, its schedulers step for
// step, "auto" dropped inside its sections and filled from dstrain's flags elsewhere, as the
// Hugging Face Trainer fills it from its arguments). Each key either becomes a flag (printed as
// "zero_optimization.stage 3 -> --zero 3"), is named as having no effect in dstrain (tuning
// knobs of DeepSpeed's own machinery: bucket sizes, overlap_comm, ...), or is refused in one
// sentence naming it when dstrain cannot do what it asks (NVMe offload, a static loss scale,
// another optimizer or scheduler). offload_optimizer and offload_param to the CPU become one
// --offload (optimizer, params or all).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/options.h"

namespace dstrain {

struct DeepSpeedMapping {
  nlohmann::json flags = nlohmann::json::object();  // flag name -> value, as --config's JSON
  std::vector<std::string> lines;                   // what became of each key, for the user
  std::optional<int64_t> train_batch_size;          // sequences per step over all ranks
};

// Reads and maps `path`. Throws UserError naming the file and the key.
DeepSpeedMapping map_deepspeed_config(const std::string& path);

// DeepSpeed's rule, train_batch_size = micro-batch x accumulation x data-parallel ranks, on the
// merged options (`given`: the flags set by the command line or the files): with the ranks
// known (--gpus given), fills in a missing micro-batch or accumulation or checks the three;
// else the planner gets it as --global-batch-tokens. UserError naming the numbers otherwise.
void apply_train_batch_size(const DeepSpeedMapping& mapping, const std::set<std::string>& given,
                            TrainOptions& options);

}  // namespace dstrain
