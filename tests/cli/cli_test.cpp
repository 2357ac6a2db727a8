// The dstrain binary as a user meets it: bad input gets one clear sentence on stderr and a
// non-zero exit, never a crash or a stack trace; --help and prepare work.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/bpe_tokenizer.h"
#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"
#include "train/devices.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

using Result = dstrain::testing::BinaryResult;

// Runs the dstrain binary with `args` (a shell word list), capturing stdout and stderr.
Result run_dstrain(const std::string& args, const fs::path& dir) {
  return dstrain::testing::run_binary(DSTRAIN_BINARY, args, dir);
}

class CliTest : public ::testing::Test {
 protected:
  dstrain::testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();
  fs::path file(const std::string& name) const { return dir_ / name; }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(file(name), std::ios::binary) << bytes;
  }
  // Exit code 2 and exactly one line "dstrain: error: ..." holding `fragment`.
  void expect_user_error(const std::string& args, const std::string& fragment) const {
    dstrain::testing::expect_one_sentence(run_dstrain(args, dir_), args, fragment);
  }
};

// An llm.c uint16 shard: 256 int32 header, then the tokens.
std::string llmc_shard(const std::vector<uint16_t>& tokens, int32_t magic = 20240520,
                       int32_t version = 1, int64_t claimed = -1) {
  std::array<int32_t, 256> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(claimed < 0 ? tokens.size() : claimed);
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return bytes;
}

std::vector<uint16_t> random_tokens(size_t n, uint16_t vocab) {
  std::vector<uint16_t> tokens(n);
  uint64_t state = 12345;
  for (auto& token : tokens) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    token = static_cast<uint16_t>((state >> 33) % vocab);
  }
  return tokens;
}

const std::string kSmall = "--batch 2 --seq-len 16 --steps 1 --eval-every 0 --sample 0 --quiet";

TEST_F(CliTest, HelpAndVersion) {
  Result help = run_dstrain("--help", dir_);
  EXPECT_EQ(help.exit_code, 0);
  for (const char* flag : {"--model", "--data", "--val-data", "--shuffle", "--batch", "--seq-len",
                           "--grad-accum", "--steps", "--lr", "--lr-schedule", "--warmup",
                           "--min-lr", "--weight-decay", "--beta1", "--beta2", "--eps",
                           "--grad-clip", "--seed", "--precision", "--device", "--gpus", "--log",
                           "--eval-every", "--out", "--save-every", "--resume", "--init-from"}) {
    EXPECT_NE(help.out.find(std::string(flag) + " "), std::string::npos) << flag;
  }
  EXPECT_EQ(run_dstrain("--version", dir_).exit_code, 0);
}

TEST_F(CliTest, BadFlagsAreOneSentence) {
  expect_user_error("--bogus", "unknown flag --bogus");
  expect_user_error("--steps many", "--steps");
  expect_user_error("--model gpt5", "unknown model 'gpt5'");
  expect_user_error("--lr-schedule linear " + kSmall, "--lr-schedule");
  expect_user_error("--device tpu " + kSmall, "--device");
  expect_user_error("--precision fp4 " + kSmall, "--precision");
  expect_user_error("--precision fp8 --batch 1 --seq-len 24 --steps 1 --sample 0 --quiet",
                    "make a micro-batch's tokens (--batch 1 x --seq-len 24) a multiple of 16");
  expect_user_error("--steps 0", "--steps");
  expect_user_error("frobnicate", "unknown command 'frobnicate'");
}

// --gpu-memory caps what each rank's allocator holds (on CPU ranks: its memory): past it, one
// sentence naming the flag and what the memory was for; within it, the run trains.
TEST_F(CliTest, GpuMemoryCapsEachRanksAllocator) {
  expect_user_error("--device cpu --gpu-memory 64K " + kSmall, "--gpu-memory 64K: ");
  Result capped = run_dstrain("--device cpu --gpu-memory 64K " + kSmall, dir_);
  EXPECT_NE(capped.err.find("past its 64.0 KiB (held: "), std::string::npos) << capped.err;
  Result fits = run_dstrain("--device cpu --gpu-memory 1G " + kSmall, dir_);
  EXPECT_EQ(fits.exit_code, 0) << fits.err;
  expect_user_error("--device cpu --gpu-memory 0 " + kSmall, "--gpu-memory 0: give a size above 0");
}

