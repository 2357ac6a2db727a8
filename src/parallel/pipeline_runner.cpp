#include "parallel/pipeline_runner.h"

#include <chrono>
#include <sstream>

#include "core/check.h"

namespace dstrain {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

const char* action_words(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "forward";
    case ActionKind::Backward: return "backward";
    case ActionKind::SendActivation: return "sending the activation";
    case ActionKind::RecvActivation: return "receiving the activation";
    case ActionKind::SendGradient: return "sending the gradient";
    case ActionKind::RecvGradient: return "receiving the gradient";
  }
  return "?";
}

}  // namespace

size_t last_micro_batch_position(const StageActions& actions, int micro_batches) {
  size_t position = actions.size();
  for (size_t i = actions.size(); i-- > 0;) {
    if (is_communication(actions[i].kind)) continue;
    if (actions[i].micro_batch != micro_batches - 1) break;
    position = i;
  }
  return position;
}

PipelineRunner::PipelineRunner(ModelStage& stage_model, ParamProvider& params, Communicator* pipe,
                               int stage, int stages, int global_rank, Backend& backend,
                               Stream compute)
    : stage_model_(stage_model),
      params_(params),
      pipe_(pipe),
      stage_(stage),
      stages_(stages),
      global_rank_(global_rank),
      backend_(backend),
      compute_(compute),
      comm_stream_(backend),
      computed_(backend),
      exchanged_(backend),
      slot_owner_(static_cast<size_t>(stage_model.slots()), -1),
      batches_(static_cast<size_t>(stage_model.slots())) {
  DSTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages) << "stage " << stage << " of " << stages;
  DSTRAIN_CHECK((pipe == nullptr) == (stages == 1) && (pipe == nullptr || pipe->size() == stages))
      << "the pipeline group must have one rank per stage";
  DSTRAIN_CHECK(stage_model.range().first == (stage == 0) &&
                stage_model.range().last == (stage + 1 == stages))
      << "stage " << stage << " of " << stages << " runs the wrong part of the model";
}

std::string PipelineRunner::where(const PipelineAction& action) const {
  std::ostringstream text;
  text << "pipeline stage " << stage_ << " (rank " << global_rank_ << "), "
       << action_words(action.kind) << " of micro-batch " << action.micro_batch;
  return text.str();
}

void PipelineRunner::annotate(const std::string& what) {
  if (pipe_ != nullptr) pipe_->annotate(what);
}

void PipelineRunner::compute(const PipelineAction& action, const MicroBatchSource& source,
                             float dloss, double& loss) {
  const int m = action.micro_batch, slot = slot_of(m);
  int& owner = slot_owner_[static_cast<size_t>(slot)];
  if (action.kind == ActionKind::Forward) {
    DSTRAIN_CHECK(owner < 0) << "slot " << slot << " still holds micro-batch " << owner
                             << ": the schedule keeps more micro-batches in flight than the "
                             << stage_model_.slots() << " slots";
    const MicroBatch& batch = batch_of(m, source);
    if (aux_ != nullptr) aux_->begin_forward(m);
    const StageRange& range = stage_model_.range();
    const auto [b, t] = shape_of(batch);
    const double mean =
        stage_model_.forward(params_, slot, b, t, range.first ? batch.inputs : Tensor(),
                             range.last ? batch.targets : Tensor(), batch.positions,
                             range.last ? dloss : 0.0f, compute_);
    // (b * t) / (b_ * t_) is exactly 1 for the run's shape: the sum is the plain one then.
    loss += mean * (static_cast<double>(b * t) / static_cast<double>(b_ * t_));
    // Evaluation (dloss 0) keeps nothing for a backward: the slot is free again.
    owner = dloss != 0.0f ? m : -1;
    return;
  }
  DSTRAIN_CHECK(owner == m) << "backward of micro-batch " << m << " but slot " << slot
                            << " holds " << owner;
  const MicroBatch& batch = batches_[static_cast<size_t>(slot)];
  if (aux_ != nullptr) aux_->begin_backward(m);
  stage_model_.backward(params_, slot, stage_model_.range().first ? batch.inputs : Tensor(),
                        compute_);
  owner = -1;
}

