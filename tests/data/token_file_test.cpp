#include "data/token_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/rng.h"
#include "test_util.h"

namespace dstrain {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

std::vector<int32_t> random_tokens(size_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return tokens;
}

int32_t header_field(const std::string& bytes, int index) {
  int32_t value;
  std::memcpy(&value, bytes.data() + 4 * index, 4);
  return value;
}

void set_header_field(const std::string& path, int index, int32_t value) {
  std::string bytes = read_bytes(path);
  std::memcpy(bytes.data() + 4 * index, &value, 4);
  write_bytes(path, bytes);
}

// The file is an llm.c header (magic, version, count, then zeros) and count tokens of width.
void expect_llmc_file(const std::string& path, int32_t magic, int32_t version, size_t count,
                      size_t width) {
  const std::string bytes = read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024 + width * count);
  EXPECT_EQ(header_field(bytes, 0), magic);
  EXPECT_EQ(header_field(bytes, 1), version);
  EXPECT_EQ(header_field(bytes, 2), static_cast<int32_t>(count));
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header_field(bytes, i), 0);
}

void expect_same_tokens(const TokenSource& source, const std::vector<int32_t>& tokens) {
  ASSERT_EQ(source.size(), tokens.size());
  std::vector<int32_t> read(tokens.size());
  source.read(0, tokens.size(), read.data());
  EXPECT_EQ(read, tokens);
  // A read at an odd offset of an odd length, and single tokens.
  std::vector<int32_t> middle(tokens.size() / 3);
  source.read(7, middle.size(), middle.data());
  EXPECT_TRUE(std::equal(middle.begin(), middle.end(), tokens.begin() + 7));
  EXPECT_EQ(source.token(0), tokens[0]);
  EXPECT_EQ(source.token(tokens.size() - 1), tokens.back());
}

TEST(TokenFile, RoundTrip_llmc_u16_odd_count) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  const auto tokens = random_tokens(10007, 50257, 1);
  write_token_file(path, tokens, TokenFormat::kLlmcU16);
  expect_llmc_file(path, 20240520, 1, 10007, 2);
  const auto source = TokenSource::open_file(path, 50257);
  expect_same_tokens(*source, tokens);
  EXPECT_EQ(dir.entry_count(), 1u) << "the temporary file must be gone";
}

TEST(TokenFile, RoundTrip_llmc_u32_ids_above_65535) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  auto tokens = random_tokens(5001, 200000, 2);
  tokens[3] = 199999;  // beyond uint16
  write_token_file(path, tokens, TokenFormat::kLlmcU32);
  expect_llmc_file(path, 20240801, 7, 5001, 4);
  expect_same_tokens(*TokenSource::open_file(path, 200000), tokens);
}

TEST(TokenFile, RoundTrip_raw_u16) {
  TempDir dir;
  const std::string path = dir.file("tokens.u16");
  const auto tokens = random_tokens(3001, 65536, 3);
  write_token_file(path, tokens, TokenFormat::kRawU16);
  EXPECT_EQ(std::filesystem::file_size(path), 2 * tokens.size());
  expect_same_tokens(*TokenSource::open_file(path, 65536), tokens);
}

TEST(TokenFile, RoundTrip_raw_u32) {
  TempDir dir;
  const std::string path = dir.file("tokens.u32");
  const auto tokens = random_tokens(3001, 1 << 20, 4);
  write_token_file(path, tokens, TokenFormat::kRawU32);
  EXPECT_EQ(std::filesystem::file_size(path), 4 * tokens.size());
  expect_same_tokens(*TokenSource::open_file(path, 1 << 20), tokens);
}

TEST(TokenFile, StreamingWriterMatchesOneShot) {
  TempDir dir;
  const auto tokens = random_tokens(4000, 1000, 5);
  write_token_file(dir.file("one.bin"), tokens, TokenFormat::kLlmcU16);
  {
    TokenFileWriter writer(dir.file("streamed.bin"), TokenFormat::kLlmcU16, 4000);
    writer.append(std::span(tokens).subspan(0, 1234));
    writer.append(std::span(tokens).subspan(1234));
    EXPECT_EQ(writer.tokens_written(), 4000u);
    EXPECT_FALSE(std::filesystem::exists(dir.file("streamed.bin")));
    writer.commit();
  }
  EXPECT_EQ(read_bytes(dir.file("one.bin")), read_bytes(dir.file("streamed.bin")));
}

TEST(TokenFile, WriterWithoutCommitLeavesNothing) {
  TempDir dir;
  {
    TokenFileWriter writer(dir.file("abandoned.bin"), TokenFormat::kLlmcU16, 200);
    writer.append(random_tokens(100, 10, 6));
  }
  EXPECT_EQ(dir.entry_count(), 0u);
}

