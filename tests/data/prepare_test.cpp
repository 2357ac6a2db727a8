#include "data/prepare.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "data/loader.h"
#include "core/fs.h"
#include "data/bpe_tokenizer.h"
#include <cmath>
#include <nlohmann/json.hpp>
#include "core/rng.h"
#include "data/token_file.h"
#include "test_util.h"

namespace dstrain {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

std::string random_text(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::string text(n, ' ');
  for (char& c : text) c = static_cast<char>(rng.below(10) == 0 ? '\n' : 'a' + rng.below(26));
  text[5] = static_cast<char>(0xe9);  // a byte above 127 must survive too
  return text;
}

// All tokens of the shards, concatenated, as bytes.
std::string shard_bytes(const std::vector<std::string>& files) {
  std::string bytes;
  for (const std::string& file : files) {
    const auto source = TokenSource::open_file(file, 256);
    std::vector<int32_t> tokens(source->size());
    source->read(0, tokens.size(), tokens.data());
    for (int32_t t : tokens) bytes += static_cast<char>(t);
  }
  return bytes;
}

TEST(Prepare, WritesReadableU16ShardsWithTailAsValidation) {
  TempDir dir;
  const std::string text = random_text(10000, 1);
  write_bytes(dir.file("input.txt"), text);
  const std::string out = dir.file("out");  // created by prepare
  const PrepareResult result = prepare(dir.file("input.txt"), out);
  EXPECT_EQ(result.train_tokens, 9000u);
  EXPECT_EQ(result.val_tokens, 1000u);
  ASSERT_EQ(result.train_files, std::vector<std::string>{out + "/train_000000.bin"});
  ASSERT_EQ(result.val_files, std::vector<std::string>{out + "/val_000000.bin"});
  EXPECT_EQ(shard_bytes(result.train_files), text.substr(0, 9000));
  EXPECT_EQ(shard_bytes(result.val_files), text.substr(9000));
  const std::string header = read_bytes(result.train_files[0]).substr(0, 12);
  const int32_t expected_header[3] = {20240520, 1, 9000};
  EXPECT_EQ(header, std::string(reinterpret_cast<const char*>(expected_header), 12));
  // Only the shards: no temporary files left.
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(out)) ++entries;
  EXPECT_EQ(entries, 2u);
  // And they feed the loader through a glob.
  LoaderOptions options;
  options.batch = 4;
  options.seq_len = 32;
  DataLoader loader(TokenDataset::open(out + "/train_*.bin", 256), options);
  EXPECT_EQ(loader.num_sequences(), (9000 - 1) / 32);
  EXPECT_EQ(loader.rounds_per_epoch(), (9000 - 1) / 32 / 4);
}

TEST(Prepare, SplitsLargeInputIntoShardsAndRemovesStaleOnes) {
  TempDir dir;
  const std::string out = dir.file("out");
  const std::string big = random_text(10000, 2);
  write_bytes(dir.file("big.txt"), big);
  const PrepareResult first = prepare(dir.file("big.txt"), out, 0.25, 3000);
  ASSERT_EQ(first.train_files.size(), 3u);  // 7500 = 3000 + 3000 + 1500
  EXPECT_EQ(first.train_files[2], out + "/train_000002.bin");
  EXPECT_EQ(TokenSource::open_file(first.train_files[0], 256)->size(), 3000u);
  EXPECT_EQ(TokenSource::open_file(first.train_files[2], 256)->size(), 1500u);
  EXPECT_EQ(first.val_files.size(), 1u);
  EXPECT_EQ(shard_bytes(first.train_files), big.substr(0, 7500));
  EXPECT_EQ(shard_bytes(first.val_files), big.substr(7500));

  // A smaller second run leaves exactly its own shards behind.
  const std::string small = random_text(2000, 3);
  write_bytes(dir.file("small.txt"), small);
  write_bytes(out + "/notes.txt", "kept");
  const PrepareResult second = prepare(dir.file("small.txt"), out, 0.1, 3000);
  EXPECT_EQ(second.train_files.size(), 1u);
  EXPECT_EQ(expand_data_paths(out + "/train_*.bin"), second.train_files);
  EXPECT_EQ(shard_bytes(expand_data_paths(out + "/train_*.bin")), small.substr(0, 1800));
  EXPECT_TRUE(std::filesystem::exists(out + "/notes.txt"));
}