TEST_F(CliTest, BadModelConfigs) {
  write("missing.json", R"({"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_head": 4})");
  expect_user_error("--model missing.json " + kSmall, "\"n_layer\"");
  write("absurd.json",
        R"({"vocab_size": 256, "n_positions": 64, "n_embd": 30, "n_head": 4, "n_layer": 2})");
  expect_user_error("--model absurd.json " + kSmall, "not divisible");
  write("negative.json",
        R"({"vocab_size": -5, "n_positions": 64, "n_embd": 32, "n_head": 4, "n_layer": 2})");
  expect_user_error("--model negative.json " + kSmall, "vocab_size");
  write("garbage.json", "this is not json");
  expect_user_error("--model garbage.json " + kSmall, "not valid JSON");
  expect_user_error("--model nowhere/config.json " + kSmall, "cannot read");
}

TEST_F(CliTest, BadDataFiles) {
  expect_user_error("--data missing.bin " + kSmall, "missing.bin");
  write("truncated.bin", llmc_shard(random_tokens(500, 256), 20240520, 1, 900));
  expect_user_error("--data truncated.bin " + kSmall, "truncated.bin");
  write("magic.bin", llmc_shard(random_tokens(500, 256), 12345));
  expect_user_error("--data magic.bin " + kSmall, "magic");
  // Text given as data is told to go through prepare.
  write("book.txt", "It was the best of times, it was the worst of times.\n\u00e9t\u00e9\n");
  expect_user_error("--data book.txt " + kSmall,
                    "'book.txt' holds text, not tokens: tokenize it first with `dstrain prepare "
                    "--input book.txt --out DIR`");
  write("version.bin", llmc_shard(random_tokens(500, 256), 20240520, 3));
  expect_user_error("--data version.bin " + kSmall, "version");
  std::vector<uint16_t> tokens = random_tokens(500, 256);
  tokens[321] = 300;  // tiny's vocabulary is 256
  write("vocab.bin", llmc_shard(tokens));
  expect_user_error("--data vocab.bin " + kSmall, "300");
  write("small.bin", llmc_shard(random_tokens(20, 256)));
  expect_user_error("--data small.bin --val-data small.bin " + kSmall, "tokens");
  expect_user_error("--data 'none_*.bin' " + kSmall, "none_*.bin");
}

TEST_F(CliTest, BadSafetensorsFiles) {
  // Header length far past the end of the file.
  std::string huge(8, '\0');
  const uint64_t length = uint64_t{1} << 40;
  std::memcpy(huge.data(), &length, 8);
  write("huge.safetensors", huge + "{}");
  expect_user_error("--model tiny --init-from huge.safetensors " + kSmall, "huge.safetensors");
  // A header whose offsets point past the data.
  const std::string header =
      R"({"wte.weight":{"dtype":"F32","shape":[256,64],"data_offsets":[0,65536]}})";
  std::string lying(8, '\0');
  const uint64_t header_length = header.size();
  std::memcpy(lying.data(), &header_length, 8);
  write("lying.safetensors", lying + header + std::string(100, '\0'));
  expect_user_error("--model tiny --init-from lying.safetensors " + kSmall, "lying.safetensors");
  // Wrong dtype name.
  const std::string bad_dtype = R"({"wte.weight":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})";
  std::string dtype_file(8, '\0');
  const uint64_t dtype_length = bad_dtype.size();
  std::memcpy(dtype_file.data(), &dtype_length, 8);
  write("dtype.safetensors", dtype_file + bad_dtype + std::string(4, '\0'));
  expect_user_error("--model tiny --init-from dtype.safetensors " + kSmall, "Q4");
}

