// A whole training run: it starts (train/run_start.h), plans, launches a RankTrainer per rank
// (data, forward, backward, clipping, AdamW, evaluation, logging, checkpoints), and ends with a
// short sample.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "train/options.h"

namespace dstrain {

struct TrainSummary {
  int64_t first_step = 0;          // 0, or the step resumed from
  int64_t steps = 0;               // the step count reached
  // The training loss of each step run here, up to options.test.summary_losses_kept (65,536)
  // of them: a bounded record, so that a run of millions of steps keeps a flat memory (the log
  // has every step's).
  std::vector<double> losses;
  std::optional<double> final_loss;  // the last step's
  std::optional<double> final_eval_loss;
  std::optional<double> entropy_floor;  // synthetic data only
  double tokens_per_second = 0.0;
  int64_t skipped_steps = 0;       // fp16 steps skipped for overflow
  int interrupted_by = 0;          // SIGINT or SIGTERM when a signal stopped the run early
  std::string checkpoint;          // the last checkpoint written, if any
};

// Runs a whole training run as the options say, printing progress to `out`.
// Throws UserError for a user's mistake (bad option, data, checkpoint).
TrainSummary train(const TrainOptions& options, std::ostream& out);

}  // namespace dstrain
