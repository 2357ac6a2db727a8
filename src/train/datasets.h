// The data of a run: token files (train and validation), or the synthetic corpus.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "data/loader.h"
#include "model/config.h"
#include "train/options.h"

namespace dstrain {

struct Datasets {
  TokenDataset train;
  TokenDataset val;
  std::optional<double> entropy_floor;          // synthetic data: the best possible loss
  std::optional<double> entropy_previous_only;  // ... of a model seeing one token back
  bool synthetic = false;
  std::string description;                      // one line for the run's header
};

// --data / --val-data, or (neither) the synthetic corpus. B, T, world: the batch geometry the
// held-out split must leave room for.
Datasets open_datasets(const TrainOptions& options, const ModelConfig& config, int64_t B,
                       int64_t T, int world);

}  // namespace dstrain
