#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "core/check.h"

namespace dstrain {

const char* pipeline_schedule_name(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::GPipe ? "gpipe" : "1f1b";
}

PipelineScheduleKind parse_pipeline_schedule(const std::string& name) {
  if (name == "1f1b") return PipelineScheduleKind::OneFOneB;
  if (name == "gpipe") return PipelineScheduleKind::GPipe;
  DSTRAIN_USER_ERROR() << "--pp-schedule " << name << " is not a schedule: use 1f1b or gpipe";
  return PipelineScheduleKind::OneFOneB;
}

bool is_communication(ActionKind kind) {
  return kind != ActionKind::Forward && kind != ActionKind::Backward;
}

std::string to_string(const PipelineAction& action) {
  static const char* const names[] = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
  return names[static_cast<int>(action.kind)] + std::to_string(action.micro_batch);
}

std::string to_string(const StageActions& actions) {
  std::string text;
  for (const PipelineAction& a : actions) text += (text.empty() ? "" : " ") + to_string(a);
  return text;
}

namespace {

// Appends actions, dropping the communication a first or last stage does not have.
struct StageWriter {
  StageActions& actions;
  bool first, last;
  void add(ActionKind kind, int m) {
    if (first && (kind == ActionKind::RecvActivation || kind == ActionKind::SendGradient)) return;
    if (last && (kind == ActionKind::SendActivation || kind == ActionKind::RecvGradient)) return;
    actions.push_back({kind, m});
  }
  void forward(int m) {  // RECV_F m, F m, SEND_F m
    add(ActionKind::RecvActivation, m);
    add(ActionKind::Forward, m);
    add(ActionKind::SendActivation, m);
  }
  void backward(int m) {  // RECV_B m, B m, SEND_B m
    add(ActionKind::RecvGradient, m);
    add(ActionKind::Backward, m);
    add(ActionKind::SendGradient, m);
  }
};

StageActions one_f_one_b(int stages, int stage, int m) {
  StageActions actions;
  StageWriter w{actions, stage == 0, stage == stages - 1};
  const int warmup = std::min(stages - stage - 1, m);
  for (int i = 0; i < warmup; ++i) w.forward(i);
  if (warmup < m) w.add(ActionKind::RecvActivation, warmup);
  for (int i = 0; i < m - warmup; ++i) {
    const int f = warmup + i;  // this iteration's forward; its backward is micro-batch i
    w.add(ActionKind::Forward, f);
    w.add(ActionKind::SendActivation, f);
    w.add(ActionKind::RecvGradient, i);
    w.add(ActionKind::Backward, i);
    w.add(ActionKind::SendGradient, i);
    if (f + 1 < m) w.add(ActionKind::RecvActivation, f + 1);
  }
  for (int i = m - warmup; i < m; ++i) w.backward(i);
  return actions;
}

StageActions gpipe(int stages, int stage, int m) {
  StageActions actions;
  StageWriter w{actions, stage == 0, stage == stages - 1};
  for (int i = 0; i < m; ++i) w.forward(i);
  for (int i = 0; i < m; ++i) w.backward(i);
  return actions;
}

}  // namespace

std::vector<StageActions> make_pipeline_schedule(PipelineScheduleKind kind, int stages,
                                                 int micro_batches) {
  DSTRAIN_CHECK(stages >= 1 && micro_batches >= 1) << stages << " stages, " << micro_batches
                                                   << " micro-batches";
  std::vector<StageActions> all;
  for (int s = 0; s < stages; ++s) {
    all.push_back(kind == PipelineScheduleKind::GPipe ? gpipe(stages, s, micro_batches)
                                                      : one_f_one_b(stages, s, micro_batches));
  }
  return all;
}

std::vector<StageActions> make_forward_schedule(int stages, int micro_batches) {
  DSTRAIN_CHECK(stages >= 1 && micro_batches >= 1) << stages << " stages, " << micro_batches
                                                   << " micro-batches";
  std::vector<StageActions> all(static_cast<size_t>(stages));
  for (int s = 0; s < stages; ++s) {
    StageWriter w{all[static_cast<size_t>(s)], s == 0, s == stages - 1};
    for (int i = 0; i < micro_batches; ++i) w.forward(i);
  }
  return all;
}

int activation_slots(PipelineScheduleKind kind, int stages, int stage, int micro_batches) {
  DSTRAIN_CHECK(stage >= 0 && stage < stages && micro_batches >= 1);
  if (kind == PipelineScheduleKind::GPipe) return micro_batches;
  return std::min(stages - stage, micro_batches);
}

int max_in_flight(const StageActions& actions) {
  int in_flight = 0, most = 0;
  bool any_backward = false;
  for (const PipelineAction& a : actions) {
    if (a.kind == ActionKind::Forward) most = std::max(most, ++in_flight);
    if (a.kind == ActionKind::Backward) {
      --in_flight;
      any_backward = true;
    }
  }
  return any_backward ? most : std::min(most, 1);
}

namespace {

bool is_send(ActionKind kind) {
  return kind == ActionKind::SendActivation || kind == ActionKind::SendGradient;
}
bool carries_activation(ActionKind kind) {
  return kind == ActionKind::SendActivation || kind == ActionKind::RecvActivation;
}
bool is_backward_kind(ActionKind kind) {
  return kind == ActionKind::Backward || kind == ActionKind::SendGradient ||
         kind == ActionKind::RecvGradient;
}
// Activations travel to s + 1, gradients to s - 1.
int peer_of(int stage, ActionKind kind) {
  return carries_activation(kind) == is_send(kind) ? stage + 1 : stage - 1;
}
ActionKind receive_of(ActionKind send) {
  return send == ActionKind::SendActivation ? ActionKind::RecvActivation : ActionKind::RecvGradient;
}

const StageActions& list_of(const std::vector<StageActions>& stages, int stage) {
  return stages[static_cast<size_t>(stage)];
}

void check_dependencies(const StageActions& actions, int stage, int stages, int m,
                        bool with_backward) {
  std::map<std::pair<ActionKind, int>, int> seen;  // (kind, micro-batch) -> count so far
  auto had = [&](ActionKind kind, int mb) { return seen.count({kind, mb}) != 0; };
  auto fail = [&](const PipelineAction& a, const char* why) {
    DSTRAIN_CHECK(false) << "pipeline schedule, stage " << stage << ": " << to_string(a) << " "
                         << why << " (" << to_string(actions) << ")";
  };
  for (const PipelineAction& a : actions) {
    const int mb = a.micro_batch;
    if (mb < 0 || mb >= m) fail(a, "names no micro-batch of the step");
    if (!with_backward && is_backward_kind(a.kind)) fail(a, "has no place in a forward-only step");
    switch (a.kind) {
      case ActionKind::Forward:
        if (stage > 0 && !had(ActionKind::RecvActivation, mb)) fail(a, "comes before its input");
        break;
      case ActionKind::SendActivation:
        if (!had(ActionKind::Forward, mb)) fail(a, "comes before its forward");
        break;
      case ActionKind::Backward:
        if (!had(ActionKind::Forward, mb)) fail(a, "comes before its forward");
        if (stage + 1 < stages && !had(ActionKind::RecvGradient, mb)) {
          fail(a, "comes before its output gradient");
        }
        break;
      case ActionKind::SendGradient:
        if (!had(ActionKind::Backward, mb)) fail(a, "comes before its backward");
        break;
      default: break;
    }
    if (++seen[{a.kind, mb}] > 1) fail(a, "appears twice");
  }
  for (int mb = 0; mb < m; ++mb) {
    if (!had(ActionKind::Forward, mb)) fail({ActionKind::Forward, mb}, "is missing");
    if (with_backward && !had(ActionKind::Backward, mb)) fail({ActionKind::Backward, mb}, "is missing");
  }
}

// Per stage, per action: the index in the peer stage's list of the action that takes or sends
// its message; -1 for compute.
using Partners = std::vector<std::vector<long>>;

std::vector<size_t> positions_of(const StageActions& actions, ActionKind kind) {
  std::vector<size_t> at;
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].kind == kind) at.push_back(i);
  }
  return at;
}

