// Fine-tuning on conversations through the binary: prepare --chat with a model directory's
// tokenizer and chat template, --show, training on the shards (the masks found beside them),
// and --tensorboard's event files read back by tensorboard's own reader against the --log.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/common/jsonl_log.h"
#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using dstrain::testing::BinaryResult;

const std::string kChat = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/chat/";
const std::string kReader =
    std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/read_tensorboard.py";

class ChatCliTest : public ::testing::Test {
 protected:
  fs::path path(const std::string& name) const { return temp_.path() / name; }
  BinaryResult run(const std::string& args) const {
    return dstrain::testing::run_binary(DSTRAIN_BINARY, args, temp_.path());
  }
  BinaryResult run_ok(const std::string& args) const {
    BinaryResult result = run(args);
    EXPECT_EQ(result.exit_code, 0) << args << "\n" << result.out << result.err;
    return result;
  }
  // 60 conversations: a system prompt on some, one to three user/assistant turns.
  void write_conversations() const {
    std::ofstream out(path("chat.jsonl"));
    for (int i = 0; i < 60; ++i) {
      out << R"({"messages": [)";
      if (i % 3 == 0) out << R"({"role": "system", "content": "Answer briefly."}, )";
      for (int t = 0; t <= i % 3; ++t) {
        out << (t ? ", " : "") << R"({"role": "user", "content": "what is )" << i << " plus " << t
            << R"(?"}, {"role": "assistant", "content": "it is )" << i + t << R"(."})";
      }
      out << "]}\n";
    }
  }
  // A tiny Llama whose vocabulary covers the fixture tokenizers' (420 + added tokens).
  void write_model() const {
    fs::create_directories(path("model"));
    std::ofstream(path("model/config.json")) << R"({"model_type": "llama", "vocab_size": 448,
      "max_position_embeddings": 512, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
  }
  dstrain::testing::TempDir temp_;
};

TEST_F(ChatCliTest, PrepareShowAndTrainOnTheAssistantsReplies) {
  write_conversations();
  const BinaryResult prepared =
      run_ok("prepare --chat chat.jsonl --tokenizer " + kChat + "llama3.1 --out data");
  EXPECT_NE(prepared.out.find("with the llama3.1 chat template"), std::string::npos)
      << prepared.out;
  EXPECT_TRUE(fs::exists(path("data/train_000000.mask")));
  const BinaryResult shown = run_ok("prepare --show 2 --out data");
  EXPECT_NE(shown.out.find("[TRAINED]it is 2.<|eot_id|>[/TRAINED]"), std::string::npos)
      << shown.out;
  EXPECT_NE(shown.out.find("<|start_header_id|>user<|end_header_id|>\n\nwhat is 2 plus 0?"),
            std::string::npos)
      << shown.out;

  write_model();
  const BinaryResult trained = run_ok(
      "--model model/config.json --data 'data/train_*.bin' --val-data 'data/val_*.bin' "
      "--batch 2 --seq-len 256 --steps 6 --eval-every 3 --eval-batches 2 --sample 4 --threads 2 "
      "--device cpu --log run.jsonl --out run --tensorboard board --tokenizer " +
      kChat + "llama3.1/tokenizer.json");
  EXPECT_NE(trained.out.find("chat data: "), std::string::npos) << trained.out;
  // The sample replies to the first validation conversation (54: the last 10% are held out),
  // rendered with the template up to the assistant's header.
  EXPECT_NE(trained.out.find("its first conversation up to the reply"), std::string::npos)
      << trained.out;
  EXPECT_NE(trained.out.find("what is 54 plus 0?<|eot_id|><|start_header_id|>assistant"
                             "<|end_header_id|>\n\n\n    sampled: "),
            std::string::npos)
      << trained.out;
  // The checkpoint is a chat model for transformers: its template and generate() work.
  const std::string chat_check = "/usr/bin/python3 " + std::string(DSTRAIN_SOURCE_DIR) +
                                 "/tests/reference/check_chat_checkpoint.py " +
                                 path("run/step-000006").string() + " > " +
                                 path("chat_check.txt").string() + " 2>&1";
  const int chat_status = std::system(chat_check.c_str());
  if (!(WIFEXITED(chat_status) && WEXITSTATUS(chat_status) == 77)) {
    EXPECT_TRUE(WIFEXITED(chat_status) && WEXITSTATUS(chat_status) == 0)
        << std::ifstream(path("chat_check.txt")).rdbuf();
  }
  EXPECT_EQ(dstrain::testing::step_losses(path("run.jsonl")).size(), 6u);

  // TensorBoard: every number of the log, as tensorboard's reader sees it (skipped without it).
  const std::string check = "/usr/bin/python3 " + kReader + " " + path("board").string() + " " +
                            path("run.jsonl").string() + " > " + path("reader.txt").string() +
                            " 2>&1";
  int status = std::system(check.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) GTEST_SKIP() << "no tensorboard package";
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << std::ifstream(path("reader.txt")).rdbuf();

  // Resumed, with more steps: a second event file, and the reader still agrees with the log.
  run_ok(
      "--resume run --steps 9 --log run.jsonl --tensorboard board --sample 0 --device cpu "
      "--threads 2");
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(path("board"))) files += entry.is_regular_file();
  EXPECT_EQ(files, 2u);
  status = std::system(check.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << std::ifstream(path("reader.txt")).rdbuf();

  // A new run into the same directory is refused.
  dstrain::testing::expect_one_sentence(
      run("--model model/config.json --data 'data/train_*.bin' --val-data 'data/val_*.bin' "
          "--batch 2 --seq-len 256 --steps 2 --sample 0 --device cpu --out run2 --tensorboard "
          "board"),
      "--tensorboard board", "holds the event files of another run");
}