TEST_F(CliTest, PrepareThenTrainOnText) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox " + std::to_string(i % 17) + " jumps.\n";
  write("input.txt", text);
  Result prepared = run_dstrain("prepare --input input.txt --out shards", dir_);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  EXPECT_TRUE(fs::exists(file("shards/train_000000.bin")));
  EXPECT_TRUE(fs::exists(file("shards/val_000000.bin")));
  Result trained = run_dstrain(
      "--data 'shards/train_*.bin' --val-data 'shards/val_*.bin' --batch 2 --seq-len 32 "
      "--steps 3 --eval-every 3 --sample 16 --log log.jsonl --out ckpt",
      dir_);
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  EXPECT_NE(trained.out.find("sample"), std::string::npos) << trained.out;
  EXPECT_TRUE(fs::exists(file("ckpt/step-000003/model.safetensors")));
  EXPECT_TRUE(fs::exists(file("ckpt/latest")));
  // The log: a record per step with the fields the issue asks for, and an eval record.
  std::ifstream log(file("log.jsonl"));
  int steps = 0, evals = 0;
  for (std::string line; std::getline(log, line);) {
    if (line.find("\"loss\"") != std::string::npos && line.find("\"tokens_per_s\"") != std::string::npos &&
        line.find("\"grad_norm\"") != std::string::npos && line.find("\"lr\"") != std::string::npos) {
      ++steps;
    }
    if (line.find("\"eval_loss\"") != std::string::npos) ++evals;
  }
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(evals, 1);

  expect_user_error("prepare --input nothing.txt --out shards2", "nothing.txt");
  expect_user_error("prepare --out shards2", "--input");
  write("tiny.txt", "too small");
  expect_user_error("prepare --input tiny.txt --out shards3", "tiny.txt");
  EXPECT_FALSE(fs::exists(file("shards3/train_000000.bin")));
}

// prepare --tokenizer: the shards hold the `tokenizers` library's ids of the fixture corpus
// (tests/reference/make_tokenizer_fixtures.py), then the end-of-text id.
TEST_F(CliTest, PrepareWithTokenizerJsonWritesTheLibrarysIds) {
  const std::string fixtures = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/tokenizers/";
  Result prepared = run_dstrain("prepare --input '" + fixtures + "corpus.txt' --out shards "
                                "--tokenizer '" + fixtures + "llama3_kind.json' --eot --val-fraction 0",
                                dir_);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  EXPECT_NE(prepared.out.find("uint16 tokens, vocabulary"), std::string::npos) << prepared.out;
  EXPECT_EQ(prepared.out.find("--val-data"), std::string::npos) << "no validation shards";
  EXPECT_FALSE(fs::exists(file("shards/val_000000.bin")));
  std::ifstream expected_file(fixtures + "prepare_ids.json");
  const nlohmann::json expected = nlohmann::json::parse(expected_file)["llama3_kind"];
  std::vector<uint16_t> ids = expected["ids"].get<std::vector<uint16_t>>();
  ids.push_back(expected["eot_id"].get<uint16_t>());
  std::ifstream shard(file("shards/train_000000.bin"), std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(shard), {});
  EXPECT_EQ(bytes, llmc_shard(ids));

  write("not_json.json", "vocab: none");
  expect_user_error("prepare --input '" + fixtures + "corpus.txt' --out shards2 --tokenizer not_json.json",
                    "not valid JSON");
  EXPECT_FALSE(fs::exists(file("shards2")));
  expect_user_error("prepare --input '" + fixtures + "corpus.txt' --out shards2 --eot", "--tokenizer");
}

// The path of the README's fine-tuning section on a small scale: shards made with a
// tokenizer.json, a LLaMA model from a config.json, and the sample decoded with the tokenizer:
// the prompt (the first 8 validation tokens) shows as the text they stand for.
TEST_F(CliTest, SampleIsDecodedWithTheTokenizerOfTheRun) {
  const std::string fixtures = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/tokenizers/";
  const std::string tokenizer = fixtures + "qwen2_kind.json";
  Result prepared = run_dstrain("prepare --input '" + fixtures + "corpus.txt' --out shards "
                                "--tokenizer '" + tokenizer + "' --eot", dir_);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  write("config.json", R"({"model_type": "qwen2", "vocab_size": 700, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": true})");
  Result run = run_dstrain("--model config.json --data 'shards/train_*.bin' "
                           "--val-data 'shards/val_*.bin' --batch 2 --seq-len 32 --steps 2 "
                           "--eval-every 0 --sample 12 --tokenizer '" + tokenizer + "'", dir_);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::ifstream shard(file("shards/val_000000.bin"), std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(shard), {});
  std::vector<int32_t> prompt(8);
  for (size_t i = 0; i < prompt.size(); ++i) {
    uint16_t id;
    std::memcpy(&id, bytes.data() + 1024 + 2 * i, 2);
    prompt[i] = id;
  }
  const std::string text = dstrain::BpeTokenizer::from_file(tokenizer).decode(prompt);
  ASSERT_GT(text.size(), 8u);
  // The prompt on a line of its own: where it ends and the sampled text begins is plain.
  EXPECT_NE(run.out.find("sampled):\n    prompt:  " + text + "\n    sampled: "), std::string::npos)
      << text << "\n" << run.out;
  expect_user_error("--model config.json --data 'shards/train_*.bin' --steps 1 --tokenizer nope.json",
                    "nope.json");
}

