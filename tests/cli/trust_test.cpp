// Runs a user can trust, through the binary as a user meets it: a run never destroys an earlier
// one (--out, --log, --overwrite, --resume auto, --keep-last), --init-from DIR is that model and
// the checkpoints are complete Hugging Face directories (tokenizer, generation config, the
// source's dtype), fine-tuning defaults (the model's context, --epochs, the learning rate),
// extending a run keeps its learning-rate curve, and a run resumes on other ranks and
// micro-batches on the one-rank curve.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "tests/common/jsonl_log.h"
#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using dstrain::testing::BinaryResult;
using dstrain::testing::read_jsonl;
using dstrain::testing::step_losses;
using dstrain::testing::step_records;

const std::string kTiny = "--batch 2 --seq-len 16 --eval-every 0 --sample 0 --quiet --threads 2";
const std::string kFixtures = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/";

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

class TrustTest : public ::testing::Test {
 protected:
  fs::path path(const std::string& name) const { return temp_.path() / name; }
  // On CPU ranks (the emulator's build would otherwise take its emulated GPU, a machine of
  // another plan), unless the command names a device or is one that trains nothing.
  BinaryResult run(const std::string& args) const {
    const bool named = args.find("--device") != std::string::npos || args.rfind("plan ", 0) == 0 ||
                       args.rfind("verify ", 0) == 0;
    return dstrain::testing::run_binary(DSTRAIN_BINARY, args + (named ? "" : " --device cpu"),
                                        temp_.path());
  }
  // Exit 0; what it printed otherwise.
  BinaryResult run_ok(const std::string& args) const {
    BinaryResult result = run(args);
    EXPECT_EQ(result.exit_code, 0) << args << "\n" << result.out << result.err;
    return result;
  }
  void write(const std::string& name, const std::string& bytes) const {
    fs::create_directories(path(name).parent_path());
    std::ofstream(path(name), std::ios::binary) << bytes;
  }
  // Exit code 2 and exactly one line "dstrain: error: ..." holding `fragment`.
  void expect_user_error(const std::string& args, const std::string& fragment) const {
    dstrain::testing::expect_one_sentence(run(args), args, fragment);
  }
  std::vector<std::string> step_dirs(const std::string& run) const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path(run))) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("step-")) names.push_back(name);
    }
    std::sort(names.begin(), names.end());
    return names;
  }
  // An llm.c uint16 shard of `count` random tokens below `vocab`.
  void write_shard(const std::string& name, size_t count, uint16_t vocab, uint64_t seed = 7) const {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 1;
    header[2] = static_cast<int32_t>(count);
    std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
    for (size_t i = 0; i < count; ++i) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      const uint16_t token = static_cast<uint16_t>((seed >> 33) % vocab);
      bytes.append(reinterpret_cast<const char*>(&token), 2);
    }
    write(name, bytes);
  }
  // A Hugging Face model directory as the hub has them: transformers' tiny Qwen2 (BF16
  // weights, generation_config.json) with a tokenizer beside it.
  void write_hf_model(const std::string& name) const {
    fs::create_directories(path(name));
    for (const char* file : {"config.json", "model.safetensors", "generation_config.json"}) {
      fs::copy_file(kFixtures + "qwen2_tiny/" + file, path(name) / file);
    }
    fs::copy_file(kFixtures + "tokenizers/qwen2_kind.json", path(name) / "tokenizer.json");
    write(name + "/tokenizer_config.json",
          R"({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>"})");
    write(name + "/special_tokens_map.json", R"({"eos_token": "<|endoftext|>"})");
  }
  dstrain::testing::TempDir temp_;
};

// ---- 1. A run never destroys an earlier one ----------------------------------------------

