// Checkpoints: OUT/step-NNNNNN/ holds model.safetensors (fp32, Hugging Face GPT-2 names and
// layouts), config.json, optimizer.safetensors (Adam moments, "<name>.exp_avg" and
// "<name>.exp_avg_sq") and trainer.json (step, seed, data position, hyper-parameters).
// Each directory appears whole or not at all (filled under a temp name, fsynced, renamed);
// OUT/latest names the newest one and is replaced atomically after it.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/layout.h"
#include "train/weights_io.h"

namespace dstrain {

// The full training state a checkpoint holds (gathered from the ranks).
struct FullTrainingState {
  explicit FullTrainingState(const ParamLayout& layout)
      : params(layout), exp_avg(layout), exp_avg_sq(layout) {}
  HostBlocks params, exp_avg, exp_avg_sq;
};

// Writes OUT/step-<step>/ and then OUT/latest. Returns the checkpoint directory.
std::string save_checkpoint(const std::string& out_dir, int64_t step, const ModelConfig& config,
                            const FullTrainingState& state, const nlohmann::json& trainer_state);

struct CheckpointInfo {
  std::string dir;              // the step directory
  ModelConfig config;           // from its config.json
  nlohmann::json trainer_state; // its trainer.json
};

// `path` is a run directory (its `latest` is followed) or a step directory. Validates that the
// four files are there and that trainer.json and config.json parse; throws UserError with one
// sentence otherwise (e.g. a half-written directory).
CheckpointInfo open_checkpoint(const std::string& path);

// Loads the weights and optimizer state of `info` into `state`.
void load_checkpoint(const CheckpointInfo& info, const FullTrainingState& state);

std::string step_dir_name(int64_t step);  // "step-000100"

}  // namespace dstrain
