// Training on chat data (token shards with loss masks): the loss is the mean over the trained
// tokens of the whole optimizer step, counted over every micro-batch and rank before any
// division, so the micro-batch split and the plan do not change it.
//  - Every token trained, conversations of exactly T+1 tokens: the same bits as the same tokens
//    read as text.
//  - Micro-batch 1 x 8 accumulation, 8 x 1, and 4 ranks (dp 4; dp 2 x pp 2; tp 2 x dp 2 at
//    ZeRO-3) train to the same numbers (summation order only: 1e-6 relative).
//  - A per-micro-batch mean would not: the micro-batches hold different trained counts, which
//    the test checks so that it can fail.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <sstream>

#include "data/loader.h"
#include "data/loss_mask.h"
#include "data/token_file.h"
#include "tests/train/small_model.h"
#include "train/devices.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;
constexpr int kVocab = 37;
constexpr int kSeqLen = 16;

// Conversations a small model can learn: a random prompt (untrained) and a reply in which each
// token follows the one before it by t -> (5t + 3) mod 37 (trained, to its last token). Lengths
// 4..20 for T = 16: some are truncated.
std::string write_chat_data(const fs::path& dir, uint64_t seed) {
  fs::create_directories(dir);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  for (int c = 0; c < 400; ++c) {
    const int length = 4 + static_cast<int>(rng() % 17);
    const int prompt = 1 + static_cast<int>(rng() % static_cast<uint64_t>(length - 2));
    int32_t token = 0;
    for (int t = 0; t < length; ++t) {
      token = t < prompt ? static_cast<int32_t>(rng() % kVocab) : (5 * token + 3) % kVocab;
      tokens.push_back(token);
      flags.push_back(static_cast<uint8_t>((t == 0 ? kMaskConversationStart : 0) |
                                           (t >= prompt ? kMaskTrained : 0)));
    }
  }
  const std::string shard = (dir / "train_000000.bin").string();
  write_token_file(shard, tokens, TokenFormat::kLlmcU16);
  write_mask_file(mask_path_for(shard), flags);
  return shard;
}

// A text stream and the same windows as chat data: conversation c is text window c (tokens
// [cT, cT + T + 1)), every token trained. Returns {text shard, chat shard}.
std::pair<std::string, std::string> write_text_and_its_windows(const fs::path& dir) {
  fs::create_directories(dir / "text_data");
  fs::create_directories(dir / "chat_data");
  std::mt19937_64 rng(12);
  std::vector<int32_t> text(400 * kSeqLen + 1);
  int32_t token = 0;
  for (int32_t& t : text) t = token = (5 * token + 3 + static_cast<int32_t>(rng() % 3)) % kVocab;
  std::vector<int32_t> windows;
  std::vector<uint8_t> flags;
  for (size_t c = 0; (c + 1) * kSeqLen < text.size(); ++c) {
    for (size_t i = 0; i <= kSeqLen; ++i) {
      windows.push_back(text[c * kSeqLen + i]);
      flags.push_back(i == 0 ? kMaskConversationStart : kMaskTrained);
    }
  }
  const std::string text_shard = (dir / "text_data" / "train_000000.bin").string();
  const std::string chat_shard = (dir / "chat_data" / "train_000000.bin").string();
  write_token_file(text_shard, text, TokenFormat::kLlmcU16);
  write_token_file(chat_shard, windows, TokenFormat::kLlmcU16);
  write_mask_file(mask_path_for(chat_shard), flags);
  return {text_shard, chat_shard};
}

// 16 rows of T = 16 per step, split as `ranks` x `batch` x the accumulation.
TrainOptions chat_run_options(const fs::path& dir, const std::string& name, const std::string& data,
                              int ranks, int64_t batch) {
  TrainOptions options = test::small_run_options(dir, name, ranks);
  options.data = data;
  options.val_data = data;  // the same shard: no held-out cut, no evaluation (eval_every 0)
  options.batch = batch;
  options.grad_accum = 16 / (ranks * batch);
  options.seq_len = kSeqLen;
  options.threads = ranks;
  return options;
}