TEST_F(TrustTest, TheSameCommandTwiceDoesNotDestroyTheFirstRun) {
  const std::string command = "--steps 2 --out run --log run.jsonl " + kTiny;
  run_ok(command);
  const std::string weights = read_file(path("run/step-000002/model.safetensors"));
  const std::string log = read_file(path("run.jsonl"));
  ASSERT_GT(weights.size(), 1000u);
  expect_user_error(command,
                    "--out run already holds an earlier run (1 checkpoint, the newest "
                    "step-000002): continue that run with --resume run, start over there with "
                    "--overwrite, or give a new --out");
  EXPECT_EQ(read_file(path("run/step-000002/model.safetensors")), weights);
  EXPECT_EQ(read_file(path("run.jsonl")), log);
  // A log that exists is refused for a new run, before --out is made.
  expect_user_error("--steps 2 --out other --log run.jsonl " + kTiny,
                    "--log run.jsonl already exists: a resumed run (--resume) appends to it");
  EXPECT_FALSE(fs::exists(path("other")));
  EXPECT_EQ(read_file(path("run.jsonl")), log);
  // A directory of other things is not a place to write checkpoints into either.
  write("notes/readme.txt", "mine");
  expect_user_error("--steps 1 --out notes " + kTiny, "--out notes already holds readme.txt");
  // --overwrite starts over: the earlier checkpoints go, other files stay, the log is new.
  write("run/keep.txt", "mine");
  const BinaryResult again = run_ok(command + " --overwrite --seed 5");
  EXPECT_NE(again.out.find("--overwrite: removed the earlier run in run (1 checkpoint; its "
                           "other files stay: keep.txt)"),
            std::string::npos)
      << again.out;
  EXPECT_TRUE(fs::exists(path("run/keep.txt")));
  EXPECT_NE(read_file(path("run/step-000002/model.safetensors")), weights) << "a new run";
  const auto records = read_jsonl(path("run.jsonl"));
  EXPECT_EQ(step_records(records).size(), 2u) << "the log was replaced, not appended to";
}

TEST_F(TrustTest, ResumeAutoStartsOrContinuesTheSameCommand) {
  // What a job scheduler restarts: the same command, a longer --steps the second time.
  const std::string job = "--resume auto --out job --log job.jsonl --save-every 2 " + kTiny;
  const BinaryResult first = run_ok(job + " --steps 2");
  EXPECT_NE(first.out.find("no checkpoint in job yet: the run starts there"), std::string::npos)
      << first.out;
  const BinaryResult second = run_ok(job + " --steps 4");
  EXPECT_NE(second.out.find("resuming job/step-000002"), std::string::npos) << second.out;
  // The log continued; the run equals one of 4 steps on the first start's schedule.
  run_ok("--steps 4 --lr-decay-steps 2 --out straight --log straight.jsonl " + kTiny);
  EXPECT_EQ(step_losses(path("job.jsonl")), step_losses(path("straight.jsonl")));
  EXPECT_EQ(read_file(path("job/step-000004/model.safetensors")),
            read_file(path("straight/step-000004/model.safetensors")));
  // --resume DIR that holds no checkpoint yet starts the run there.
  run_ok("--resume fresh --steps 1 " + kTiny);
  EXPECT_TRUE(fs::exists(path("fresh/step-000001/model.safetensors")));
  expect_user_error("--resume auto --steps 1 " + kTiny, "--resume auto continues the run in --out");
  expect_user_error("--resume job --overwrite --steps 6 " + kTiny,
                    "--overwrite starts the run over and --resume continues it");
  expect_user_error("--resume job/step-000009 --steps 6 " + kTiny, "no such checkpoint");
  // An older checkpoint of the run would overwrite the newer ones in place: branch elsewhere.
  expect_user_error("--resume job/step-000002 --steps 6",
                    "--resume job/step-000002 is older than the run's newest checkpoint, "
                    "step-000004, which its steps would replace: give a new --out");
  run_ok("--resume job/step-000002 --steps 3 --out branch --log branch.jsonl");
  EXPECT_TRUE(fs::exists(path("branch/step-000003/model.safetensors")));
  EXPECT_TRUE(fs::exists(path("job/step-000004/model.safetensors")));
}

TEST_F(TrustTest, KeepLastKeepsTheNewestCheckpoints) {
  run_ok("--steps 5 --save-every 1 --keep-last 2 --out run " + kTiny);
  EXPECT_EQ(step_dirs("run"), (std::vector<std::string>{"step-000004", "step-000005"}));
  EXPECT_EQ(fs::read_symlink(path("run/latest")), "step-000005");
  // Remembered on resume.
  run_ok("--resume run --steps 7");
  EXPECT_EQ(step_dirs("run"), (std::vector<std::string>{"step-000006", "step-000007"}));
  expect_user_error("--steps 2 --keep-last 2 " + kTiny, "--keep-last needs --out");
}