// Point-to-point messages between two ranks in one direction match in the order they are
// posted (NCCL, MPI): the k-th SEND_F of stage s lands in the k-th RECV_F of stage s + 1,
// whatever micro-batch each names. So a RECV of the wrong micro-batch is a data error, not a
// wait.
void link(const std::vector<StageActions>& stages, int sender, ActionKind send, Partners& partners) {
  const int receiver = peer_of(sender, send);
  const std::vector<size_t> sends = positions_of(list_of(stages, sender), send);
  const std::vector<size_t> receives = positions_of(list_of(stages, receiver), receive_of(send));
  DSTRAIN_CHECK(sends.size() == receives.size())
      << "pipeline schedule: stage " << sender << " sends " << sends.size()
      << (send == ActionKind::SendActivation ? " activations" : " gradients") << " to stage "
      << receiver << ", which receives " << receives.size();
  for (size_t k = 0; k < sends.size(); ++k) {
    const PipelineAction& sent = list_of(stages, sender)[sends[k]];
    const PipelineAction& taken = list_of(stages, receiver)[receives[k]];
    DSTRAIN_CHECK(sent.micro_batch == taken.micro_batch)
        << "pipeline schedule: stage " << sender << "'s " << to_string(sent) << " lands in stage "
        << receiver << "'s " << to_string(taken) << " (messages between two stages match in order)";
    partners[static_cast<size_t>(sender)][sends[k]] = static_cast<long>(receives[k]);
    partners[static_cast<size_t>(receiver)][receives[k]] = static_cast<long>(sends[k]);
  }
}