test::LoggedRun train_run(const TrainOptions& options) {
  std::ostringstream out;
  train(options, out);
  test::LoggedRun run = test::read_logged_run(options);
  run.output = out.str();
  return run;
}

TEST(ChatTraining, EveryTokenTrainedIsTheTextRunBitForBit) {
  testing::TempDir dir;
  const auto [text, chat] = write_text_and_its_windows(dir.path());
  const test::LoggedRun text_run = train_run(chat_run_options(dir.path(), "text", text, 1, 2));
  const test::LoggedRun chat_run = train_run(chat_run_options(dir.path(), "chat", chat, 1, 2));
  ASSERT_EQ(text_run.losses.size(), size_t(test::kSmallRunSteps));
  EXPECT_LT(text_run.losses.back(), text_run.losses.front() - 0.3);
  EXPECT_EQ(chat_run.losses, text_run.losses);
  EXPECT_EQ(test::max_weight_difference(text_run.weights, chat_run.weights), 0.0);
  EXPECT_NE(chat_run.output.find("chat data: 400 conversation(s)"), std::string::npos)
      << chat_run.output;
  EXPECT_NE(chat_run.output.find("(rows of 16: 100% filled, 100% trained)"), std::string::npos)
      << chat_run.output;
}

// The split of a step's 16 rows does not change the loss, nor the weights beyond summation order.
struct Split {
  int ranks = 1;
  int64_t batch = 1;
  int tp = 1, pp = 1, zero = 0;
  int layers = 2, heads = 3;
  std::string packing = "off";
  std::string name() const {
    return "l" + std::to_string(layers) + "_" + packing + "_r" + std::to_string(ranks) + "_b" +
           std::to_string(batch) + "_tp" + std::to_string(tp) + "_pp" + std::to_string(pp) + "_z" +
           std::to_string(zero);
  }
};

test::LoggedRun train_split(const fs::path& dir, const Split& split) {
  const std::string data = write_chat_data(dir / "data", 21);
  TrainOptions options = chat_run_options(dir, split.name(), data, split.ranks, split.batch);
  options.model = test::write_small_model_config(dir, split.layers, split.heads);
  options.tp = split.tp;
  options.pp = split.pp;
  options.zero = split.zero;
  options.packing = split.packing;
  options.grad_accum = 16 / (split.batch * (split.ranks / (split.tp * split.pp)));
  return train_run(options);
}

TEST(ChatTraining, MicroBatchesOfDifferentTrainedCountsMeanOverTheStep) {
  testing::TempDir dir;
  const test::LoggedRun one_by_16 = train_split(dir.path() / "a", Split{1, 1});
  const test::LoggedRun sixteen_by_1 = train_split(dir.path() / "b", Split{1, 16});
  test::expect_same_training(one_by_16, sixteen_by_1, "16 x 1 against 1 x 16", 1e-6, 1e-5, 0.3);
  // The mean is over the trained targets, not every position: the fresh model predicts nearly
  // uniformly, so its first loss is near log(V) (a mean over all 16 x 16 positions, about half
  // of them prompt or padding, would be near half of it).
  EXPECT_NEAR(one_by_16.losses[0], std::log(double{kVocab}), 0.1);
  // The first step's rows hold different trained counts, so a mean per micro-batch of 1 x 16
  // would weigh the tokens differently from one over the 16 rows: the test can fail.
  const TokenDataset data =
      TokenDataset::open((dir.path() / "a" / "data" / "*.bin").string(), kVocab);
  const ConversationIndex index = index_conversations(data, kSeqLen);
  std::set<uint32_t> counts;
  for (size_t row = 0; row < 16; ++row) counts.insert(index.conversations.at(row).trained);
  EXPECT_GT(counts.size(), 3u);
}

TEST(ChatTraining, FourRanksOfAnyPlanTrainAsOne) {
  testing::TempDir dir;
  const Split one{1, 4, 1, 1, 0, 4, 4};
  const test::LoggedRun reference = train_split(dir.path() / "one", one);
  for (const Split& split :
       {Split{4, 1, 1, 1, 0, 4, 4}, Split{4, 2, 1, 2, 1, 4, 4}, Split{4, 2, 2, 1, 3, 4, 4}}) {
    SCOPED_TRACE(split.name());
    test::expect_same_training(reference, train_split(dir.path() / split.name(), split),
                               split.name(), 1e-6, 1e-5, 0.3);
  }
}

