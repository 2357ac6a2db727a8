// Pipeline schedules as data (parallel/pipeline_schedule.h): the exact lists of small cases
// written out by hand, the checker run over every shape a planner picks (stages 1..8 x
// micro-batches 1..12), the closed-form activation count against the lists, and bad lists the
// checker must reject (deadlocks, a missing backward, a receive of the wrong micro-batch).
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

#include "core/check.h"
#include "parallel/pipeline_schedule.h"

namespace dstrain {
namespace {

// "F0 SEND_F0 RECV_B0 B0" -> actions: bad lists read as the runner's log would.
StageActions parse_actions(const std::string& text) {
  static const std::pair<const char*, ActionKind> prefixes[] = {
      {"SEND_F", ActionKind::SendActivation}, {"RECV_F", ActionKind::RecvActivation},
      {"SEND_B", ActionKind::SendGradient},   {"RECV_B", ActionKind::RecvGradient},
      {"F", ActionKind::Forward},             {"B", ActionKind::Backward}};
  StageActions actions;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    for (const auto& [prefix, kind] : prefixes) {
      const std::string p = prefix;
      if (word.rfind(p, 0) == 0) {
        actions.push_back({kind, std::stoi(word.substr(p.size()))});
        break;
      }
    }
  }
  return actions;
}

std::vector<std::string> as_text(const std::vector<StageActions>& stages) {
  std::vector<std::string> text;
  for (const StageActions& s : stages) text.push_back(to_string(s));
  return text;
}

// The message of the dstrain::Error check_pipeline_schedule throws ("" when it passes).
std::string check_error(const std::vector<std::string>& stages, int micro_batches,
                        bool with_backward = true) {
  std::vector<StageActions> lists;
  for (const std::string& s : stages) lists.push_back(parse_actions(s));
  try {
    check_pipeline_schedule(lists, micro_batches, with_backward);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const PipelineScheduleKind kKinds[] = {PipelineScheduleKind::OneFOneB, PipelineScheduleKind::GPipe};

TEST(PipelineSchedule, OneFOneB_2stages_4microbatches) {
  EXPECT_EQ(as_text(make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 2, 4)),
            (std::vector<std::string>{
                "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 "
                "RECV_B3 B3",
                "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2 RECV_F3 F3 B3 "
                "SEND_B3"}));
}

// Fewer micro-batches than stages: the first stages never reach a steady state.
TEST(PipelineSchedule, OneFOneB_4stages_2microbatches) {
  EXPECT_EQ(as_text(make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 4, 2)),
            (std::vector<std::string>{
                "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
                "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_B1 B1 SEND_B1",
                "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_B1 B1 SEND_B1",
                "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1"}));
}

// A middle stage in steady state: SEND_F next to RECV_B, SEND_B next to RECV_F (one exchange
// each, Megatron's send_forward_recv_backward / send_backward_recv_forward).
TEST(PipelineSchedule, OneFOneB_3stages_3microbatches_middle_stage) {
  EXPECT_EQ(to_string(make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 3, 3)[1]),
            "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_F2 F2 SEND_F2 RECV_B1 "
            "B1 SEND_B1 RECV_B2 B2 SEND_B2");
}

TEST(PipelineSchedule, GPipe_2stages_3microbatches) {
  EXPECT_EQ(as_text(make_pipeline_schedule(PipelineScheduleKind::GPipe, 2, 3)),
            (std::vector<std::string>{
                "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 RECV_B0 B0 RECV_B1 B1 RECV_B2 B2",
                "RECV_F0 F0 RECV_F1 F1 RECV_F2 F2 B0 SEND_B0 B1 SEND_B1 B2 SEND_B2"}));
}

TEST(PipelineSchedule, OneStage_has_no_communication) {
  EXPECT_EQ(as_text(make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 1, 3)),
            (std::vector<std::string>{"F0 B0 F1 B1 F2 B2"}));
  EXPECT_EQ(as_text(make_pipeline_schedule(PipelineScheduleKind::GPipe, 1, 3)),
            (std::vector<std::string>{"F0 F1 F2 B0 B1 B2"}));
  EXPECT_EQ(as_text(make_forward_schedule(1, 2)), (std::vector<std::string>{"F0 F1"}));
}