Partners pair_messages(const std::vector<StageActions>& stages) {
  const int count = static_cast<int>(stages.size());
  Partners partners(stages.size());
  for (int s = 0; s < count; ++s) partners[static_cast<size_t>(s)].assign(list_of(stages, s).size(), -1);
  for (int s = 0; s + 1 < count; ++s) {
    link(stages, s, ActionKind::SendActivation, partners);
    link(stages, s + 1, ActionKind::SendGradient, partners);
  }
  // What link left unpaired talks to a stage that does not exist.
  for (int s = 0; s < count; ++s) {
    for (size_t i = 0; i < list_of(stages, s).size(); ++i) {
      const PipelineAction& a = list_of(stages, s)[i];
      DSTRAIN_CHECK(!is_communication(a.kind) || partners[static_cast<size_t>(s)][i] >= 0)
          << "pipeline schedule, stage " << s << " of " << count << ": " << to_string(a)
          << " talks to stage " << peer_of(s, a.kind) << ", which does not exist";
    }
  }
  return partners;
}

// The runner as a discrete simulation. Each stage's cursor stands on a step: one compute action
// (done at once) or a run of consecutive communication actions (one exchange). A message is
// done when both its ends stand in their stages' current steps (rendezvous); a step ends when
// all its messages are done.
class Simulation {
 public:
  Simulation(const std::vector<StageActions>& stages, const Partners& partners)
      : stages_(stages), partners_(partners), begin_(stages.size(), 0), end_(stages.size(), 0),
        done_(stages.size()) {
    for (int s = 0; s < count(); ++s) {
      done_[static_cast<size_t>(s)].assign(list_of(stages, s).size(), 0);
      end_[static_cast<size_t>(s)] = step_end(s);
    }
  }

  void run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int s = 0; s < count(); ++s) progress = advance(s) || progress;
    }
  }

  // "" when every stage ran to its end; else each stuck stage, its action and whom it waits for.
  std::string stuck() const {
    std::ostringstream text;
    for (int s = 0; s < count(); ++s) {
      const long at = first_open(s);
      if (at < 0) continue;
      const PipelineAction& a = list_of(stages_, s)[static_cast<size_t>(at)];
      const int p = peer_of(s, a.kind);
      const long peer_at = first_open(p);
      text << " stage " << s << " at " << to_string(a) << " (stage " << p << " is "
           << (peer_at < 0 ? std::string("done")
                           : "at " + to_string(list_of(stages_, p)[static_cast<size_t>(peer_at)]))
           << ");";
    }
    return text.str();
  }

 private:
  int count() const { return static_cast<int>(stages_.size()); }
  size_t size_of(int s) const { return list_of(stages_, s).size(); }

  size_t step_end(int s) const {
    const StageActions& list = list_of(stages_, s);
    size_t end = begin_[static_cast<size_t>(s)];
    if (end < list.size() && !is_communication(list[end].kind)) return end + 1;
    while (end < list.size() && is_communication(list[end].kind)) ++end;
    return end;
  }
  bool in_step(int s, size_t i) const {
    return begin_[static_cast<size_t>(s)] <= i && i < end_[static_cast<size_t>(s)];
  }
  // The first action of s's current step not done yet; -1 when s has finished its list.
  long first_open(int s) const {
    const auto su = static_cast<size_t>(s);
    for (size_t i = begin_[su]; i < end_[su]; ++i) {
      if (!done_[su][i]) return static_cast<long>(i);
    }
    return -1;
  }

  // Completes the messages of s's step whose other end is in its stage's step; moves s on when
  // the step is complete. Returns whether anything changed.
  bool advance(int s) {
    const auto su = static_cast<size_t>(s);
    if (begin_[su] >= size_of(s)) return false;
    bool progress = false;
    for (size_t i = begin_[su]; i < end_[su]; ++i) {
      const PipelineAction& a = list_of(stages_, s)[i];
      if (done_[su][i]) continue;
      if (!is_communication(a.kind)) {
        done_[su][i] = 1;
        continue;
      }
      const int p = peer_of(s, a.kind);
      const auto j = static_cast<size_t>(partners_[su][i]);
      if (!in_step(p, j)) continue;
      done_[su][i] = done_[static_cast<size_t>(p)][j] = 1;
      progress = true;
    }
    if (first_open(s) >= 0) return progress;
    begin_[su] = end_[su];
    end_[su] = step_end(s);
    return true;
  }

  const std::vector<StageActions>& stages_;
  const Partners& partners_;
  std::vector<size_t> begin_, end_;  // (stages): each stage's current step [begin, end)
  std::vector<std::vector<char>> done_;  // (stages, actions of the stage)
};

}  // namespace

void check_pipeline_schedule(const std::vector<StageActions>& stages, int micro_batches,
                             bool with_backward) {
  const int count = static_cast<int>(stages.size());
  DSTRAIN_CHECK(count >= 1 && micro_batches >= 1) << count << " stages, " << micro_batches
                                                  << " micro-batches";
  for (int s = 0; s < count; ++s) {
    check_dependencies(list_of(stages, s), s, count, micro_batches, with_backward);
  }
  const Partners partners = pair_messages(stages);
  Simulation simulation(stages, partners);
  simulation.run();
  const std::string stuck = simulation.stuck();
  DSTRAIN_CHECK(stuck.empty()) << "pipeline schedule deadlocks:" << stuck;
}

}  // namespace dstrain