// A run killed while saving (SIGKILL, the OOM killer, a node lost) leaves its staging directory;
// resuming there removes it, saying so, and the run goes on.
TEST_F(TrustTest, ResumeRemovesTheHalfWrittenCheckpointOfAKilledRun) {
  run_ok("--steps 2 --out run " + kTiny);
  write("run/.tmp-step-000003-999999/model.safetensors", "half written");
  const BinaryResult resumed = run_ok("--resume run --steps 3");
  EXPECT_NE(resumed.out.find("removed " + path("run/.tmp-step-000003-999999").string() +
                             ", a checkpoint that a run stopped while saving left half-written"),
            std::string::npos)
      << resumed.out;
  EXPECT_FALSE(fs::exists(path("run/.tmp-step-000003-999999")));
  EXPECT_EQ(step_dirs("run"), (std::vector<std::string>{"step-000002", "step-000003"}));
}

// Every checkpoint records its files' CRC-32 (checksums.json); `dstrain verify` reads one back.
// A damaged file is named, by verify and by --resume, which also names the newest whole
// checkpoint; its advice works. --keep-last verifies before it removes.
TEST_F(TrustTest, CheckpointsAreVerifiedAndADamagedOneIsNamed) {
  run_ok("--steps 2 --save-every 1 --out run " + kTiny);
  EXPECT_NE(run_ok("verify run").out.find("step-000002: whole (4 files, "), std::string::npos);
  EXPECT_NE(run_ok("verify run/step-000001").out.find("whole"), std::string::npos);
  // Sharded, written by 4 ranks (tp 2 x dp 2, ZeRO-3): every shard's parts combine.
  run_ok("--steps 1 --gpus 4 --tp 2 --zero 3 --save-shard-size 100KB --out sharded " + kTiny);
  EXPECT_NE(run_ok("verify sharded").out.find("step-000001: whole ("), std::string::npos);
  EXPECT_TRUE(fs::exists(path("sharded/step-000001/model.safetensors.index.json")));

  std::string optimizer = read_file(path("run/step-000002/optimizer.safetensors"));
  optimizer[optimizer.size() / 2] ^= 1;
  write("run/step-000002/optimizer.safetensors", optimizer);
  expect_user_error("verify run",
                    "checkpoint run/step-000002 is damaged: optimizer.safetensors has CRC-32 ");
  const std::string whole = path("run/step-000001").string();
  expect_user_error("--resume run --steps 3",
                    "is damaged: optimizer.safetensors has CRC-32 ");
  expect_user_error("--resume run --steps 3", "; the newest whole one is " + whole +
                                                  ": remove the damaged one and continue with "
                                                  "--resume " + whole);
  fs::remove_all(path("run/step-000002"));
  run_ok("--resume " + whole + " --steps 3");  // --save-every 1 remembered: steps 2 and 3 again
  EXPECT_EQ(step_dirs("run"),
            (std::vector<std::string>{"step-000001", "step-000002", "step-000003"}));
  EXPECT_NE(run_ok("verify run").out.find("step-000003: whole"), std::string::npos);
  const BinaryResult kept = run_ok("--steps 3 --save-every 1 --keep-last 1 --out kept " + kTiny);
  EXPECT_NE(kept.out.find("(verified; --keep-last 1: removed 1 older checkpoint)"),
            std::string::npos)
      << kept.out;
  expect_user_error("verify nowhere", "nowhere holds no checkpoint");
}

