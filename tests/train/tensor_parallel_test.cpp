// Tensor parallelism against one rank: a 4-layer model with 4 heads of 8 channels and an odd
// vocabulary of 97 (padded to 128: under tp 4 the last rank's 32 rows hold one real token and
// 31 of padding), 20 fp32 steps of 8 micro-batches of 2 x 16 tokens, the same global batch for
// every plan, on CPU ranks. The data is a learnable token stream over all 97 tokens (so every
// tp rank's vocabulary rows are looked up, and hit by targets).
//
// Tolerances: per-step losses within 1e-5 relative, final weights within 1e-5 absolute (fp32).
// Not bitwise: a row-parallel layer sums the tp ranks' partial products (each over C/tp or
// 4C/tp of the inner dimension) where one rank sums the whole inner dimension at once; the
// vocabulary-parallel softmax combines per-rank maxima and sums; under sequence parallelism a
// layernorm's weight gradient is the sum of the tp ranks' parts. Bitwise where the arithmetic
// is the same: offload and recompute within a plan, and a run and its resumption on the same
// plan.
//
// CI runs a representative subset (TensorParallelEquivalence.*, 10 plans: tp 2 and 4, with and
// without sequence parallelism, every ZeRO stage, offload, the recompute modes, tp x dp, tp x pp
// with both schedules, and dp 2 x tp 2 x pp 2 on 8 ranks). The full matrix, tp {2, 4} x (dp, pp)
// {(1,1), (2,1), (1,2), (2,2); tp 4 up to 8 ranks} x ZeRO 0-3 x offload x recompute {none,
// selective, full} x sequence parallel on/off x {1F1B, GPipe} where pp > 1 (480 plans), only
// with DSTRAIN_FULL_MATRIX=1:
//   DSTRAIN_FULL_MATRIX=1 build/tests_train --gtest_filter='*TensorParallelFullMatrix*'
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "core/rng.h"
#include "parallel/cost_model.h"
#include "parallel/pipeline_split.h"
#include "tests/common/temp_dir.h"
#include "tests/train/expect_user_error.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

constexpr int kVocab = 97;

struct Split {
  int tp = 1, dp = 1, pp = 1, zero = 0;
  bool offload = false;
  std::string recompute = "none";
  bool sequence_parallel = true;
  std::string schedule = "1f1b";
  std::string precision = "fp32";
  bool offload_params = false;

  int world() const { return tp * dp * pp; }
  std::string name() const {
    return "tp" + std::to_string(tp) + "_dp" + std::to_string(dp) + "_pp" + std::to_string(pp) +
           "_zero" + std::to_string(zero) + (offload ? "_offload" : "") +
           (offload_params ? "_params" : "") + "_" + recompute +
           (sequence_parallel ? "_sp" : "_nosp") + (pp > 1 ? "_" + schedule : "") + "_" + precision;
  }
};

void PrintTo(const Split& split, std::ostream* out) { *out << split.name(); }

// The model: 4 layers, C 32, 4 heads, vocabulary 97.
std::string write_model_config(const fs::path& dir) {
  fs::create_directories(dir);
  const fs::path path = dir / "tp_model.json";
  std::ofstream(path) << R"({"model_type": "gpt2", "vocab_size": 97, "n_positions": 32,
                            "n_embd": 32, "n_layer": 4, "n_head": 4})";
  return path.string();
}

// A stream over all 97 tokens that a small model can learn: mostly the next token is
// 5 * token + 3 (mod 97), sometimes one or two more.
std::string write_tokens(const fs::path& dir) {
  return test::write_learnable_tokens(dir, kVocab, 5, 3, 1234);
}

TrainOptions split_options(const fs::path& dir, const Split& s) {
  TrainOptions options = test::small_run_options(dir, s.name(), s.world());
  options.model = write_model_config(dir);
  options.data = write_tokens(dir);
  options.tp = s.tp;
  options.pp = s.pp;
  options.grad_accum = test::kSmallRunMicroBatches / s.dp;
  options.zero = s.zero;
  options.offload = s.offload;
  options.offload_params = s.offload_params;
  options.recompute = s.recompute;
  options.sequence_parallel = s.sequence_parallel;
  options.pp_schedule = s.schedule;
  options.precision = s.precision;
  options.threads = s.world();
  options.test.verify_tied_embedding = true;
  return options;
}

using RunResult = test::LoggedRun;

RunResult read_run(const TrainOptions& options) { return test::read_logged_run(options); }

RunResult run(const fs::path& dir, const Split& s) {
  TrainOptions options = split_options(dir, s);
  std::ostringstream out;
  train(options, out);
  return read_run(options);
}

class TensorParallelTest : public test::SameAsOneRank<Split, run> {
 protected:
  void expect_matches_one_rank(const Split& s, double loss_tolerance = 1e-5,
                               double weight_tolerance = 1e-5) {
    expect_same_as_one_rank(s, loss_tolerance, weight_tolerance, 0.5);
  }
};