// The step records' losses of a JSONL log, in order.
std::vector<double> logged_losses(const fs::path& log) {
  std::vector<double> losses;
  std::ifstream file(log);
  for (std::string line; std::getline(file, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.contains("loss") && !record.contains("type")) losses.push_back(record["loss"]);
  }
  return losses;
}

// --config: flags from a `flag = value` file under the command line's; every run with --out
// writes OUT/run_config.json, and --config with it repeats the run to the bit.
TEST_F(CliTest, ConfigFilesAndRunConfigRepeatARun) {
  write("run.cfg", "# a run kept as a file\nbatch = 4\nseq-len = 32\nsteps = 5\nlr = 0.01\n"
                   "eval-every = 0\nsample = 0\nzero = 1\ngpus = 2\noffload = true\n");
  Result first = run_dstrain("--config run.cfg --steps 3 --out run --log log.jsonl --device cpu", dir_);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const std::vector<double> losses = logged_losses(file("log.jsonl"));
  ASSERT_EQ(losses.size(), 3u) << "the command line's --steps wins";
  const nlohmann::json saved = nlohmann::json::parse(std::ifstream(file("run/run_config.json")));
  EXPECT_EQ(saved["batch"], 4);
  EXPECT_EQ(saved["steps"], 3);
  EXPECT_EQ(saved["gpus"], 2);
  EXPECT_EQ(saved["offload"], "optimizer");  // --offload's word for `offload = true`
  EXPECT_EQ(saved["lr"], 0.01);

  Result again = run_dstrain("--config run/run_config.json --out run2 --log log2.jsonl", dir_);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(logged_losses(file("log2.jsonl")), losses);
  EXPECT_TRUE(fs::exists(file("run2/run_config.json")));

  write("bad_key.json", R"({"batch": 4, "bacth": 8})");
  expect_user_error("--config bad_key.json", "\"bacth\" is not a dstrain flag");
  write("bad_switch.json", R"({"shuffle": "yes"})");
  expect_user_error("--config bad_switch.json", "switch");
  write("bad_offload.json", R"({"offload": "sometimes"})");
  expect_user_error("--config bad_offload.json",
                    "--offload takes optimizer, params, all or none (on and off: optimizer and "
                    "none), not 'sometimes'");
  write("bad.json", "{\"batch\": ");
  expect_user_error("--config bad.json", "not valid JSON");
  write("bad.cfg", "batch = many\n");
  expect_user_error("--config bad.cfg", "bad.cfg");
  expect_user_error("--config missing.cfg", "missing.cfg");
}