TEST(PipelineSchedule, Forward_3stages_2microbatches) {
  EXPECT_EQ(as_text(make_forward_schedule(3, 2)),
            (std::vector<std::string>{"F0 SEND_F0 F1 SEND_F1",
                                      "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1",
                                      "RECV_F0 F0 RECV_F1 F1"}));
}

TEST(PipelineSchedule, Rejects_zero_stages_or_micro_batches) {
  EXPECT_THROW(make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 0, 4), Error);
  EXPECT_THROW(make_pipeline_schedule(PipelineScheduleKind::GPipe, 2, 0), Error);
  EXPECT_THROW(make_forward_schedule(2, 0), Error);
}

// Every shape the planner may pick runs to completion with every dependency kept.
TEST(PipelineSchedule, Checker_passes_all_kinds_stages1to8_microbatches1to12) {
  for (int stages = 1; stages <= 8; ++stages) {
    for (int m = 1; m <= 12; ++m) {
      for (PipelineScheduleKind kind : kKinds) {
        SCOPED_TRACE(std::string(pipeline_schedule_name(kind)) + " stages " +
                     std::to_string(stages) + " m " + std::to_string(m));
        EXPECT_NO_THROW(check_pipeline_schedule(make_pipeline_schedule(kind, stages, m), m));
      }
      EXPECT_NO_THROW(check_pipeline_schedule(make_forward_schedule(stages, m), m, false));
    }
  }
}

TEST(PipelineSchedule, ActivationSlots_equals_max_in_flight_stages1to8_microbatches1to12) {
  for (int stages = 1; stages <= 8; ++stages) {
    for (int m = 1; m <= 12; ++m) {
      for (PipelineScheduleKind kind : kKinds) {
        const std::vector<StageActions> lists = make_pipeline_schedule(kind, stages, m);
        for (int s = 0; s < stages; ++s) {
          EXPECT_EQ(activation_slots(kind, stages, s, m), max_in_flight(lists[s]))
              << pipeline_schedule_name(kind) << " stages " << stages << " stage " << s << " m "
              << m;
        }
      }
      for (const StageActions& forward_only : make_forward_schedule(stages, m)) {
        EXPECT_EQ(max_in_flight(forward_only), 1);
      }
    }
  }
  // The numbers the memory model relies on: 1F1B's first stage holds pp micro-batches.
  EXPECT_EQ(activation_slots(PipelineScheduleKind::OneFOneB, 4, 0, 8), 4);
  EXPECT_EQ(activation_slots(PipelineScheduleKind::OneFOneB, 4, 3, 8), 1);
  EXPECT_EQ(activation_slots(PipelineScheduleKind::OneFOneB, 4, 0, 2), 2);
  EXPECT_EQ(activation_slots(PipelineScheduleKind::GPipe, 4, 3, 8), 8);
}

// The hand-written good lists pass through the same helpers the bad ones use.
TEST(PipelineSchedule, Checker_accepts_hand_written_1f1b) {
  EXPECT_EQ(check_error({"F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
                         "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1"},
                        2),
            "");
}

// 1F1B (2 stages, 1 micro-batch) with stage 0's SEND_F0 and RECV_B0 in the wrong order, split
// by B0: stage 0 waits for a gradient while stage 1 waits for the activation that makes it.
TEST(PipelineSchedule, Checker_catches_deadlock_receives_face_each_other) {
  const std::string error = check_error({"F0 RECV_B0 B0 SEND_F0", "RECV_F0 F0 B0 SEND_B0"}, 1);
  EXPECT_NE(error.find("deadlocks"), std::string::npos) << error;
  EXPECT_NE(error.find("stage 0 at RECV_B0 (stage 1 is at RECV_F0)"), std::string::npos) << error;
  EXPECT_NE(error.find("stage 1 at RECV_F0 (stage 0 is at RECV_B0)"), std::string::npos) << error;
}