// --mirror DIR: every checkpoint in a second place, the same bytes, read back whole, its own
// `latest` and --keep-last. With --out lost, the mirror's copy continues the run to the bits of
// the uninterrupted one; a damaged checkpoint in --out names the mirror's copy, and its advice
// works. A mirror that cannot be written is said and the run goes on.
TEST_F(TrustTest, MirrorKeepsASecondVerifiedCopyThatResumes) {
  const BinaryResult first =
      run_ok("--steps 4 --lr-decay-steps 6 --save-every 1 --keep-last 2 --out run --mirror copy "
             "--log run.jsonl " + kTiny);
  EXPECT_EQ(step_dirs("copy"), (std::vector<std::string>{"step-000003", "step-000004"}));
  EXPECT_EQ(step_dirs("run"), step_dirs("copy"));
  EXPECT_EQ(fs::read_symlink(path("copy/latest")), "step-000004");
  for (const auto& entry : fs::directory_iterator(path("run/step-000004"))) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(read_file(entry.path()) == read_file(path("copy/step-000004") / name)) << name;
  }
  EXPECT_NE(first.out.find("(verified; --keep-last 2: removed 1 older checkpoint); mirrored to "
                           "copy/step-000004 (verified, "),
            std::string::npos)
      << first.out;
  EXPECT_NE(run_ok("verify copy").out.find("step-000004: whole"), std::string::npos);
  expect_user_error("--steps 1 --out other --mirror copy " + kTiny,
                    "--mirror copy already holds an earlier run (2 checkpoints, the newest "
                    "step-000004): continue that run with --resume copy");
  expect_user_error("--steps 1 --out same --mirror same " + kTiny, "--mirror same is --out itself");
  expect_user_error("--steps 1 --mirror elsewhere " + kTiny,
                    "--mirror copies the checkpoints of --out: give --out DIR");

  // --out lost: the mirror's copy goes on (--mirror remembered), as the run would have.
  run_ok("--steps 6 --lr-decay-steps 6 --out straight --log straight.jsonl " + kTiny);
  fs::remove_all(path("run"));
  run_ok("--resume copy/step-000004 --steps 6 --out run --log run.jsonl");
  EXPECT_EQ(step_dirs("copy"), (std::vector<std::string>{"step-000005", "step-000006"}));
  expect_user_error("--resume copy/step-000005 --steps 7 --out branch",
                    "--mirror copy holds step-000006, newer than the checkpoint resumed");
  EXPECT_FALSE(fs::exists(path("branch")));
  EXPECT_TRUE(read_file(path("run/step-000006/model.safetensors")) ==
              read_file(path("straight/step-000006/model.safetensors")));
  const std::vector<double> losses = step_losses(path("run.jsonl")),
                            straight = step_losses(path("straight.jsonl"));
  ASSERT_EQ(straight.size(), 6u);
  EXPECT_EQ(std::vector<double>(losses.end() - 2, losses.end()),
            std::vector<double>(straight.end() - 2, straight.end()));

  // The checkpoint in --out damaged: --resume names the mirror's copy; copied back, it resumes.
  std::string weights = read_file(path("run/step-000006/model.safetensors"));
  weights[weights.size() - 5] ^= 4;
  write("run/step-000006/model.safetensors", weights);
  const std::string copy = path("copy/step-000006").string(), back = path("run").string();
  expect_user_error("--resume run --mirror copy --steps 7",
                    "model.safetensors has CRC-32 ");
  expect_user_error("--resume run --mirror copy --steps 7",
                    "; the newest whole one is --mirror's copy " + copy +
                        ": remove the damaged one, copy that back (cp -r " + copy + " " + back +
                        "/) and continue with --resume " + back + "/step-000006");
  fs::remove_all(path("run/step-000006"));
  fs::copy(path("copy/step-000006"), path("run/step-000006"), fs::copy_options::recursive);
  run_ok("--resume run/step-000006 --steps 7");

  // A mirror that cannot be written: said on the save's line; the run and --out go on.
  write("blocker", "a file where the mirror's directory would be");
  const BinaryResult blocked = run_ok("--steps 2 --out alone --mirror blocker/m " + kTiny);
  EXPECT_NE(blocked.out.find("saved checkpoint alone/step-000002 (verified); NOT mirrored: "
                             "cannot create directory"),
            std::string::npos)
      << blocked.out;
  EXPECT_EQ(step_dirs("alone"), (std::vector<std::string>{"step-000002"}));
}

// ---- 2 and 5. --init-from DIR is that model; complete Hugging Face output ----------------