// The losses of `resumed` (shuffled, its model from the checkpoint) resumed from `straight`'s
// checkpoint at step 5 to step 10.
std::vector<double> resumed_losses(TrainOptions resumed, const TrainOptions& straight) {
  resumed.shuffle = true;
  resumed.model.clear();
  resumed.resume = straight.out + "/step-000005";
  resumed.steps = 10;
  std::ostringstream out;
  train(resumed, out);
  std::vector<double> tail;
  for (const nlohmann::json& r : test::read_logged_run(resumed).steps) tail.push_back(r["loss"]);
  return tail;
}

// A chat run resumed from its checkpoint, shuffled, on another split of the step, continues to
// the same losses: the loader's position and each step's trained count come back with it.
TEST(ChatTraining, ResumesOnTheSameCurve) {
  testing::TempDir dir;
  const std::string data = write_chat_data(dir.path() / "data", 31);
  TrainOptions straight = chat_run_options(dir.path(), "straight", data, 1, 4);
  straight.shuffle = true;
  straight.steps = 10;
  straight.save_every = 5;
  const test::LoggedRun all = train_run(straight);
  const std::vector<double> tail =
      resumed_losses(chat_run_options(dir.path(), "resumed", data, 2, 2), straight);
  ASSERT_EQ(tail.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(tail[i], all.losses[5 + i], 1e-6 * all.losses[5 + i]) << "step " << 6 + i;
  }
}

// Under a token budget, shuffled: resumed at step 5 on the same plan, the same bits; on dp 2
// (the same micro-batches per step, split over the ranks), within summation order.
TEST(ChatTraining, BatchTokensResumeOnTheSameCurve) {
  testing::TempDir dir;
  const std::string data = write_chat_data(dir.path() / "data", 33);
  TrainOptions straight = chat_run_options(dir.path(), "straight", data, 1, 1);
  straight.batch_tokens = 32;
  straight.grad_accum = 8;
  straight.shuffle = true;
  straight.steps = 10;
  straight.save_every = 5;
  const test::LoggedRun all = train_run(straight);
  for (int ranks : {1, 2}) {
    TrainOptions resumed =
        chat_run_options(dir.path(), "resumed" + std::to_string(ranks), data, ranks, 1);
    resumed.batch_tokens = 32;
    resumed.grad_accum = 8 / ranks;
    const std::vector<double> tail = resumed_losses(resumed, straight);
    ASSERT_EQ(tail.size(), 5u) << ranks;
    for (int i = 0; i < 5; ++i) {
      if (ranks == 1) {
        EXPECT_EQ(tail[i], all.losses[5 + i]) << "step " << 6 + i;
      } else {
        EXPECT_NEAR(tail[i], all.losses[5 + i], 1e-6 * all.losses[5 + i]) << "step " << 6 + i;
      }
    }
  }
}

// Packed rows train as one rank too, on every kind of plan: dp, tp x dp at ZeRO-3, dp x pp
// (the middle stages read the positions) and dp x tp x pp.
TEST(ChatTraining, PackedRowsOnFourRanksTrainAsOne) {
  testing::TempDir dir;
  Split one{1, 4, 1, 1, 0, 4, 4, "on"};
  const test::LoggedRun reference = train_split(dir.path() / "one", one);
  for (const Split& split : {Split{4, 1, 1, 1, 0, 4, 4, "on"}, Split{4, 2, 2, 1, 3, 4, 4, "on"},
                             Split{4, 1, 1, 4, 1, 4, 4, "on"}, Split{8, 2, 2, 2, 0, 4, 4, "on"}}) {
    SCOPED_TRACE(split.name());
    test::expect_same_training(reference, train_split(dir.path() / split.name(), split),
                               split.name(), 1e-6, 1e-5, 0.3);
  }
}