// Two blocking sends face each other: stage 0's SEND_F2 stands alone (F3 follows it), and so
// does stage 1's SEND_B0 (B1 follows it): with no buffering neither completes. Stage 1 sending
// each gradient in one exchange with the next activation's receive (as 1F1B does) runs.
TEST(PipelineSchedule, Checker_catches_deadlock_sends_face_each_other) {
  const std::string stage0 =
      "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 F3 SEND_F3 RECV_B0 B0 RECV_B1 B1 RECV_B2 B2 RECV_B3 B3";
  const std::string split_stage1 =
      "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 RECV_F2 F2 RECV_F3 F3 B2 SEND_B2 B3 SEND_B3";
  const std::string error = check_error({stage0, split_stage1}, 4);
  EXPECT_NE(error.find("stage 0 at SEND_F2 (stage 1 is at SEND_B0)"), std::string::npos) << error;
  EXPECT_NE(error.find("stage 1 at SEND_B0 (stage 0 is at SEND_F2)"), std::string::npos) << error;

  const std::string grouped_stage1 =
      "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 RECV_F2 B1 SEND_B1 RECV_F3 F2 B2 SEND_B2 F3 B3 SEND_B3";
  EXPECT_EQ(check_error({stage0, grouped_stage1}, 4), "");
}

// Moves the action at `from` (found by value) `by` places to the right in the list.
void move_right(StageActions& list, PipelineAction action, int by) {
  const auto at = std::find(list.begin(), list.end(), action);
  ASSERT_NE(at, list.end()) << to_string(action) << " not in " << to_string(list);
  std::rotate(at, at + 1, at + 1 + by);
}