// --deepspeed-config: a DeepSpeed user's fp16 ZeRO-2 config trains, the mapping is printed,
// the scaler starts at 2^initial_scale_power, and the command line wins over the file.
TEST_F(CliTest, DeepSpeedConfigTrainsWithItsSettings) {
  write("ds_config.json", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
      "zero_optimization": {"stage": 2, "overlap_comm": true},
      "fp16": {"enabled": true, "initial_scale_power": 10, "hysteresis": 3},
      "optimizer": {"type": "Adam", "params": {"lr": 0.002, "weight_decay": 0.05}},
      "gradient_clipping": 0.5})");
  Result run = run_dstrain("--deepspeed-config ds_config.json --gpus 2 --lr 0.001 --seq-len 32 "
                           "--steps 3 --eval-every 0 --sample 0 --device cpu --log log.jsonl", dir_);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("zero_optimization.stage -> --zero 2"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zero_optimization.overlap_comm: no effect"), std::string::npos);
  std::ifstream log(file("log.jsonl"));
  nlohmann::json config, first_step;
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.value("type", "") == "config") config = record;
    if (record.contains("loss") && first_step.is_null()) first_step = record;
  }
  ASSERT_FALSE(config.is_null());
  EXPECT_EQ(config["plan"]["zero"], 2) << config.dump();
  EXPECT_EQ(config["plan"]["grad_accum"], 2) << "16 = 4 x accumulation x 2 ranks";
  EXPECT_EQ(first_step["loss_scale"], 1024.0) << first_step.dump();
  // --lr on the command line wins over optimizer.params.lr (first warmup step: lr / 20).
  EXPECT_NEAR(first_step["lr"].get<double>(), 0.001 / 20, 1e-12) << first_step.dump();
  // The most common scheduler block, as DeepSpeed's docs write it: WarmupLR with its default
  // log warmup, DeepSpeed's learning rates step for step (lr_schedules.py: steps 1, 2 at
  // warmup_min_lr, then min + (max - min) * ln(i + 1) / ln(4), i = step - 2).
  write("warmup.json", R"({"train_micro_batch_size_per_gpu": 2,
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0001,
                                                   "warmup_max_lr": 0.01,
                                                   "warmup_num_steps": 4}}})");
  Result warm = run_dstrain("--deepspeed-config warmup.json --seq-len 16 --steps 6 --eval-every 0 "
                            "--sample 0 --device cpu --log warm.jsonl", dir_);
  ASSERT_EQ(warm.exit_code, 0) << warm.err;
  std::vector<double> rates;
  std::ifstream warm_log(file("warm.jsonl"));
  for (std::string line; std::getline(warm_log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.contains("loss")) rates.push_back(record["lr"].get<double>());
  }
  const std::vector<double> deepspeed = {1e-4, 1e-4, 1e-4 + (0.01 - 1e-4) * std::log(2.0) / std::log(4.0),
                                         1e-4 + (0.01 - 1e-4) * std::log(3.0) / std::log(4.0),
                                         0.01, 0.01};
  ASSERT_EQ(rates.size(), deepspeed.size());
  for (size_t i = 0; i < rates.size(); ++i) EXPECT_NEAR(rates[i], deepspeed[i], 1e-15) << i;
  expect_user_error("--deepspeed-config missing.json", "missing.json");
  write("nvme.json", R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})");
  expect_user_error("--deepspeed-config nvme.json", "offload_optimizer.device");
}

// The two DeepSpeed configs our users start from run verbatim (issue 31): ZeRO-3 fp16 with the
// optimizer and the parameters on the CPU, and the same without offload_param ("loss_scale": 0,
// dynamic). Offloading the parameters changes where bytes live, not one bit of the losses.
TEST_F(CliTest, DeepSpeedZero3OffloadConfigsRunVerbatim) {
  write("ds_all.json", R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu"}}, "fp16": {"enabled": true}, "steps_per_print": 10,
      "wall_clock_breakdown": false})");
  write("ds_optimizer.json", R"({"train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true}},
      "fp16": {"enabled": true, "loss_scale": 0}, "steps_per_print": 10,
      "wall_clock_breakdown": false})");
  std::vector<std::vector<double>> losses;
  for (const std::string name : {"all", "optimizer"}) {
    Result run = run_dstrain("--deepspeed-config ds_" + name + ".json --gpus 2 --seq-len 16 "
                             "--steps 3 --eval-every 0 --sample 0 --device cpu --log " + name +
                             ".jsonl", dir_);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    EXPECT_NE(run.out.find("-> --offload " + name), std::string::npos) << run.out;
    std::ifstream log(file(name + ".jsonl"));
    nlohmann::json config;
    losses.emplace_back();
    for (std::string line; std::getline(log, line);) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (record.value("type", "") == "config") config = record;
      if (record.contains("loss")) losses.back().push_back(record["loss"]);
    }
    EXPECT_EQ(config["plan"]["zero"], 3) << config.dump();
    EXPECT_EQ(config["plan"]["precision"], "fp16");
    EXPECT_EQ(config["plan"]["offload"], true);
    EXPECT_EQ(config["plan"]["offload_params"], name == "all");
  }
  EXPECT_EQ(losses[0].size(), 3u);
  EXPECT_EQ(losses[0], losses[1]);
  // bf16 optimizer states are the host AdamW's: without the optimizer offloaded, one sentence.
  expect_user_error("--device cpu --steps 1 --bf16-optimizer-states",
                    "--bf16-optimizer-states keeps the Adam moments in bf16 for the host's "
                    "AdamW: it needs --offload optimizer or --offload all");
}