MicroBatch& PipelineRunner::batch_of(int m, const MicroBatchSource& source) {
  const size_t slot = static_cast<size_t>(slot_of(m));
  if (batch_taken_[slot] != m) {
    batches_[slot] = source ? source(m) : MicroBatch{};
    batch_taken_[slot] = m;
  }
  return batches_[slot];
}

void PipelineRunner::exchange(const StageActions& actions, size_t begin, size_t end,
                              const MicroBatchSource& source) {
  std::vector<P2POp> ops;
  for (size_t i = begin; i < end; ++i) {
    const PipelineAction& a = actions[i];
    const int slot = slot_of(a.micro_batch);
    const auto [b, t] = shape_of(batch_of(a.micro_batch, source));
    switch (a.kind) {
      case ActionKind::SendActivation:
        ops.push_back({P2POp::Kind::Send, stage_model_.output(b, t), stage_ + 1});
        break;
      case ActionKind::RecvActivation:
        ops.push_back({P2POp::Kind::Recv, stage_model_.input(slot, b, t), stage_ - 1});
        break;
      case ActionKind::SendGradient:
        ops.push_back({P2POp::Kind::Send, stage_model_.input_grad(b, t), stage_ - 1});
        break;
      case ActionKind::RecvGradient:
        ops.push_back({P2POp::Kind::Recv, stage_model_.output_grad(b, t), stage_ + 1});
        break;
      default: DSTRAIN_CHECK(false) << to_string(a) << " is not a communication";
    }
    if (aux_ != nullptr && aux_->travels()) {  // the loss's statistics, beside the tensor
      const bool forward =
          a.kind == ActionKind::SendActivation || a.kind == ActionKind::RecvActivation;
      const P2POp& op = ops.back();
      ops.push_back({op.kind,
                     forward ? aux_->forward_message(a.micro_batch)
                             : aux_->backward_message(a.micro_batch),
                     op.peer});
    }
  }
  DSTRAIN_CHECK(pipe_ != nullptr) << "a pipeline exchange with one stage";
  // Compute has produced what is sent and finished reading what is received into. The
  // synchronize is for the time split (compute vs waiting; the send needs that work anyway);
  // the event is what orders the communication stream, whether or not the host waited.
  backend_.synchronize(compute_);
  backend_.record_event(computed_.get(), compute_);
  backend_.wait_event(comm_stream_.get(), computed_.get());
  pipe_->exchange(ops, comm_stream_.get());
  backend_.record_event(exchanged_.get(), comm_stream_.get());
  backend_.wait_event(compute_, exchanged_.get());
}

double PipelineRunner::run(const StageActions& actions, int micro_batches, int64_t b, int64_t t,
                           const MicroBatchSource& source, float dloss,
                           const std::function<void()>& before_last) {
  b_ = b;
  t_ = t;
  batch_taken_.assign(batches_.size(), -1);
  const size_t last_position = before_last ? last_micro_batch_position(actions, micro_batches)
                                           : actions.size();
  double loss = 0.0;
  for (size_t i = 0; i < actions.size();) {
    const PipelineAction& action = actions[i];
    try {
      if (is_communication(action.kind)) {
        size_t end = i;
        while (end < actions.size() && is_communication(actions[end].kind)) ++end;
        annotate("");
        const auto start = Clock::now();
        exchange(actions, i, end, source);
        times_.wait_seconds += seconds_since(start);
        i = end;
        continue;
      }
      if (i == last_position) before_last();
      annotate(where(action));  // what a neighbour that times out waiting for us reports
      if (before_) before_(action);
      const auto start = Clock::now();
      compute(action, source, dloss, loss);
      // With several stages, the compute time is measured (the next exchange waits for it
      // anyway); one stage lets the host run ahead.
      if (stages_ > 1) backend_.synchronize(compute_);
      times_.compute_seconds += seconds_since(start);
    } catch (const UserError& error) {
      annotate("");
      throw UserError(where(action) + ": " + error.what());
    } catch (const PeerClosedError& error) {  // a follow-on: keeps its type (communicator.h)
      annotate("");
      throw PeerClosedError(where(action) + ": " + error.what());
    } catch (const Error& error) {
      annotate("");
      throw Error(where(action) + ": " + error.what());
    }
    ++i;
  }
  annotate("");
  return loss;
}

}  // namespace dstrain