// A model whose code ships with its checkpoints (DeepSeek-V3: config.json's auto_map names
// configuration_deepseek.py and modeling_deepseek.py, trust_remote_code): the checkpoint holds
// them too, and not what names another repository or a path.
TEST_F(TrustTest, CheckpointsKeepTheModelCodeAutoMapNames) {
  fs::create_directories(path("v3"));
  nlohmann::json config =
      nlohmann::json::parse(read_file(kFixtures + "deepseek_v3_tiny/config.json"));
  config["auto_map"] = {{"AutoConfig", "configuration_deepseek.DeepseekV3Config"},
                        {"AutoModel", "modeling_deepseek.DeepseekV3Model"},
                        {"AutoModelForCausalLM", "modeling_deepseek.DeepseekV3ForCausalLM"},
                        {"AutoTokenizer", {"other/repo--tokenization.Tok", nullptr}},
                        {"AutoFeature", "../outside.Class"}};
  write("v3/config.json", config.dump(2));
  fs::copy_file(kFixtures + "deepseek_v3_tiny/model.safetensors", path("v3/model.safetensors"));
  write("v3/configuration_deepseek.py", "# DeepSeek's configuration\n");
  write("v3/modeling_deepseek.py", "# DeepSeek's model\n");
  write("outside.py", "# not the model's\n");
  write_shard("train.bin", 2000, 67);
  run_ok("--init-from v3 --data train.bin --steps 1 --out ft " + kTiny);
  const fs::path step = path("ft/step-000001");
  for (const char* file : {"configuration_deepseek.py", "modeling_deepseek.py"}) {
    EXPECT_EQ(read_file(step / file), read_file(path("v3") / file)) << file;
  }
  EXPECT_FALSE(fs::exists(step / "outside.py"));
  EXPECT_FALSE(fs::exists(step / "tokenization.py"));
  const nlohmann::json saved = nlohmann::json::parse(read_file(step / "config.json"));
  EXPECT_EQ(saved["auto_map"], config["auto_map"]);
}

TEST_F(TrustTest, InitFromADirectoryIsThatModelAndItsCheckpointsAreWhole) {
  write_hf_model("qwen");
  write_shard("train.bin", 2000, 97);
  const std::string tune = "--init-from qwen --data train.bin --seq-len 16 --batch 2 --eval-every 0 "
                           "--sample 0 --quiet --threads 2";
  const BinaryResult tuned = run_ok(tune + " --steps 4 --save-every 2 --out ft");
  // Every tensor of the model; the fixture's tied lm_head.weight is the embedding's copy.
  const size_t tensors =
      dstrain::SafetensorsFile::open(kFixtures + "qwen2_tiny/model.safetensors").names().size() - 1;
  EXPECT_NE(tuned.out.find("loaded " + std::to_string(tensors) + " tensors, "), std::string::npos)
      << tuned.out;
  EXPECT_NE(tuned.out.find(" BF16, from one file of qwen"), std::string::npos) << tuned.out;
  EXPECT_NE(tuned.out.find("fine-tuning a LLaMA-family model at --lr 2e-05"), std::string::npos);
  // The checkpoint: the source's dtype, its config saying so, the tokenizer and generation
  // config beside it.
  const fs::path step = path("ft/step-000004");
  const nlohmann::json config = nlohmann::json::parse(read_file(step / "config.json"));
  EXPECT_EQ(config["torch_dtype"], "bfloat16");
  EXPECT_EQ(config["model_type"], "qwen2");
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "generation_config.json"}) {
    EXPECT_EQ(read_file(step / file), read_file(path("qwen") / file)) << file;
  }
  const dstrain::SafetensorsFile weights = dstrain::SafetensorsFile::open(step / "model.safetensors");
  const dstrain::SafetensorsFile optimizer =
      dstrain::SafetensorsFile::open(step / "optimizer.safetensors");
  EXPECT_EQ(weights.names().size(), tensors);
  for (const std::string& name : weights.names()) {
    ASSERT_EQ(weights.info(name).dtype, dstrain::DType::BF16) << name;
    // The bf16 weights are the fp32 masters rounded to nearest even.
    const std::vector<float> master = optimizer.read_f32(name + ".master");
    const std::vector<float> stored = weights.read_f32(name);
    ASSERT_EQ(master.size(), stored.size());
    for (size_t i = 0; i < master.size(); ++i) {
      ASSERT_EQ(dstrain::fp32_to_bf16_bits(master[i]), dstrain::fp32_to_bf16_bits(stored[i]))
          << name << "[" << i << "]";
    }
  }
  // A resume continues from the fp32 masters: the same bits as the uninterrupted run.
  run_ok("--resume ft/step-000002 --out resumed --steps 4");
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(read_file(path("resumed/step-000004") / file), read_file(step / file)) << file;
  }
  EXPECT_EQ(read_file(path("resumed/step-000004/tokenizer.json")), read_file(step / "tokenizer.json"));
  // --save-dtype fp32; the weights file alone names its directory's model too.
  run_ok("--init-from qwen/model.safetensors --data train.bin --seq-len 16 --batch 2 --steps 1 "
         "--eval-every 0 --sample 0 --quiet --save-dtype fp32 --out fp32");
  const nlohmann::json fp32 = nlohmann::json::parse(read_file(path("fp32/step-000001/config.json")));
  EXPECT_EQ(fp32["torch_dtype"], "float32");
  const dstrain::SafetensorsFile fp32_weights =
      dstrain::SafetensorsFile::open(path("fp32/step-000001/model.safetensors"));
  EXPECT_EQ(fp32_weights.info(fp32_weights.names()[0]).dtype, dstrain::DType::F32);
  // Weights without a config.json say what is missing.
  fs::create_directories(path("bare"));
  fs::copy_file(path("qwen/model.safetensors"), path("bare/model.safetensors"));
  expect_user_error("--init-from bare --data train.bin --steps 1 " + kTiny,
                    "--init-from bare has no config.json beside its weights: give --model");
  // A start that fails on its weights leaves --out alone: the same command, fixed, runs.
  fs::create_directories(path("broken"));
  fs::copy_file(path("qwen/config.json"), path("broken/config.json"));
  write("broken/model.safetensors", "not safetensors");
  expect_user_error("--init-from broken --data train.bin --steps 1 --out tuned " + kTiny,
                    "broken/model.safetensors");
  EXPECT_FALSE(fs::exists(path("tuned")));
  run_ok("--init-from qwen --data train.bin --steps 1 --out tuned " + kTiny);
  expect_user_error("--init-from qwen --save-dtype fp8 --data train.bin --steps 1 " + kTiny,
                    "--save-dtype must be fp32, bf16, fp16 or source");
}