TEST_F(CliTest, SyntheticRunLogsEntropyFloor) {
  Result result = run_dstrain("--batch 4 --seq-len 32 --steps 2 --eval-every 2 --sample 8 --log log.jsonl", dir_);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("synthetic corpus"), std::string::npos) << result.out;
  std::ifstream log(file("log.jsonl"));
  std::stringstream all;
  all << log.rdbuf();
  EXPECT_NE(all.str().find("\"entropy_floor\""), std::string::npos);
  EXPECT_NE(all.str().find("\"type\":\"memory\""), std::string::npos);
}

TEST_F(CliTest, TrainingTakesThePlannersPlan) {
  const std::string fixture = std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/";
  // 8 x RTX 4090: the planner chooses, the CPU backend runs it on 8 simulated ranks, and the
  // prediction per GPU is what the allocator then reports (both printed).
  Result result = run_dstrain("--from-nvidia-smi " + fixture + "rtx4090-8gpu-pcie.txt --gpu rtx4090 "
                              "--host-memory 256G --device cpu --batch 4 --steps 2 --eval-every 0 "
                              "--sample 0 --log log.jsonl", dir_);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("plan for 8 x NVIDIA GeForce RTX 4090"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("8 ranks"), std::string::npos) << result.out;
  // A described machine is not this one: its plan runs only on simulated ranks (--device cpu).
  expect_user_error("--from-nvidia-smi " + fixture + "rtx4090-8gpu-pcie.txt --gpu rtx4090 "
                    "--host-memory 256G --steps 1", "--device cpu");
  // A fixed plan that cannot fit says by how much.
  expect_user_error("--model 13b --zero 0 --pp 1 --from-nvidia-smi " + fixture + "rtx4090-8gpu-pcie.txt "
                    "--gpu rtx4090 --host-memory 256G --device cpu --steps 1", "GiB");
  // On NVLink pairs the planner fills in a plan around --tp 2, and it runs as chosen: 4 ranks,
  // each layer split over 2 of them.
  Result tp = run_dstrain("--from-nvidia-smi " + fixture + "rtx3090-4gpu-nvlink-pairs.txt --gpu "
                          "rtx3090 --host-memory 256G --device cpu --tp 2 --batch 4 --steps 2 "
                          "--eval-every 0 --sample 0", dir_);
  ASSERT_EQ(tp.exit_code, 0) << tp.err;
  EXPECT_NE(tp.out.find("dp 2 x tp 2 x pp 1 (sequence parallel)"), std::string::npos) << tp.out;
  EXPECT_NE(tp.out.find("tensor parallel: each layer split over 2 ranks"), std::string::npos)
      << tp.out;
  // The tiny model's 4 heads do not split 3 ways.
  expect_user_error("--tp 3 --gpus 3 --device cpu " + kSmall, "n_head (4) divisible by 3");
}

TEST_F(CliTest, RanksAndPlanFlags) {
  // 4 simulated ranks on the CPU backend, whatever GPUs this machine has.
  Result result = run_dstrain(
      "--device cpu --gpus 4 --zero 3 --offload --recompute full --precision fp16 " + kSmall, dir_);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("4 ranks"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("ZeRO-3"), std::string::npos) << result.out;
  expect_user_error("--zero 4 " + kSmall, "--zero");
  expect_user_error("--recompute some " + kSmall, "--recompute");
  expect_user_error("--gpus 0 " + kSmall, "--gpus");
  if (dstrain::usable_cuda_devices() == 0) {
    expect_user_error("--device cuda " + kSmall, "CUDA");
  } else {
    Result on_gpu = run_dstrain("--device cuda " + kSmall, dir_);
    EXPECT_EQ(on_gpu.exit_code, 0) << on_gpu.err;
  }
}

}  // namespace