// Generated 1F1B (2 stages, 4 micro-batches) with the first steady-state exchange of both
// stages undone: stage 0 takes gradient 0 before sending activation 1 (SEND_F1 moved behind
// B0), stage 1 takes activation 1 before sending gradient 0 (SEND_B0 moved behind RECV_F1).
// Each waits for what the other sends only later. Either stage alone so changed still runs:
// its neighbour's grouped exchange takes the message in any order.
TEST(PipelineSchedule, Checker_catches_deadlock_in_1f1b_with_exchanges_split) {
  const std::vector<StageActions> generated =
      make_pipeline_schedule(PipelineScheduleKind::OneFOneB, 2, 4);
  std::vector<StageActions> lists = generated;
  move_right(lists[0], {ActionKind::SendActivation, 1}, 2);  // F1 RECV_B0 B0 SEND_F1
  move_right(lists[1], {ActionKind::Backward, 0}, 2);        // F0 SEND_B0 RECV_F1 B0 ...
  move_right(lists[1], {ActionKind::SendGradient, 0}, 2);    // F0 RECV_F1 B0 SEND_B0
  try {
    check_pipeline_schedule(lists, 4);
    FAIL() << "no deadlock found in " << to_string(lists[0]) << " / " << to_string(lists[1]);
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("stage 0 at RECV_B0 (stage 1 is at RECV_F1)"), std::string::npos) << what;
    EXPECT_NE(what.find("stage 1 at RECV_F1 (stage 0 is at RECV_B0)"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(check_pipeline_schedule({lists[0], generated[1]}, 4));
  EXPECT_NO_THROW(check_pipeline_schedule({generated[0], lists[1]}, 4));
}

TEST(PipelineSchedule, Checker_catches_missing_backward) {
  const std::string error =
      check_error({"F0 SEND_F0 F1 SEND_F1 RECV_B0 B0", "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1"}, 2);
  EXPECT_NE(error.find("stage 0: B1 is missing"), std::string::npos) << error;
}

// Stage 1 takes micro-batch 1 first: the first message from stage 0 (activation 0) lands in it.
TEST(PipelineSchedule, Checker_catches_receive_of_wrong_micro_batch) {
  const std::string error = check_error(
      {"F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
       "RECV_F1 F1 RECV_F0 F0 B0 SEND_B0 B1 SEND_B1"},
      2);
  EXPECT_NE(error.find("stage 0's SEND_F0 lands in stage 1's RECV_F1"), std::string::npos)
      << error;
}

TEST(PipelineSchedule, Checker_catches_broken_dependencies) {
  // A forward before its input.
  EXPECT_NE(check_error({"F0 SEND_F0", "F0 RECV_F0"}, 1, false).find("F0 comes before its input"),
            std::string::npos);
  // A send before the forward that makes it.
  EXPECT_NE(check_error({"SEND_F0 F0", "RECV_F0 F0"}, 1, false).find("SEND_F0 comes before"),
            std::string::npos);
  // A micro-batch forwarded twice.
  EXPECT_NE(check_error({"F0 F0 B0"}, 1).find("appears twice"), std::string::npos);
  // The first stage receives no activation.
  EXPECT_NE(check_error({"RECV_F0 F0 B0"}, 1).find("does not exist"), std::string::npos);
  // A receive nobody sends.
  EXPECT_NE(check_error({"F0", "RECV_F0 F0"}, 1, false).find("sends 0 activations"),
            std::string::npos);
  // Backward actions in a forward-only step.
  EXPECT_NE(check_error({"F0 B0"}, 1, false).find("forward-only"), std::string::npos);
}

TEST(PipelineSchedule, ToString_of_every_action) {
  EXPECT_EQ(to_string(PipelineAction{ActionKind::Forward, 3}), "F3");
  EXPECT_EQ(to_string(PipelineAction{ActionKind::Backward, 3}), "B3");
  EXPECT_EQ(to_string(PipelineAction{ActionKind::SendActivation, 3}), "SEND_F3");
  EXPECT_EQ(to_string(PipelineAction{ActionKind::RecvActivation, 3}), "RECV_F3");
  EXPECT_EQ(to_string(PipelineAction{ActionKind::SendGradient, 3}), "SEND_B3");
  EXPECT_EQ(to_string(PipelineAction{ActionKind::RecvGradient, 12}), "RECV_B12");
  EXPECT_EQ(to_string(StageActions{}), "");
  EXPECT_FALSE(is_communication(ActionKind::Forward));
  EXPECT_FALSE(is_communication(ActionKind::Backward));
  EXPECT_TRUE(is_communication(ActionKind::SendActivation));
  EXPECT_TRUE(is_communication(ActionKind::RecvGradient));
}

// to_string and the test's parser are inverse on real lists: the hand-written cases above
// read what the generator makes.
TEST(PipelineSchedule, ToString_round_trips_through_parse_actions) {
  for (PipelineScheduleKind kind : kKinds) {
    for (const StageActions& list : make_pipeline_schedule(kind, 4, 6)) {
      EXPECT_EQ(parse_actions(to_string(list)), list);
    }
  }
}

TEST(PipelineSchedule, Parse_round_trips_names) {
  for (PipelineScheduleKind kind : kKinds) {
    EXPECT_EQ(parse_pipeline_schedule(pipeline_schedule_name(kind)), kind);
  }
  EXPECT_STREQ(pipeline_schedule_name(PipelineScheduleKind::OneFOneB), "1f1b");
  EXPECT_STREQ(pipeline_schedule_name(PipelineScheduleKind::GPipe), "gpipe");
}

TEST(PipelineSchedule, Parse_error_names_flag_and_choices) {
  try {
    parse_pipeline_schedule("interleaved");
    FAIL() << "no error for an unknown schedule";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--pp-schedule"), std::string::npos) << what;
    EXPECT_NE(what.find("interleaved"), std::string::npos) << what;
    EXPECT_NE(what.find("1f1b"), std::string::npos) << what;
    EXPECT_NE(what.find("gpipe"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace dstrain