// ---- 3. Defaults that fit fine-tuning ----------------------------------------------------

TEST_F(TrustTest, FineTuningTrainsAtTheModelsContextForEpochs) {
  write_hf_model("qwen");
  write_shard("train.bin", 20 * 32 + 1, 97);  // 20 sequences of the model's 32 tokens
  write_shard("val.bin", 200, 97, 9);
  const std::string tune = "--init-from qwen --data train.bin --val-data val.bin --batch 2 "
                           "--eval-every 0 --sample 0 --log tune.jsonl";
  const BinaryResult tuned = run_ok(tune + " --epochs 2");
  EXPECT_NE(tuned.out.find("--seq-len 32 (the model's context)"), std::string::npos) << tuned.out;
  EXPECT_NE(tuned.out.find("an epoch is 10 steps (640 trained tokens); the run makes 2 epochs, "
                           "the data wrapping after step 10"),
            std::string::npos)
      << tuned.out;
  EXPECT_EQ(step_losses(path("tune.jsonl")).size(), 20u);
  // A learning rate far above fine-tuning's is a warning, not an error.
  const BinaryResult hot = run_ok("--init-from qwen --data train.bin --val-data val.bin --batch 2 "
                                  "--eval-every 0 --sample 0 --steps 1 --lr 0.003");
  EXPECT_NE(hot.out.find("warning: --lr 0.003 is above what LLaMA-family models (Llama, Qwen2, "
                         "DeepSeek) are usually fine-tuned at"),
            std::string::npos)
      << hot.out;
  expect_user_error(tune + " --epochs 1 --steps 3", "--steps and --epochs both say how long");
  expect_user_error(tune + " --epochs -1", "--epochs must be a positive number");
}

// ---- 4. Extending a run keeps its learning-rate curve -----------------------------------

