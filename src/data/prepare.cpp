#include "data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <regex>
#include <utility>

#include "core/check.h"
#include "core/fs.h"
#include "data/prepare_util.h"
#include "data/token_file.h"
#include "data/bpe_tokenizer.h"
#include "data/tokenizer.h"
#include "data/unicode_regex.h"

namespace dstrain {

namespace {

namespace fs = std::filesystem;

constexpr size_t kMinInputBytes = 1024;
constexpr size_t kReadChunkBytes = size_t{1} << 22;

// The tokenizer prepare runs: the byte tokenizer, or a tokenizer.json's BPE.
struct TextEncoder {
  std::optional<BpeTokenizer> bpe;  // none: bytes

  int64_t vocab_size() const { return bpe ? bpe->vocab_size() : ByteTokenizer::kVocabSize; }
  // How much of `text` may be encoded now, without the text after it.
  size_t encodable_prefix(std::string_view text) const {
    return bpe ? bpe->safe_prefix_length(text) : text.size();
  }
  std::vector<int32_t> encode(std::string_view text) {
    return bpe ? bpe->encode(text) : ByteTokenizer().encode(text);
  }
};

// Encodes `text` (bytes [offset, offset + text.size()) of the input) into the spool; a BPE
// tokenizer needs it to be UTF-8.
void spool_text(std::string_view text, size_t offset, const std::string& input_path,
                TextEncoder& encoder, Spool& spool) {
  if (encoder.bpe) {
    const size_t valid = valid_utf8_prefix(text);
    DSTRAIN_USER_CHECK(valid == text.size())
        << "input text file '" << input_path << "' is not valid UTF-8 at byte "
        << offset + valid << "; a tokenizer.json reads UTF-8 text (convert it, e.g. with iconv).";
  }
  spool.append(encoder.encode(text));
}

// Streams one input file through the encoder into the spool, block by block, each block cut
// where the encoder can stop (for BPE: where safe_prefix_length says, so the ids equal those
// of the whole file; a block grows until it has such a place, and a SentencePiece tokenizer
// with Llama 2's Prepend normalizer has none: the file is one block), then the end-of-text id
// if any.
void spool_input(const std::string& input_path, TextEncoder& encoder,
                 std::optional<int32_t> eot_id, Spool& spool) {
  std::unique_ptr<std::FILE, FileCloser> input(std::fopen(input_path.c_str(), "rb"));
  DSTRAIN_USER_CHECK(input != nullptr) << "cannot open input text file '" << input_path
                                       << "': " << std::strerror(errno) << ".";
  std::string block;
  size_t block_offset = 0;  // of block[0] in the file
  for (;;) {
    const size_t old_size = block.size();
    block.resize(old_size + kReadChunkBytes);
    const size_t got = std::fread(block.data() + old_size, 1, kReadChunkBytes, input.get());
    block.resize(old_size + got);
    DSTRAIN_USER_CHECK(!std::ferror(input.get()))
        << "could not read input text file '" << input_path << "' to its end ("
        << std::strerror(errno) << ").";
    if (got == 0) break;
    const size_t cut = encoder.encodable_prefix(block);
    if (cut == 0) continue;
    spool_text(std::string_view(block).substr(0, cut), block_offset, input_path, encoder, spool);
    block.erase(0, cut);
    block_offset += cut;
  }
  if (!block.empty()) spool_text(block, block_offset, input_path, encoder, spool);
  if (eot_id) spool.append(std::span<const int32_t>(&*eot_id, 1));
}

// Moves the next `tokens` tokens of the spool into shards staging/split_NNNNNN.bin of at most
// max_shard_tokens tokens; returns the shard names.
std::vector<std::string> write_split(Spool& spool, size_t tokens, const fs::path& staging,
                                     const char* split, size_t max_shard_tokens,
                                     TokenFormat format) {
  std::vector<std::string> names;
  std::vector<int32_t> chunk;
  for (size_t remaining = tokens; remaining > 0;) {
    names.push_back(shard_name(split, names.size()));
    const size_t shard_tokens = std::min(remaining, max_shard_tokens);
    TokenFileWriter writer((staging / names.back()).string(), format, shard_tokens);
    for (size_t left = shard_tokens; left > 0;) {
      const size_t n = std::min(left, kReadChunkBytes);
      spool.read(n, chunk);
      writer.append(chunk);
      left -= n;
    }
    writer.commit();
    remaining -= shard_tokens;
  }
  return names;
}

// Checks the options and the inputs before anything is written; returns the inputs' bytes.
size_t checked_input_bytes(const PrepareOptions& options) {
  DSTRAIN_USER_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0)
      << "the validation fraction must be at least 0 (no validation shards) and below 1, not "
      << options.val_fraction << ".";
  DSTRAIN_USER_CHECK(!options.inputs.empty()) << "prepare needs at least one input text file.";
  size_t total = 0;
  for (const std::string& input : options.inputs) {
    std::error_code error;
    const fs::file_status status = fs::status(input, error);
    DSTRAIN_USER_CHECK(fs::exists(status)) << "input text file '" << input << "' does not exist.";
    DSTRAIN_USER_CHECK(!fs::is_directory(status))
        << "input text path '" << input << "' is a directory; give a text file.";
    total += static_cast<size_t>(fs::file_size(input, error));
    DSTRAIN_USER_CHECK(!error) << "cannot read the size of input text file '" << input
                               << "': " << error.message() << ".";
  }
  const std::string named = options.inputs.size() == 1
                                ? "input text file '" + options.inputs[0] + "' has"
                                : "the input text files have";
  DSTRAIN_USER_CHECK(total > 0) << named << " no bytes.";
  DSTRAIN_USER_CHECK(options.val_fraction == 0.0 || total >= kMinInputBytes)
      << named << " only " << total << " bytes; prepare needs at least " << kMinInputBytes
      << " bytes so that both the training and the validation split are useful.";
  return total;
}

std::optional<int32_t> eot_id_of(const PrepareOptions& options, const TextEncoder& encoder) {
  if (!options.append_eot) return std::nullopt;
  DSTRAIN_USER_CHECK(encoder.bpe.has_value())
      << "--eot needs a --tokenizer (the byte tokenizer has no end-of-text token).";
  const std::optional<int32_t> id = options.eot_token.empty()
                                        ? encoder.bpe->end_of_text_id()
                                        : encoder.bpe->token_id(options.eot_token);
  DSTRAIN_USER_CHECK(id.has_value())
      << "tokenizer '" << options.tokenizer_path << "' has "
      << (options.eot_token.empty()
              ? std::string("no end-of-text token (<|endoftext|>, <|end_of_text|>, DeepSeek's "
                            "end-of-sentence token or </s>); name one with --eot-token")
              : "no token '" + options.eot_token + "'")
      << ".";
  return id;
}

}  // namespace