TEST(TokenFile, ZeroTokenShardIsEmptySource) {
  TempDir dir;
  write_token_file(dir.file("none.bin"), {}, TokenFormat::kLlmcU16);
  EXPECT_EQ(TokenSource::open_file(dir.file("none.bin"), 10)->size(), 0u);
}

TEST(TokenFile, MissingFile) {
  TempDir dir;
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("nope.bin"), 10), "nope.bin",
                    "does not exist");
}

TEST(TokenFile, EmptyFile) {
  TempDir dir;
  write_bytes(dir.file("empty.bin"), "");
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("empty.bin"), 10), "empty.bin", "empty");
  write_bytes(dir.file("empty.u16"), "");
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("empty.u16"), 10), "empty.u16", "empty");
}

TEST(TokenFile, ShorterThanHeader) {
  TempDir dir;
  write_bytes(dir.file("short.bin"), std::string(100, '\0'));
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("short.bin"), 10), "short.bin", "100 bytes",
                    "shorter than the 1024-byte");
  // Text, short or long, is told to go through dstrain prepare.
  for (const size_t size : {100, 5000}) {
    write_bytes(dir.file("book.bin"), std::string(size, 'x') + "\n");
    EXPECT_USER_ERROR(TokenSource::open_file(dir.file("book.bin"), 10), "book.bin",
                      "holds text, not tokens", "dstrain prepare --input");
  }
}

TEST(TokenFile, DirectoryIsNotATokenFile) {
  TempDir dir;
  EXPECT_USER_ERROR(TokenSource::open_file(dir.path().string(), 10), "is a directory");
}

TEST(TokenFile, TruncatedHeaderCountAboveFileSize) {
  TempDir dir;
  const std::string path = dir.file("cut.bin");
  write_token_file(path, random_tokens(1000, 50, 7), TokenFormat::kLlmcU16);
  std::filesystem::resize_file(path, 1024 + 2 * 990);
  EXPECT_USER_ERROR(TokenSource::open_file(path, 50), "cut.bin", "truncated", "1000 tokens",
                    "1980 bytes");
}

TEST(TokenFile, TrailingBytes) {
  TempDir dir;
  const std::string path = dir.file("long.bin");
  write_token_file(path, random_tokens(1000, 50, 8), TokenFormat::kLlmcU32);
  std::filesystem::resize_file(path, 1024 + 4 * 1000 + 6);
  EXPECT_USER_ERROR(TokenSource::open_file(path, 50), "long.bin", "6 trailing bytes");
}

TEST(TokenFile, WrongMagic) {
  TempDir dir;
  const std::string path = dir.file("magic.bin");
  write_token_file(path, random_tokens(100, 50, 9), TokenFormat::kLlmcU16);
  set_header_field(path, 0, 12345);
  EXPECT_USER_ERROR(TokenSource::open_file(path, 50), "magic.bin", "magic number 12345",
                    "20240520", "20240801");
}

TEST(TokenFile, UnsupportedVersion) {
  TempDir dir;
  const std::string u16 = dir.file("v_u16.bin"), u32 = dir.file("v_u32.bin");
  write_token_file(u16, random_tokens(100, 50, 10), TokenFormat::kLlmcU16);
  write_token_file(u32, random_tokens(100, 50, 10), TokenFormat::kLlmcU32);
  set_header_field(u16, 1, 7);  // the uint32 version with the uint16 magic
  set_header_field(u32, 1, 2);
  EXPECT_USER_ERROR(TokenSource::open_file(u16, 50), "v_u16.bin", "version 7", "only version 1");
  EXPECT_USER_ERROR(TokenSource::open_file(u32, 50), "v_u32.bin", "version 2", "only version 7");
}

TEST(TokenFile, NegativeHeaderCount) {
  TempDir dir;
  const std::string path = dir.file("negative.bin");
  write_token_file(path, random_tokens(100, 50, 11), TokenFormat::kLlmcU16);
  set_header_field(path, 2, -5);
  EXPECT_USER_ERROR(TokenSource::open_file(path, 50), "negative.bin", "negative token count");
}

TEST(TokenFile, RawSizeNotMultipleOfWidth) {
  TempDir dir;
  write_bytes(dir.file("odd.u32"), std::string(10, '\0'));
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("odd.u32"), 50), "odd.u32",
                    "not a multiple of 4");
}

TEST(TokenFile, TokenIdAtOrAboveVocab_u16_names_first_id_and_position) {
  TempDir dir;
  const std::string path = dir.file("ids.bin");
  auto tokens = random_tokens(200000, 256, 12);
  tokens[123456] = 300;  // the first offender, in the second scan chunk
  tokens[150000] = 999;
  write_token_file(path, tokens, TokenFormat::kLlmcU16);
  EXPECT_USER_ERROR(TokenSource::open_file(path, 256), "ids.bin", "token id 300",
                    "position 123456", "256 tokens");
  EXPECT_EQ(TokenSource::open_file(path, 1000)->size(), tokens.size());  // fits a larger vocab
}