TEST(Prepare, FailureLeavesNoStagingOrPartialShards) {
  TempDir dir;
  write_bytes(dir.file("in.txt"), random_text(5000, 6));
  const std::string out = dir.file("out");
  std::filesystem::create_directories(out + "/train_000000.bin");  // the rename into it fails
  EXPECT_USER_ERROR(prepare(dir.file("in.txt"), out), "train_000000.bin");
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(out)) ++entries;
  EXPECT_EQ(entries, 1u) << "only the obstacle: no staging directory, no val shard";
}

TEST(Prepare, MissingInput) {
  TempDir dir;
  EXPECT_USER_ERROR(prepare(dir.file("nope.txt"), dir.file("out")), "nope.txt", "does not exist");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

TEST(Prepare, InputTooSmallForASplit) {
  TempDir dir;
  write_bytes(dir.file("tiny.txt"), random_text(1023, 4));
  EXPECT_USER_ERROR(prepare(dir.file("tiny.txt"), dir.file("out")), "tiny.txt", "1023 bytes",
                    "at least 1024");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
  write_bytes(dir.file("exact.txt"), random_text(1024, 4));
  const PrepareResult result = prepare(dir.file("exact.txt"), dir.file("out"));
  EXPECT_EQ(result.val_tokens, 102u);  // round(0.1 * 1024)
  EXPECT_EQ(result.train_tokens, 922u);
}

TEST(Prepare, BadValFractionAndOutputPath) {
  TempDir dir;
  write_bytes(dir.file("in.txt"), random_text(5000, 5));
  EXPECT_USER_ERROR(prepare(dir.file("in.txt"), dir.file("out"), -0.1), "at least 0", "below 1");
  EXPECT_USER_ERROR(prepare(dir.file("in.txt"), dir.file("out"), 1.0), "at least 0", "below 1");
  write_bytes(dir.file("a_file"), "x");
  EXPECT_USER_ERROR(prepare(dir.file("in.txt"), dir.file("a_file")), "output directory",
                    "a_file");
  EXPECT_USER_ERROR(prepare(dir.path().string(), dir.file("out")), "is a directory");
}

TEST(Prepare, ValFractionZeroWritesTrainShardsOnly) {
  TempDir dir;
  const std::string text = random_text(3000, 7);
  write_bytes(dir.file("in.txt"), text);
  const std::string out = dir.file("out");
  std::filesystem::create_directories(out);
  write_bytes(out + "/val_000000.bin", "stale");  // an earlier run's: removed
  const PrepareResult result = prepare(dir.file("in.txt"), out, 0.0);
  EXPECT_EQ(result.train_tokens, 3000u);
  EXPECT_EQ(result.val_tokens, 0u);
  EXPECT_TRUE(result.val_files.empty());
  EXPECT_FALSE(std::filesystem::exists(out + "/val_000000.bin"));
  EXPECT_EQ(shard_bytes(result.train_files), text);
}

const std::string kTokenizers = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/tokenizers/";

std::vector<int32_t> shard_tokens(const std::vector<std::string>& files, int64_t vocab_size) {
  std::vector<int32_t> all;
  for (const std::string& file : files) {
    const auto source = TokenSource::open_file(file, vocab_size);
    std::vector<int32_t> tokens(source->size());
    source->read(0, tokens.size(), tokens.data());
    all.insert(all.end(), tokens.begin(), tokens.end());
  }
  return all;
}

TEST(Prepare, TokenizerJsonShardsHoldTheLibrarysIds) {
  nlohmann::json expected = nlohmann::json::parse(read_file(kTokenizers + "prepare_ids.json"));
  // The SentencePiece kinds (their end-of-text token: </s>).
  expected.update(nlohmann::json::parse(read_file(kTokenizers + "sentencepiece_corpus_ids.json")));
  for (const char* name : {"gpt2_kind", "llama3_kind", "deepseek_kind", "qwen2_kind", "llama2_kind",
                           "mistral_v3_kind", "llama2_metaspace_kind"}) {
    TempDir dir;
    PrepareOptions options;
    options.inputs = {kTokenizers + "corpus.txt", kTokenizers + "corpus.txt"};
    options.out_dir = dir.file("out");
    options.tokenizer_path = kTokenizers + name + ".json";
    options.append_eot = true;
    options.val_fraction = 0.25;
    options.max_shard_tokens = 1000;
    const PrepareResult result = prepare(options);
    std::vector<int32_t> ids = expected[name]["ids"].get<std::vector<int32_t>>();
    ASSERT_GT(ids.size(), 1000u);
    ids.push_back(expected[name]["eot_id"].get<int32_t>());
    std::vector<int32_t> twice = ids;
    twice.insert(twice.end(), ids.begin(), ids.end());
    EXPECT_FALSE(result.uint32_tokens);
    EXPECT_EQ(result.train_tokens + result.val_tokens, twice.size());
    EXPECT_EQ(result.val_tokens, static_cast<size_t>(std::llround(0.25 * twice.size())));
    EXPECT_GT(result.train_files.size(), 1u);
    std::vector<int32_t> written = shard_tokens(result.train_files, result.vocab_size);
    const std::vector<int32_t> val = shard_tokens(result.val_files, result.vocab_size);
    written.insert(written.end(), val.begin(), val.end());
    EXPECT_EQ(written, twice) << name;
    const int32_t u16_magic = kLlmcMagicU16;
    EXPECT_EQ(read_bytes(result.train_files[0]).substr(0, 4),
              std::string(reinterpret_cast<const char*>(&u16_magic), 4));
  }
}

// A tokenizer whose ids run past 65535: the shards are llm.c uint32 (magic 20240801).
TEST(Prepare, VocabularyOver65536WritesUint32Shards) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    const char32_t c = byte_to_unicode(static_cast<unsigned char>(b));
    std::string utf8;
    if (c < 0x80) {
      utf8 += static_cast<char>(c);
    } else {
      utf8 += static_cast<char>(0xC0 | (c >> 6));
      utf8 += static_cast<char>(0x80 | (c & 0x3F));
    }
    vocab[utf8] = 70000 + b;
  }
  const nlohmann::json tokenizer = {
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"added_tokens", nlohmann::json::array({{{"id", 3}, {"content", "<|endoftext|>"},
                                               {"special", true}}})},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  TempDir dir;
  write_bytes(dir.file("tokenizer.json"), tokenizer.dump());
  const std::string text = random_text(2000, 8).replace(5, 1, "e");  // UTF-8
  write_bytes(dir.file("in.txt"), text);
  PrepareOptions options;
  options.inputs = {dir.file("in.txt")};
  options.out_dir = dir.file("out");
  options.tokenizer_path = dir.file("tokenizer.json");
  options.append_eot = true;
  const PrepareResult result = prepare(options);
  EXPECT_TRUE(result.uint32_tokens);
  EXPECT_EQ(result.vocab_size, 70256);
  std::vector<int32_t> written = shard_tokens(result.train_files, result.vocab_size);
  const std::vector<int32_t> val = shard_tokens(result.val_files, result.vocab_size);
  written.insert(written.end(), val.begin(), val.end());
  ASSERT_EQ(written.size(), text.size() + 1);
  for (size_t i = 0; i < text.size(); ++i)
    ASSERT_EQ(written[i], 70000 + static_cast<unsigned char>(text[i])) << i;
  EXPECT_EQ(written.back(), 3);
  const std::string header = read_bytes(result.train_files[0]).substr(0, 8);
  const int32_t expected_header[2] = {20240801, 7};
  EXPECT_EQ(header, std::string(reinterpret_cast<const char*>(expected_header), 8));
}