// Conversations of 5 tokens (4 positions each) pack 4 to a row of 16: a step of 4 packed rows
// holds the 16 conversations a step of 16 unpacked rows holds, in the same order. The packed run
// equals the unpacked one (padded, masked) within 1e-5: attention never crosses a
// conversation's start and the positions restart there (rotary for Llama, the learned table for
// GPT-2).
std::string write_uniform_chat(const fs::path& dir, uint64_t seed) {
  fs::create_directories(dir);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  for (int c = 0; c < 400; ++c) {
    int32_t token = static_cast<int32_t>(rng() % kVocab);
    for (int t = 0; t < 5; ++t) {
      token = t < 2 ? static_cast<int32_t>(rng() % kVocab) : (5 * token + 3) % kVocab;
      tokens.push_back(token);
      flags.push_back(static_cast<uint8_t>((t == 0 ? kMaskConversationStart : 0) |
                                           (t >= 2 ? kMaskTrained : 0)));
    }
  }
  const std::string shard = (dir / "train_000000.bin").string();
  write_token_file(shard, tokens, TokenFormat::kLlmcU16);
  write_mask_file(mask_path_for(shard), flags);
  return shard;
}

// The plan both runs take: 1 rank, or dp 2 x tp 2 x pp 2.
struct PackPlan {
  int ranks = 1, tp = 1, pp = 1;
  std::string device = "cpu";
};

void expect_packed_equals_unpacked(const std::string& model_type, const PackPlan& plan = {}) {
  testing::TempDir dir;
  const std::string data = write_uniform_chat(dir.path() / "data", 41);
  const fs::path model = dir.path() / "model" / "config.json";
  fs::create_directories(model.parent_path());
  if (model_type == "llama") {
    std::ofstream(model) << R"({"model_type": "llama", "vocab_size": 37, "hidden_size": 24,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5})";
  } else {
    std::ofstream(model) << R"({"model_type": "gpt2", "vocab_size": 37, "n_positions": 32,
      "n_embd": 24, "n_layer": 2, "n_head": 4})";
  }
  const int dp = plan.ranks / (plan.tp * plan.pp);
  TrainOptions unpacked = chat_run_options(dir.path(), "unpacked", data, plan.ranks, 16 / dp);
  unpacked.packing = "off";
  // 4 rows of 4 conversations: the unpacked step's 16.
  TrainOptions packed = chat_run_options(dir.path(), "packed", data, plan.ranks, 4 / dp);
  packed.packing = "on";
  for (TrainOptions* options : {&unpacked, &packed}) {
    options->model = model.string();
    options->device = plan.device;
    options->tp = plan.tp;
    options->pp = plan.pp;
    options->grad_accum = 1;
  }
  const test::LoggedRun a = train_run(unpacked), b = train_run(packed);
  // On one rank the same bits; on dp 2 the micro-batches of 8 and 2 rows sum the weight
  // gradients' rows in other SIMD groupings (1e-8 in a step's loss), which ten AdamW steps
  // carry to 1e-5 in a weight whose gradient is near 0.
  const double weights = plan.ranks == 1 ? 1e-5 : 3e-5;
  test::expect_same_training(a, b, model_type + ": packed against unpacked", 1e-5, weights, 0.3);
  EXPECT_NE(b.output.find("packing 400 conversations into 100 rows of 16 (100.0% of their "
                         "positions filled)"),
            std::string::npos)
      << b.output;
  EXPECT_EQ(a.output.find("packing"), std::string::npos) << a.output;
}

TEST(ChatTraining, PackedEqualsUnpackedLlama) { expect_packed_equals_unpacked("llama"); }
TEST(ChatTraining, PackedEqualsUnpackedGpt2) { expect_packed_equals_unpacked("gpt2"); }
TEST(ChatTraining, PackedEqualsUnpackedOnDpTpPp) {
  expect_packed_equals_unpacked("llama", PackPlan{8, 2, 2});
  expect_packed_equals_unpacked("gpt2", PackPlan{8, 2, 2});
}