TEST_F(TrustTest, ExtendingARunKeepsItsLearningRateCurve) {
  const std::string first = "--steps 10 --warmup 2 --lr 0.01 --min-lr 0.001 --log run.jsonl "
                            "--out run " + kTiny;
  run_ok(first);
  const BinaryResult extended = run_ok("--resume run --steps 20");
  EXPECT_NE(extended.out.find("the learning rate reaches its floor 0.001 at step 10"),
            std::string::npos)
      << extended.out;
  const auto steps = step_records(read_jsonl(path("run.jsonl")));
  ASSERT_EQ(steps.size(), 20u);
  double previous = steps[9]["lr"].get<double>();
  for (size_t i = 10; i < 20; ++i) {
    const double lr = steps[i]["lr"].get<double>();
    EXPECT_EQ(lr, 0.001) << "step " << i + 1 << " stays at the floor";
    EXPECT_LE(lr, previous) << "no jump at step " << i + 1;
    previous = lr;
  }
  // The same as one run of 20 steps whose curve ends at step 10.
  run_ok("--steps 20 --warmup 2 --lr 0.01 --min-lr 0.001 --lr-decay-steps 10 --log straight.jsonl " +
         kTiny);
  EXPECT_EQ(step_losses(path("run.jsonl")), step_losses(path("straight.jsonl")));
  // --lr-decay-steps on resume says otherwise: the cosine over 20 steps from step 11 on.
  run_ok(first.substr(0, first.find(" --log")) + " --out other " + kTiny);
  run_ok("--resume other --steps 20 --lr-decay-steps 20 --log other.jsonl");
  const auto other = step_records(read_jsonl(path("other.jsonl")));
  ASSERT_EQ(other.size(), 10u);
  const double expected = 0.001 + (0.01 - 0.001) * 0.5 * (1 + std::cos(M_PI * 8.0 / 18.0));
  EXPECT_NEAR(other[0]["lr"].get<double>(), expected, 1e-15);
}

// ---- 6. Elastic resume ------------------------------------------------------------------

// Shapes of one run: 4 sequences of 16 tokens per step, split over ranks, micro-batches,
// pipeline stages and ZeRO stages as these flags say.
const std::vector<std::string> kShapes = {
    "--gpus 1 --batch 4",
    "--gpus 1 --batch 1 --grad-accum 4",
    "--gpus 2 --batch 2",
    "--gpus 2 --pp 2 --batch 2 --grad-accum 2",
    "--gpus 4 --zero 3 --batch 1",
};
const std::string kElastic = "--seq-len 16 --eval-every 0 --sample 0 --quiet --threads 2 "
                             "--warmup 2 --lr 0.01 --lr-decay-steps 6";

// Every pair of shapes: 3 steps on the first, resumed to 6 on the second, stays on the curve
// of 6 steps on one rank (within the equivalence tolerance: the sums change order).
TEST_F(TrustTest, ResumesAcrossEveryPairOfShapesOnTheOneRankCurve) {
  run_ok("--steps 6 " + kElastic + " " + kShapes[0] + " --log reference.jsonl");
  const std::vector<double> reference = step_losses(path("reference.jsonl"));
  ASSERT_EQ(reference.size(), 6u);
  for (size_t a = 0; a < kShapes.size(); ++a) {
    const std::string first = "first" + std::to_string(a);
    run_ok("--steps 3 " + kElastic + " " + kShapes[a] + " --out " + first);
    for (size_t b = 0; b < kShapes.size(); ++b) {
      if (a == b) continue;
      const std::string pair = "pair" + std::to_string(a) + std::to_string(b);
      const BinaryResult resumed = run_ok("--resume " + first + " --steps 6 --out " + pair +
                                          " --log " + pair + ".jsonl " + kShapes[b]);
      const std::vector<double> losses = step_losses(path(pair + ".jsonl"));
      ASSERT_EQ(losses.size(), 3u) << kShapes[a] << " -> " << kShapes[b] << "\n" << resumed.out;
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_NEAR(losses[i], reference[3 + i], 2e-5 * reference[3 + i])
            << kShapes[a] << " -> " << kShapes[b] << ", step " << i + 4;
      }
    }
  }
}