Split split(int tp, int dp, int pp, int zero, bool offload, const char* recompute, bool sp,
            const char* schedule = "1f1b") {
  Split s;
  s.tp = tp;
  s.dp = dp;
  s.pp = pp;
  s.zero = zero;
  s.offload = offload;
  s.recompute = recompute;
  s.sequence_parallel = sp;
  s.schedule = schedule;
  return s;
}

class TensorParallelEquivalence : public TensorParallelTest,
                                  public ::testing::WithParamInterface<Split> {};

TEST_P(TensorParallelEquivalence, SameLossesAndWeightsAsOneRank) {
  expect_matches_one_rank(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Plans, TensorParallelEquivalence,
                         ::testing::Values(split(2, 1, 1, 0, false, "none", true),
                                           split(2, 1, 1, 0, false, "none", false),
                                           split(4, 1, 1, 1, false, "selective", true),
                                           split(4, 1, 1, 0, true, "full", false),
                                           split(2, 2, 1, 2, true, "none", true),
                                           split(2, 2, 1, 3, false, "selective", false),
                                           split(2, 1, 2, 1, false, "none", true),
                                           split(2, 1, 2, 0, false, "full", false, "gpipe"),
                                           split(2, 2, 2, 1, false, "none", true),
                                           split(2, 2, 2, 3, true, "selective", true, "gpipe")),
                         [](const ::testing::TestParamInfo<Split>& info) {
                           return info.param.name();
                         });

// The whole matrix (documented above; not in CI).
std::vector<Split> full_matrix() {
  std::vector<Split> points;
  const char* wanted = std::getenv("DSTRAIN_FULL_MATRIX");
  if (wanted == nullptr || std::string(wanted) != "1") return points;
  for (int tp : {2, 4})
    for (const auto& [dp, pp] : {std::pair{1, 1}, {2, 1}, {1, 2}, {2, 2}})
      for (int zero : {0, 1, 2, 3})
        for (bool offload : {false, true})
          for (const char* recompute : {"none", "selective", "full"})
            for (bool sp : {true, false})
              for (const char* schedule : {"1f1b", "gpipe"}) {
                if (tp * dp * pp > 8 || (pp == 1 && std::string(schedule) != "1f1b")) continue;
                points.push_back(split(tp, dp, pp, zero, offload, recompute, sp, schedule));
              }
  return points;
}

class TensorParallelFullMatrix : public TensorParallelTest,
                                 public ::testing::WithParamInterface<Split> {};

TEST_P(TensorParallelFullMatrix, SameLossesAndWeightsAsOneRank) {
  expect_matches_one_rank(GetParam());
}

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TensorParallelFullMatrix);
INSTANTIATE_TEST_SUITE_P(All, TensorParallelFullMatrix, ::testing::ValuesIn(full_matrix()),
                         [](const ::testing::TestParamInfo<Split>& info) {
                           return info.param.name();
                         });

TEST_F(TensorParallelTest, OffloadAndRecomputeChangeNoBitAndTheLogRecordsThePlan) {
  const Split base = split(2, 2, 1, 3, false, "none", true);
  const RunResult plain = run(temp_.path(), base);
  Split offload = base, recompute = base, params = base;
  offload.offload = true;
  recompute.recompute = "full";
  // Parameter offload: the sequence-parallel sums of the norms' gradients through the device.
  params.offload_params = true;
  for (const Split& other : {offload, recompute, params}) {
    const RunResult result = run(temp_.path(), other);
    EXPECT_EQ(result.losses, plain.losses) << other.name();
    EXPECT_EQ(result.weights, plain.weights) << other.name();
  }
  EXPECT_EQ(plain.config["plan"]["tp"], 2);
  EXPECT_EQ(plain.config["plan"]["dp"], 2);
  EXPECT_EQ(plain.config["plan"]["sequence_parallel"], true);
}

TEST_F(TensorParallelTest, Fp16AndBf16MatchOneRankWithinTheirRounding) {
  // Every activation and gradient is rounded to 16 bits and the additions' orders differ (see
  // the top): the losses agree to 1e-3 (fp16) and 1e-2 (bf16) relative.
  for (const std::string precision : {"fp16", "bf16"}) {
    Split one, split_run = split(2, 2, 1, 1, false, "none", true);
    one.precision = split_run.precision = precision;
    const RunResult a = run(temp_.path(), one), b = run(temp_.path(), split_run);
    ASSERT_EQ(a.losses.size(), b.losses.size());
    const double tolerance = precision == "fp16" ? 1e-3 : 1e-2;
    for (size_t i = 0; i < a.losses.size(); ++i) {
      EXPECT_NEAR(b.losses[i], a.losses[i], tolerance * a.losses[i])
          << precision << " step " << i + 1;
    }
  }
}

