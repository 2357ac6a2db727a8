// One rank of a training run, phase by phase: setup (devices, groups, model state, the
// pipeline stage and its runner, data), then per step the schedule's micro-batches, the
// optimizer step, the log, evaluation and checkpoints, and at the end the summary and a sample.
//
// Under a plan with pp stages, rank r runs stage r / (tp * dp) of data-parallel index
// (r / tp) % dp as tp index r % tp (parallel/groups.h); the first and the last stage of each
// data-parallel index read the same micro-batches (the first needs the tokens, the last the
// targets; all of their tp ranks), the others none.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/trace.h"
#include "data/loader.h"
#include "model/architecture.h"
#include "model/moe_aux_loss.h"
#include "model/stage.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "parallel/groups.h"
#include "parallel/memory_model.h"
#include "parallel/pipeline_runner.h"
#include "parallel/sharded_model.h"
#include "train/devices.h"
#include "train/expert_load.h"
#include "train/run_context.h"
#include "train/replica_check.h"
#include "train/run_trace.h"

namespace dstrain {

class RankTrainer {
 public:
  RankTrainer(const RunContext& ctx, Communicator& world);
  void run();

 private:
  struct StepOutcome {
    double loss = 0, lr = 0, seconds = 0;
    StepStats stats;
    bool skipped = false;
    double loss_scale = 1;
    std::vector<double> bubble;  // per stage (pp > 1): the share of the step spent waiting
    // Per stage (tp > 1): its ranks' tensor-parallel collectives and their all-reduce volume
    // (the same on each of its ranks), and the share of the step in them (their mean).
    std::vector<double> tp_collectives, tp_bytes, tp_share;
    std::vector<LayerLoad> expert_load;  // MoE models: each MoE layer's, over every rank
    double aux_loss = -1;  // the load-balancing loss, the mean over micro-batches (< 0: none)
    TimeSplit time;    // where the step's time went, the mean over ranks
    double mfu = -1;   // model FLOPs utilization (< 0: unknown, on the CPU backend)
    double positions = 0;  // the step's token positions over every rank (step_positions)
  };

  // Setup.
  void make_token_buffers();
  void load_initial_state();
  MicroBatch load_micro_batch(DataLoader& loader, int micro_batch);
  // The run's first lines and records; memory: each rank's peak bytes by category.
  std::string epoch_line() const;
  // memory: each rank's peak bytes by category (device and host allocators together); device,
  // host: each allocator's, the largest over the ranks.
  void announce(const std::vector<std::array<size_t, kNumMemCategories>>& memory,
                const std::array<size_t, kNumMemCategories>& device,
                const std::array<size_t, kNumMemCategories>& host) const;
  // A step and what follows it.
  StepOutcome train_step(int64_t step);
  // The pipeline bubble and the tensor-parallel traffic of the step, per stage.
  void measure_parallelism(StepOutcome& o);
  // Selection biases (train/rank_trainer_balance.cpp): from the starting weights, and after a
  // step (--moe-router-bias-update-rate) each moved by its layer's load.
  void load_selection_biases();
  void update_selection_biases(const SummedExpertLoad& load);
  // The step's spans: its time split (the mean over ranks), and the trace window's file.
  void measure_time(int64_t step, double begin, StepOutcome& o);
  void write_trace(int64_t step, bool last);
  std::string trace_label() const;
  void report_step(int64_t step, const StepOutcome& outcome);
  int agree_to_stop() const;
  void check_replicas(int64_t step, bool last);
  double evaluate();
  std::vector<int32_t> sample_prompt() const;
  double step_trained_targets(std::optional<DataLoader>& loader, int64_t rounds) const;
  double mean_to_trained(double trained, int64_t rounds) const;
  double step_positions(std::optional<DataLoader>& loader, int64_t rounds) const;
  void save_checkpoint(int64_t step);
  std::string after_save(const std::string& written) const;  // the line it prints
  // The end.
  void finish(double train_seconds);
  void print_stage_summary(nlohmann::json& summary_record);
  void gather_full_weights_on_leader(const HostBlocks& gathered);
  void verify_tied_embedding();
  void sample(const HostBlocks& gathered, std::ostream& text) const;

  bool first_stage() const { return groups_.stage == 0; }
  bool last_stage() const { return groups_.stage == plan_.pp - 1; }
  // The first and last stage, and every stage with packed sequences (their positions).
  bool reads_data() const { return stage_reads_tokens(plan_, range_); }
  // The last stage's ranks of tp index 0 count the loss (every tp rank computes the same).
  bool counts_loss() const { return last_stage() && groups_.tensor_index == 0; }
  // The stage that holds block b (its state is written by that stage's ranks).
  int owner_stage(int block) const;

  const RunContext& ctx_;
  const TrainOptions& options_;
  const ModelConfig& config_;
  const Plan& plan_;
  Communicator& world_;
  const int rank_;
  const int64_t B_, T_, accum_;
  const int threads_;
  RankDevices devices_;
  std::unique_ptr<EventTimer> timer_;  // a GPU's spans are timed with its events
  Tracer tracer_;
  ParamLayout full_layout_;  // the whole model's (tp = 1): checkpoints, the gathered weights
  std::vector<std::unique_ptr<Communicator>> traced_groups_;  // groups_' communicators, traced
  RankGroups groups_;
  TensorParallelStats tp_stats_;  // this step's, reset by train_step
  ExpertLoad expert_load_;        // this step's routing (MoE models), reset by train_step
  // A router with a selection bias (DeepSeek-V3): each MoE layer's, as every rank keeps it (the
  // fp32 master weights' values), by layer; what the routing reads under 16-bit parameters and
  // what --moe-router-bias-update-rate moves.
  SelectionBiases selection_biases_;
  // Each of selection_biases_' parameter in arch_'s layout, in the same order.
  std::vector<const ParamSpec*> selection_bias_specs_;
  std::unique_ptr<MoeAuxLoss> aux_loss_;  // the load-balancing loss, where the config asks
  std::unique_ptr<Architecture> arch_;
  StageRange range_;
  std::vector<int64_t> split_;
  std::unique_ptr<ShardedModel> state_;
  std::unique_ptr<ModelStage> stage_;
  std::unique_ptr<PipelineRunner> runner_;
  StageActions schedule_;  // this stage's actions of one step
  // Token batches: one per activation slot (inputs then targets, (B, T) I32 each), in device
  // memory, and their host copies the loader writes on a GPU.
  std::vector<Buffer> token_buffers_, host_token_buffers_;
  std::optional<DataLoader> loader_, val_loader_;
  GradScaler scaler_;
  AdamWConfig adam_;
  int64_t adam_step_ = 0;
  PipelineTimes run_times_;  // over the whole run
  TimeSplit run_split_;      // sums over the steps run of the mean over ranks
  bool trace_written_ = false;
  std::optional<ReplicaChecker> replicas_;  // --check-replicas
  int64_t step_ = 0;         // the step in progress (0-based)
  double positions_run_ = 0;  // the token positions of the steps reported (tokens/s)
  // This rank's: the step count reached, and the signal that stopped the run (0: none). The
  // process's TrainSummary (ctx_.summary), which its ranks (threads) share, takes them from its
  // first rank only, the rest of it from rank 0.
  int64_t steps_reached_ = 0;
  int interrupted_by_ = 0;
  bool training_ = false;    // in a training step's pipeline (not evaluating)
};

}  // namespace dstrain