TEST(TokenFile, TokenIdAtOrAboveVocab_exactly_vocab_u32_and_raw) {
  TempDir dir;
  auto tokens = random_tokens(5000, 100, 13);
  tokens[4999] = 100;  // == vocab: out of range
  write_token_file(dir.file("ids32.bin"), tokens, TokenFormat::kLlmcU32);
  write_token_file(dir.file("ids.u16"), tokens, TokenFormat::kRawU16);
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("ids32.bin"), 100), "token id 100",
                    "position 4999");
  EXPECT_USER_ERROR(TokenSource::open_file(dir.file("ids.u16"), 100), "token id 100",
                    "position 4999");
}

TEST(TokenFile, InMemoryTokensChecked_negative_and_large) {
  EXPECT_USER_ERROR(TokenSource::from_tokens({1, 2, -3, 4}, 10, "mem"), "'mem'", "token id -3",
                    "position 2");
  EXPECT_USER_ERROR(TokenSource::from_tokens({1, 2, 3, 10}, 10, "mem"), "token id 10",
                    "position 3");
  EXPECT_EQ(TokenSource::from_tokens({0, 9}, 10)->size(), 2u);
}

TEST(TokenFile, WriteRejectsTokenTooWideForUint16) {
  TempDir dir;
  const std::vector<int32_t> tokens = {1, 2, 70000};
  EXPECT_USER_ERROR(write_token_file(dir.file("wide.bin"), tokens, TokenFormat::kLlmcU16),
                    "token id 70000", "position 2", "uint32");
  EXPECT_USER_ERROR(write_token_file(dir.file("neg.u32"), std::vector<int32_t>{-1},
                                     TokenFormat::kRawU32),
                    "token id -1");
  EXPECT_EQ(dir.entry_count(), 0u) << "a failed write must leave nothing behind";
}

TEST(TokenFile, WriteRejectsNameThatReadsBackDifferently) {
  TempDir dir;
  const std::vector<int32_t> tokens = {1, 2, 3};
  EXPECT_USER_ERROR(write_token_file(dir.file("raw.bin"), tokens, TokenFormat::kRawU16), ".u16");
  EXPECT_USER_ERROR(write_token_file(dir.file("shard.u32"), tokens, TokenFormat::kLlmcU32),
                    "raw token file");
  EXPECT_EQ(dir.entry_count(), 0u);
}

TEST(TokenFile, WriteIntoMissingDirectory) {
  TempDir dir;
  EXPECT_USER_ERROR(write_token_file(dir.file("no/such/dir/x.bin"), std::vector<int32_t>{1},
                                     TokenFormat::kLlmcU16),
                    "x.bin", "No such file or directory");
}

TEST(TokenFile, WriteReplacesExistingFileAtomically) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  write_token_file(path, random_tokens(500, 50, 14), TokenFormat::kLlmcU16);
  const auto old_source = TokenSource::open_file(path, 50);  // a reader holding the old file
  const auto fresh = random_tokens(300, 50, 15);
  write_token_file(path, fresh, TokenFormat::kLlmcU16);
  EXPECT_EQ(old_source->size(), 500u);  // the old mapping stays valid
  expect_same_tokens(*TokenSource::open_file(path, 50), fresh);
}

TEST(ExpandDataPaths, GlobIsSorted) {
  TempDir dir;
  for (const char* name : {"b_000002.bin", "b_000000.bin", "b_000001.bin", "other.txt"})
    write_bytes(dir.file(name), "x");
  const auto paths = expand_data_paths(dir.file("b_*.bin"));
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0], dir.file("b_000000.bin"));
  EXPECT_EQ(paths[1], dir.file("b_000001.bin"));
  EXPECT_EQ(paths[2], dir.file("b_000002.bin"));
}

TEST(ExpandDataPaths, PlainPath) {
  TempDir dir;
  write_bytes(dir.file("one.bin"), "x");
  EXPECT_EQ(expand_data_paths(dir.file("one.bin")), std::vector<std::string>{dir.file("one.bin")});
}

TEST(ExpandDataPaths, GlobWithoutMatchNamesPattern) {
  TempDir dir;
  const std::string pattern = dir.file("train_*.bin");
  EXPECT_USER_ERROR(expand_data_paths(pattern), "no file matches", pattern);
}

TEST(ExpandDataPaths, MissingPlainPathAndDirectory) {
  TempDir dir;
  EXPECT_USER_ERROR(expand_data_paths(dir.file("missing.bin")), "missing.bin", "does not exist");
  EXPECT_USER_ERROR(expand_data_paths(dir.path().string()), "is a directory");
  EXPECT_USER_ERROR(expand_data_paths(""), "empty");
}

}  // namespace
}  // namespace dstrain