PrepareResult prepare(const PrepareOptions& options) {
  DSTRAIN_CHECK(options.max_shard_tokens >= 1 &&
                options.max_shard_tokens <= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      << "max_shard_tokens " << options.max_shard_tokens;
  checked_input_bytes(options);
  TextEncoder encoder;
  if (!options.tokenizer_path.empty())
    encoder.bpe.emplace(BpeTokenizer::from_file(options.tokenizer_path));
  const std::optional<int32_t> eot_id = eot_id_of(options, encoder);
  const bool uint32_tokens = encoder.vocab_size() > 65536;

  const std::string& out_dir = options.out_dir;
  const fs::path staging = make_staging_directory(out_dir);
  const TreeRemover remove_staging{staging};
  Spool spool(staging / "tokens.spool", uint32_tokens ? 4 : 2);
  for (const std::string& input : options.inputs) spool_input(input, encoder, eot_id, spool);

  const size_t total = spool.size();
  const size_t val_tokens =
      options.val_fraction == 0.0
          ? 0
          : std::max<size_t>(1, static_cast<size_t>(std::llround(
                                    options.val_fraction * static_cast<double>(total))));
  DSTRAIN_USER_CHECK(val_tokens < total)
      << "a validation fraction of " << options.val_fraction << " leaves no training tokens of "
      << total << "; use a smaller fraction or more text.";
  const TokenFormat format = uint32_tokens ? TokenFormat::kLlmcU32 : TokenFormat::kLlmcU16;
  spool.rewind();
  const std::vector<std::string> train_names = write_split(
      spool, total - val_tokens, staging, "train", options.max_shard_tokens, format);
  const std::vector<std::string> val_names =
      write_split(spool, val_tokens, staging, "val", options.max_shard_tokens, format);

  PrepareResult result;
  result.train_tokens = total - val_tokens;
  result.val_tokens = val_tokens;
  result.vocab_size = encoder.vocab_size();
  result.uint32_tokens = uint32_tokens;
  for (const auto& [names, files] : {std::pair{&train_names, &result.train_files},
                                     std::pair{&val_names, &result.val_files}}) {
    for (const std::string& name : *names) files->push_back(move_into_place(staging, out_dir, name));
  }
  fsync_directory(out_dir);
  // Masks of an earlier prepare --chat into out_dir would make these shards chat data.
  remove_stale_shards(out_dir, "train", result.train_files.size(), false);
  remove_stale_shards(out_dir, "val", result.val_files.size(), false);
  return result;
}

PrepareResult prepare(const std::string& input_txt_path, const std::string& out_dir,
                      double val_fraction, size_t max_shard_tokens) {
  PrepareOptions options;
  options.inputs = {input_txt_path};
  options.out_dir = out_dir;
  options.val_fraction = val_fraction;
  options.max_shard_tokens = max_shard_tokens;
  return prepare(options);
}

}  // namespace dstrain