TEST_F(ChatCliTest, BadChatFlagsAreOneSentence) {
  write_conversations();
  dstrain::testing::expect_one_sentence(run("prepare --chat chat.jsonl --out data"),
                                        "prepare --chat", "needs --tokenizer DIR");
  dstrain::testing::expect_one_sentence(
      run("prepare --chat chat.jsonl --tokenizer " + kChat + "qwen2 --out data --chat-template x"),
      "--chat-template x", "mistral-v3");
  dstrain::testing::expect_one_sentence(
      run("prepare --input chat.jsonl --out data --train-on-prompt"), "--train-on-prompt",
      "go with --chat");
  dstrain::testing::expect_one_sentence(run("prepare --show 0 --out nowhere"), "--show",
                                        "no prepare.json");
}

// --batch-tokens: a run, its header, and what it does not go with (one sentence each).
TEST_F(ChatCliTest, BatchTokensRunsAndItsBadUsesAreOneSentence) {
  write_conversations();
  run_ok("prepare --chat chat.jsonl --tokenizer " + kChat + "qwen2.5 --out data");
  write_model();
  const std::string common =
      "--model model/config.json --data 'data/train_*.bin' --val-data 'data/val_*.bin' "
      "--seq-len 128 --steps 2 --sample 0 --device cpu --threads 2 ";
  const BinaryResult trained = run_ok(common + "--batch-tokens 256 --log run.jsonl");
  EXPECT_NE(trained.out.find("micro-batches of up to 256 positions: "), std::string::npos)
      << trained.out;
  EXPECT_NE(trained.out.find("batch 2 x 128 tokens"), std::string::npos) << trained.out;
  EXPECT_EQ(dstrain::testing::step_losses(path("run.jsonl")).size(), 2u);
  dstrain::testing::expect_one_sentence(run(common + "--batch-tokens 64"), "--batch-tokens 64",
                                        "is below --seq-len 128");
  dstrain::testing::expect_one_sentence(run(common + "--batch-tokens 256 --packing on"),
                                        "--batch-tokens", "--packing off");
  dstrain::testing::expect_one_sentence(run(common + "--batch-tokens 256 --batch 3"),
                                        "--batch-tokens 256 plans micro-batches of 2 rows",
                                        "give one of them");
  dstrain::testing::expect_one_sentence(
      run("--seq-len 32 --steps 1 --device cpu --batch-tokens 64"), "--batch-tokens",
      "needs chat data");
}

}  // namespace
