// Pipeline schedules as data: for every stage, the list of actions of one optimizer step
// (F m, B m, SEND_F m, RECV_F m, SEND_B m, RECV_B m), made by a function and executed by one
// runner (parallel/pipeline_runner.h), as torch.distributed.pipelining's schedules.py does. A
// new schedule is a new table, not a new loop.
//
// Stage s receives activations from s - 1 and gradients from s + 1 and sends the other way;
// the first stage receives no activation and sends no gradient, the last stage sends no
// activation and receives no gradient (its forward computes the loss and its backward starts
// from it).
//
// What the runner makes of a list (and check_pipeline_schedule models): a run of consecutive
// communication actions is one exchange (every send posted, every receive taken, done when all
// are: Communicator::exchange); a send completes only when the peer takes it (no buffering);
// messages between two stages in one direction match in order; F and B run alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain {

enum class PipelineScheduleKind : uint8_t { OneFOneB, GPipe };
const char* pipeline_schedule_name(PipelineScheduleKind kind);  // "1f1b", "gpipe"
// UserError naming --pp-schedule and the choices for anything else.
PipelineScheduleKind parse_pipeline_schedule(const std::string& name);

enum class ActionKind : uint8_t {
  Forward, Backward, SendActivation, RecvActivation, SendGradient, RecvGradient
};
struct PipelineAction {
  ActionKind kind = ActionKind::Forward;
  int micro_batch = 0;
  bool operator==(const PipelineAction&) const = default;
};
bool is_communication(ActionKind kind);
std::string to_string(const PipelineAction& action);  // "F3", "B3", "SEND_F3", "RECV_B3", ...
using StageActions = std::vector<PipelineAction>;
std::string to_string(const StageActions& actions);  // space separated

// Every stage's actions (index = stage) of one step of `micro_batches` micro-batches.
//   1F1B (Megatron-LM's non-interleaved schedule): warmup = min(stages - stage - 1, m)
//     forwards; then forward / backward in turn, each forward's send together with the receive
//     of the gradient the following backward needs, each backward's send together with the
//     receive of the next forward's input; then the remaining backwards. Stage s keeps at most
//     min(stages - s, m) micro-batches in flight.
//   GPipe: every forward in order, then every backward in order; m in flight everywhere.
// REQUIRES: stages >= 1, micro_batches >= 1.
std::vector<StageActions> make_pipeline_schedule(PipelineScheduleKind kind, int stages,
                                                 int micro_batches);
// Evaluation: forwards only (RECV_F m, F m, SEND_F m in micro-batch order).
std::vector<StageActions> make_forward_schedule(int stages, int micro_batches);

// The most micro-batches stage `stage` holds at once (forwarded, not yet backwarded): 1F1B
// min(stages - stage, m), GPipe m. A closed form: the memory model asks for thousands of plans.
int activation_slots(PipelineScheduleKind kind, int stages, int stage, int micro_batches);
// The same counted from a list (a forward-only list: 1).
int max_in_flight(const StageActions& actions);

// Throws dstrain::Error when the lists break a data dependency: each micro-batch forwarded and
// (with_backward) backwarded exactly once per stage, F m after RECV_F m, SEND_F m after F m,
// B m after F m and RECV_B m, SEND_B m after B m, no backward actions without with_backward;
// and the k-th send between two stages in one direction lands in the k-th matching receive
// (in-order matching), which must name the same micro-batch. Then runs the lists under the
// semantics above and throws when they cannot run to completion, naming each stuck stage, the
// action it is stuck at and where its peer stands ("stage 0 at SEND_F2 (stage 1 is at
// SEND_B0)").
// REQUIRES: stages non-empty, micro_batches >= 1.
void check_pipeline_schedule(const std::vector<StageActions>& stages, int micro_batches,
                             bool with_backward = true);

}  // namespace dstrain