TEST_F(TrustTest, ResumeOnOtherRanksPlansAnewAndKeepsWhatDefinesTheRun) {
  // The issue's two cases: a pipeline resumed on one rank; micro-batch 1 x 4 as 4 x 1.
  run_ok("--steps 2 --gpus 2 --pp 2 --batch 2 --out pipe " + kElastic);
  const BinaryResult one = run_ok("--resume pipe --gpus 1 --steps 4");
  EXPECT_NE(one.out.find("the plan is made anew for this machine (the checkpoint's was for 2 ranks)"),
            std::string::npos)
      << one.out;
  EXPECT_NE(one.out.find("dp 1 x tp 1 x pp 1"), std::string::npos) << one.out;
  run_ok("--steps 2 --batch 1 --grad-accum 4 --out micro " + kElastic);
  const BinaryResult bigger = run_ok("--resume micro --batch 4 --steps 4");
  EXPECT_NE(bigger.out.find("and the plan (the same machine)"), std::string::npos) << bigger.out;
  EXPECT_NE(bigger.out.find("micro-batch 4 x 1 accumulation"), std::string::npos) << bigger.out;
  // What defines the run stays: another global batch is one sentence naming it.
  expect_user_error("--resume micro --batch 2 --grad-accum 1 --steps 6",
                    "was trained with a global batch of 4 sequences per step, this run has 2");
  expect_user_error("--resume micro --gpus 3 --steps 6",
                    "makes each step of 4 sequences, which 3 data-parallel ranks cannot share");
  // An optimizer setting given again is taken, and said.
  const BinaryResult lower = run_ok("--resume micro --steps 6 --lr 0.001");
  EXPECT_NE(lower.out.find("--lr 0.001 (the run had 0.01) from step 5 on, as given"),
            std::string::npos)
      << lower.out;
}

// ---- 9. Memory before allocation on CPU ranks --------------------------------------------

// Under an address-space limit (ulimit -v) a run that cannot fit says so before it allocates,
// with a plan that does, and that plan runs under the same limit.
TEST_F(TrustTest, CpuRanksCheckTheirMemoryBeforeAllocating) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: under ulimit -v the "
                  "binary cannot start";
#endif
  const auto limited = [&](const std::string& args) {
    return dstrain::testing::run_binary("ulimit -v 6000000; " DSTRAIN_BINARY, args, temp_.path());
  };
  const BinaryResult huge = limited("--gpus 8 --model 6b --device cpu --steps 1");
  EXPECT_EQ(huge.exit_code, 2) << huge.err;
  EXPECT_EQ(std::count(huge.err.begin(), huge.err.end(), '\n'), 1) << huge.err;
  for (const char* fragment : {"dstrain: error: this run needs ", "of host memory on CPU ranks",
                               "the address-space limit (ulimit -v: ",
                               "no plan of these ranks fits"}) {
    EXPECT_NE(huge.err.find(fragment), std::string::npos) << fragment << " in " << huge.err;
  }
  const std::string small = "--model gpt2-124m --device cpu --steps 1 --seq-len 64 --sample 0 "
                            "--eval-every 0 --quiet";
  const BinaryResult wide = limited(small + " --gpus 4 --batch 1");
  ASSERT_EQ(wide.exit_code, 2) << wide.err;
  const size_t from = wide.err.find("; --"), to = wide.err.find(" would need ");
  ASSERT_NE(from, std::string::npos) << wide.err;
  ASSERT_NE(to, std::string::npos) << wide.err;
  // The suggestion's flags over the run's own (--gpus 4 --batch 1).
  std::map<std::string, std::string> flags = {{"--gpus", "4"}, {"--batch", "1"}};
  std::istringstream words(wide.err.substr(from + 2, to - from - 2));
  for (std::string flag, value; words >> flag >> value;) flags[flag] = value;
  std::string fits;
  for (const auto& [flag, value] : flags) fits += " " + flag + " " + value;
  const BinaryResult fitted = limited(small + fits);
  EXPECT_EQ(fitted.exit_code, 0) << fits << "\n" << fitted.err;
  // dstrain plan --device cpu names a plan, with the flags that run it.
  const BinaryResult plan = run_ok("plan --device cpu --model tiny --gpus 2");
  EXPECT_NE(plan.out.find("run it with: dstrain --model tiny --device cpu --gpus 2 --batch 16"),
            std::string::npos)
      << plan.out;
}

}  // namespace
