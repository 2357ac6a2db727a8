// PipelineRunner: executes one stage's list of pipeline actions (parallel/pipeline_schedule.h)
// on a ModelStage, the one runner every schedule shares (torch.distributed.pipelining's
// runtime, Megatron's schedules without a loop per schedule).
//
//   F m      forward of micro-batch m in slot m % slots (tokens and targets from the source
//            on the first and last stage)
//   B m      backward of micro-batch m
//   SEND_F m / RECV_F m   the output of forward m to the next stage / the input of m from the
//            previous one, straight into m's slot
//   SEND_B m / RECV_B m   the input gradient of m to the previous stage / the output gradient
//            of m from the next one
//
// A run of consecutive communication actions is one exchange (Communicator::exchange: every
// send posted, every receive taken, done when all are), as Megatron's send_forward_recv_backward
// does: two neighbours that send to each other at the same time cannot deadlock. Exchanges run
// on a communication stream ordered against compute with events; with the communicators of
// this project they return once the data has landed (as Megatron's p2p waits), so compute
// queued before an exchange runs while it waits.
//
// Time: the runner measures the seconds it spends computing and waiting in exchanges (the
// compute stream is synchronized before each exchange, which costs nothing: the send needs
// that work anyway). The waits are the pipeline bubble this stage sees.
//
// The load-balancing loss (model/moe_aux_loss.h), where set: told each compute action's
// micro-batch before it runs, and its statistics sent beside each activation and gradient.
//
// Errors: an action that throws is reported as "pipeline stage S (rank R), forward of
// micro-batch m: ..." (UserError stays UserError); the communicators release the other ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/moe_aux_loss.h"
#include "model/param_provider.h"
#include "model/stage.h"
#include "parallel/pipeline_schedule.h"

namespace dstrain {

// Where the runner gets each micro-batch's tokens: (b, t) I32 tensors in the stage's device
// memory, inputs on the first stage, targets on the last (the other may be empty). The runner
// asks once per micro-batch, at its forward; the tensors must stay valid until the
// micro-batch's backward is done: a source keeps one token buffer per activation slot
// (micro-batch m in slot m % slots, ModelStage::slots()).
struct MicroBatch {
  Tensor inputs, targets;
  Tensor positions = {};  // (b, t) of packed sequences, for every stage; empty: none
  // Its own shape (--batch-tokens; every stage's source gives it), b * t <= the run's b * t;
  // 0: the run's (b, t).
  int64_t b = 0, t = 0;
};
using MicroBatchSource = std::function<MicroBatch(int micro_batch)>;

struct PipelineTimes {
  double compute_seconds = 0;  // in forward and backward actions
  double wait_seconds = 0;     // in exchanges: waiting for the neighbours, and the transfers
  PipelineTimes& operator+=(const PipelineTimes& other) {
    compute_seconds += other.compute_seconds;
    wait_seconds += other.wait_seconds;
    return *this;
  }
};

class PipelineRunner {
 public:
  // The stream of this object's transfers (nullptr on the CPU backend), for traces.
  Stream comm_stream() const { return comm_stream_.get(); }
  // pipe: the stage-to-stage group (group rank = stage), nullptr with one stage. global_rank:
  // for messages. `stage_model`, `params` and `pipe` outlive the runner.
  PipelineRunner(ModelStage& stage_model, ParamProvider& params, Communicator* pipe, int stage,
                 int stages, int global_rank, Backend& backend, Stream compute);

  // Called before a compute action runs (testing: failure injection).
  void set_before_action(std::function<void(const PipelineAction&)> hook) { before_ = std::move(hook); }
  // The load-balancing loss the stage's MoE layers add to (outlives the runner; nullptr: none).
  void set_aux_loss(MoeAuxLoss* aux) { aux_ = aux; }

  // Runs `actions` of `micro_batches` micro-batches of (b, t) (or each its own shape, which its
  // source says). A micro-batch is taken from `source` at its first action (its activation's
  // receive or its forward). dloss: the last stage's loss gradient per token (0: forward only,
  // for evaluation). before_last: called once, before the last micro-batch's work that adds
  // gradients begins (ShardedModel::last_micro_batch; empty: not called). Returns the sum of
  // the last stage's per-micro-batch mean losses, each weighted by its positions over b * t
  // (exactly 1 for the run's shape; 0 on other stages).
  double run(const StageActions& actions, int micro_batches, int64_t b, int64_t t,
             const MicroBatchSource& source, float dloss,
             const std::function<void()>& before_last = nullptr);

  const PipelineTimes& times() const { return times_; }
  void reset_times() { times_ = PipelineTimes{}; }

 private:
  int slot_of(int micro_batch) const { return micro_batch % stage_model_.slots(); }
  void compute(const PipelineAction& action, const MicroBatchSource& source, float dloss,
               double& loss);
  void exchange(const StageActions& actions, size_t begin, size_t end,
                const MicroBatchSource& source);
  // Micro-batch m in its slot, taken from `source` at its first use in this run.
  MicroBatch& batch_of(int m, const MicroBatchSource& source);
  std::pair<int64_t, int64_t> shape_of(const MicroBatch& batch) const {
    return {batch.b > 0 ? batch.b : b_, batch.t > 0 ? batch.t : t_};
  }
  std::string where(const PipelineAction& action) const;
  void annotate(const std::string& what);

  ModelStage& stage_model_;
  ParamProvider& params_;
  Communicator* pipe_;
  int stage_, stages_, global_rank_;
  Backend& backend_;
  Stream compute_;
  OwnedStream comm_stream_;
  OwnedEvent computed_, exchanged_;
  int64_t b_ = 0, t_ = 0;
  std::vector<int> slot_owner_;      // micro-batch in each slot (-1: free)
  std::vector<MicroBatch> batches_;  // per slot: the tokens of its forward, for the backward
  std::vector<int> batch_taken_;     // per slot: the micro-batch batches_ holds (-1: none yet)
  PipelineTimes times_;
  std::function<void(const PipelineAction&)> before_;
  MoeAuxLoss* aux_ = nullptr;
};

// Where `before_last` goes in a stage's list: the index of the first compute action of the
// longest tail of compute actions that all belong to the last micro-batch (communication
// actions in between do not count).
size_t last_micro_batch_position(const StageActions& actions, int micro_batches);

}  // namespace dstrain