TEST(Prepare, TokenizerMistakesLeaveNothingWritten) {
  TempDir dir;
  write_bytes(dir.file("in.txt"), random_text(3000, 9).replace(5, 1, "e"));
  write_bytes(dir.file("bad.json"), "{\"model\": {\"merges\": []}}");
  PrepareOptions options;
  options.inputs = {dir.file("in.txt")};
  options.out_dir = dir.file("out");
  options.tokenizer_path = dir.file("bad.json");
  EXPECT_USER_ERROR(prepare(options), "bad.json", "model.vocab");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
  options.tokenizer_path.clear();
  options.append_eot = true;
  EXPECT_USER_ERROR(prepare(options), "--eot needs a --tokenizer");
  options.tokenizer_path = kTokenizers + "gpt2_kind.json";
  options.eot_token = "<|nope|>";
  EXPECT_USER_ERROR(prepare(options), "no token '<|nope|>'");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
  write_bytes(dir.file("latin1.txt"), std::string(2000, 'a') + "\xe9t\xe9");
  options.inputs = {dir.file("latin1.txt")};
  options.append_eot = false;
  EXPECT_USER_ERROR(prepare(options), "latin1.txt", "not valid UTF-8 at byte 2000");
  EXPECT_TRUE(std::filesystem::is_empty(dir.file("out"))) << "no shard, no staging directory";
}

}  // namespace
}  // namespace dstrain