TEST_F(TensorParallelTest, ResumesAcrossTensorParallelDegrees) {
  // A checkpoint is plan-independent: a tp 4 run's checkpoint continues on tp 1 and on
  // tp 2 x pp 2 (within the tolerance of the top: the arithmetic differs), and on tp 4 itself
  // bit for bit.
  const Split tp4 = split(4, 1, 1, 1, false, "none", true);
  const fs::path dir = temp_.path() / "resume";
  TrainOptions straight = split_options(dir / "straight", tp4);
  straight.steps = 10;
  straight.save_every = 5;
  std::ostringstream out;
  train(straight, out);
  const std::vector<double> all = read_run(straight).losses;
  ASSERT_EQ(all.size(), 10u);
  for (const Split& second : {tp4, Split{}, split(2, 1, 2, 0, false, "none", false)}) {
    TrainOptions resumed = split_options(dir / ("resumed_" + second.name()), second);
    resumed.steps = 10;
    resumed.resume = straight.out + "/step-000005";
    resumed.data = straight.data;  // the same run: the same data and model files
    resumed.model = straight.model;
    train(resumed, out);
    const std::vector<double> tail = read_run(resumed).losses;
    ASSERT_EQ(tail.size(), 5u);
    for (int i = 0; i < 5; ++i) {
      if (second.tp == 4) {
        EXPECT_EQ(tail[i], all[5 + i]) << "step " << 6 + i;
      } else {
        EXPECT_NEAR(tail[i], all[5 + i], 1e-5 * all[5 + i]) << second.name() << ", step " << 6 + i;
      }
    }
  }
}

TEST_F(TensorParallelTest, TheLogCountsTheCollectivesTheCostModelCharges) {
  // Every step record holds, per stage, the tensor-parallel collectives its ranks ran and their
  // volume in all-reduce equivalents; the cost model (tensor_parallel_traffic) charges the same
  // count per micro-batch, and the same volume in (B*T, C) fp32 all-reduces, plus the loss's
  // (B*T, 3) statistics on the last stage (half of tp such buffers).
  for (const Split& s :
       {split(2, 1, 2, 0, false, "none", true), split(2, 2, 1, 1, false, "full", false),
        split(4, 1, 2, 0, false, "selective", true, "gpipe")}) {
    SCOPED_TRACE(s.name());
    TrainOptions options = split_options(temp_.path() / s.name(), s);
    options.steps = 2;
    std::ostringstream out;
    train(options, out);
    Plan plan;
    plan.tp = s.tp;
    plan.pp = s.pp;
    plan.sequence_parallel = s.sequence_parallel;
    plan.recompute = s.recompute == "full" ? Recompute::Full : Recompute::None;
    const RunResult result = read_run(options);
    const std::vector<int64_t> cut = result.config["plan"]["pp_split"];
    const double rows = 2.0 * 16, micro_batches = test::kSmallRunMicroBatches / s.dp;
    std::ifstream log(options.log);
    int steps = 0;
    for (std::string line; std::getline(log, line);) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (!record.contains("loss")) continue;
      ++steps;
      const nlohmann::json& tp = record.at("tensor_parallel");
      for (int stage = 0; stage < s.pp; ++stage) {
        const StageRange range = stage_of_split(cut, stage);
        const TensorParallelTraffic traffic = tensor_parallel_traffic(plan, range);
        EXPECT_EQ(tp["collectives"][stage].get<double>(), micro_batches * traffic.collectives)
            << "stage " << stage;
        const double statistics = range.last ? 0.5 * s.tp * rows * 3 * 4 : 0.0;
        EXPECT_EQ(tp["all_reduce_bytes"][stage].get<double>(),
                  micro_batches * (traffic.all_reduces * rows * 32 * 4 + statistics))
            << "stage " << stage;
        const double share = tp["comm_share"][stage];
        EXPECT_TRUE(share > 0.0 && share < 1.0) << share;
      }
    }
    EXPECT_EQ(steps, 2);
  }
}

TEST_F(TensorParallelTest, AFailingTensorParallelRankFailsEveryRankNamingIt) {
  // tp 2 x pp 2: stage 1's rank of tp index 1 (world rank 1 + 2 x 1 = 3) throws; its tp
  // partner and the other stage, waiting in collectives and exchanges, are released.
  TrainOptions options = split_options(temp_.path(), split(2, 1, 2, 0, false, "none", true));
  options.test.fail_stage = 1;
  options.test.fail_tensor_index = 1;
  options.test.fail_micro_batch = 1;
  options.test.fail_step = 2;
  options.comm_timeout = 30;
  std::ostringstream out;
  try {
    train(options, out);
    FAIL() << "the injected failure did not fail the run";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("stage 1 (rank 3)"), std::string::npos) << what;
    EXPECT_NE(what.find("injected failure"), std::string::npos) << what;
  }
}

TEST_F(TensorParallelTest, BadTensorParallelFlagsAreOneSentence) {
  TrainOptions options = split_options(temp_.path(), split(2, 1, 1, 0, false, "none", true));
  options.steps = 1;
  TrainOptions heads = options;
  heads.tp = heads.gpus = 3;
  test::expect_user_error(heads, "n_head (4)");
  TrainOptions rows = options;
  rows.tp = rows.gpus = 4;
  rows.batch = 1;
  rows.seq_len = 6;  // 6 token rows do not split over 4 ranks
  test::expect_user_error(rows, "--sequence-parallel false");
  TrainOptions uneven = options;
  uneven.gpus = 3;
  test::expect_user_error(uneven, "cannot be cut");
}

}  // namespace
}  // namespace dstrain
