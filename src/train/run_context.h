// What every rank of a training run shares, read-only, plus the outputs only rank 0 writes
// (the log, the progress lines, the summary). Made by train() (train/trainer.cpp) and read by
// each rank's RankTrainer (train/rank_trainer.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>

#include <nlohmann/json.hpp>

#include "data/bpe_tokenizer.h"
#include "model/config.h"
#include "optim/schedule.h"
#include "parallel/plan.h"
#include "train/checkpoint.h"
#include "train/datasets.h"
#include "train/devices.h"
#include "train/jsonl_log.h"
#include "train/options.h"
#include "train/progress.h"
#include "train/run_trace.h"
#include "train/trainer.h"

namespace dstrain {

class Cluster;

struct RunContext {
  TrainOptions options;
  ModelConfig config;
  Plan plan;            // what every rank executes (train/plan_run.h)
  LrScheduleConfig schedule;
  RunDevices devices;   // the backend, memory and communicator of this process's ranks
  const Cluster* cluster = nullptr;  // the nodes (train/cluster.h)
  Datasets* data = nullptr;
  const FullTrainingState* initial = nullptr;  // the starting weights (and moments on resume)
  bool have_moments = false;
  int64_t first_step = 0;
  int64_t first_adam_step = 0;  // optimizer steps applied before (skips excluded)
  nlohmann::json scaler_state;  // on resume, else null
  nlohmann::json data_state;    // loader position on resume, else null
  nlohmann::json fingerprint;
  nlohmann::json machine;       // what the plan was made for (plan_run.h's machine_record)
  CheckpointFormat checkpoint_format;  // the weights' dtype, shards and the files beside them
  int64_t steps_per_epoch = 0;  // whole steps the training data holds
  std::optional<CheckpointInfo> resume;
  bool resume_asked = false;  // --resume was given (it may have found no checkpoint yet)
  std::shared_ptr<const BpeTokenizer> tokenizer;  // --tokenizer: decodes the final sample
  JsonlLog* log = nullptr;
  ProgressPrinter* progress = nullptr;
  TrainSummary* summary = nullptr;
  std::ostream* out = nullptr;
  // The checkpoint being written: made by rank 0, filled by every rank (between barriers).
  std::unique_ptr<CheckpointWriter>* checkpoint = nullptr;
  // --trace: the ranks' spans of the window (nullptr: no trace file).
  TraceCollector* trace = nullptr;
  std::chrono::steady_clock::time_point origin;  // when the run began: time 0 of the trace
  double peak_flops = 0;  // one GPU's dense peak at the plan's precision; 0: unknown (no MFU)
};

// SIGINT / SIGTERM seen by this process (0: none); set by train()'s handlers.
int stop_signal();

// One rank of the run: from its communicator of the world to the end of training. Throws what
// the run throws (the launcher rethrows the first failure).
void run_rank(const RunContext& ctx, Communicator& world);

}  // namespace dstrain