// A token budget (--batch-tokens 32, T = 16): conversations of 5 tokens take rows 8 wide, 4 to
// a micro-batch of (4, 8), on a plan of 2 rows of 16; the same 4 conversations as a micro-batch
// of 4 padded rows of 16 give the same training.
void expect_batch_tokens_equal_rows(const PackPlan& plan) {
  testing::TempDir dir;
  const std::string data = write_uniform_chat(dir.path() / "data", 43);
  const int dp = plan.ranks / (plan.tp * plan.pp);
  TrainOptions rows = chat_run_options(dir.path(), "rows", data, plan.ranks, 4);
  rows.packing = "off";
  TrainOptions budget = chat_run_options(dir.path(), "budget", data, plan.ranks, 1);
  budget.batch_tokens = 32;
  for (TrainOptions* options : {&rows, &budget}) {
    options->model = test::write_small_model_config(dir.path(), 2, 4);
    options->tp = plan.tp;
    options->pp = plan.pp;
    options->device = plan.device;
    options->grad_accum = 4 / dp;  // 16 conversations a step
  }
  const test::LoggedRun a = train_run(rows), b = train_run(budget);
  test::expect_same_training(a, b, "a token budget against rows", 1e-6, 1e-5, 0.3);
  EXPECT_NE(b.output.find("micro-batches of up to 32 positions: 100 of one conversation per "
                          "row"),
            std::string::npos)
      << b.output;
  EXPECT_EQ(b.output.find("packing"), std::string::npos) << b.output;
}

TEST(ChatTraining, BatchTokensEqualTheSameRowsOneRank) { expect_batch_tokens_equal_rows({}); }
TEST(ChatTraining, BatchTokensEqualTheSameRowsOnDpTpPp) {
  expect_batch_tokens_equal_rows(PackPlan{8, 2, 2});
}

// Conversations of 4 to 20 tokens under a budget of 32 positions: micro-batches of 1 to 4 rows
// 8 or 16 wide. Every plan reads the same micro-batches each step and trains as one rank; the
// pipeline's middle stages take each micro-batch's shape from their own loader.
TEST(ChatTraining, BatchTokensOnAnyPlanTrainAsOne) {
  testing::TempDir dir;
  const auto run = [&](const std::string& name, int ranks, int tp, int pp, int zero) {
    const std::string data = write_chat_data(dir.path() / name / "data", 21);
    TrainOptions options = chat_run_options(dir.path() / name, name, data, ranks, 1);
    options.model = test::write_small_model_config(dir.path() / name, 4, 4);
    options.batch_tokens = 32;
    options.shuffle = true;
    options.tp = tp;
    options.pp = pp;
    options.zero = zero;
    options.grad_accum = 8 / (ranks / (tp * pp));
    return train_run(options);
  };
  const test::LoggedRun one = run("one", 1, 1, 1, 0);
  EXPECT_NE(one.output.find("at most (micro-batches of up to 32 positions)"), std::string::npos)
      << one.output;
  test::expect_same_training(one, run("dp2_pp2", 4, 1, 2, 1), "dp 2 x pp 2", 1e-6, 1e-5, 0.3);
  test::expect_same_training(one, run("pp4", 4, 1, 4, 0), "pp 4", 1e-6, 1e-5, 0.3);
  test::expect_same_training(one, run("dp2_tp2_pp2", 8, 2, 2, 3), "dp 2 x tp 2 x pp 2", 1e-6,
                             1e-5, 0.3);
}

// On a GPU (the emulator's in CI): the CUDA attention, rotary and embedding kernels with
// positions (the bf16 kernels with positions are tested against the twin in kernels_cuda).
TEST(ChatTraining, PackedEqualsUnpackedOnAGpu) {
  if (usable_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  expect_packed_equals_unpacked("llama", PackPlan{1, 1, 1, "cuda"});
}

// The CUDA kernels on micro-batches of their own shapes, (4, 8) on a plan of (2, 16).
TEST(ChatTraining, BatchTokensEqualTheSameRowsOnAGpu) {
  if (usable_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  expect_batch_tokens_equal_rows(PackPlan{1, 1, 1, "cuda"});
}

}  // namespace
}  // namespace dstrain
