// prepare: text files -> llm.c token shards for training and validation, with the byte
// tokenizer or a Hugging Face byte-level BPE tokenizer.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dstrain {

constexpr size_t kDefaultMaxShardTokens = 100'000'000;

struct PrepareResult {
  size_t train_tokens = 0;
  size_t val_tokens = 0;
  std::vector<std::string> train_files;  // out_dir/train_000000.bin, train_000001.bin, ...
  std::vector<std::string> val_files;    // out_dir/val_000000.bin, ...; none for fraction 0
  int64_t vocab_size = 256;              // the tokenizer's: a model needs at least this many
  bool uint32_tokens = false;            // llm.c uint32 shards (vocabulary over 65536)
};

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files, tokenized one after the other
  std::string out_dir;
  double val_fraction = 0.1;        // in [0, 1); 0 writes training shards only
  size_t max_shard_tokens = kDefaultMaxShardTokens;
  // A Hugging Face tokenizer.json (data/bpe_tokenizer.h): ids as the `tokenizers` library's
  // encode(text, add_special_tokens=False), no post-processor tokens. Empty: bytes (ids 0..255).
  std::string tokenizer_path;
  bool append_eot = false;  // the end-of-text id after each input file (needs a tokenizer)
  std::string eot_token;    // with append_eot: this token's id instead of the tokenizer's own
};

// Tokenizes the inputs (bytes, or tokenizer_path's byte-level BPE; UTF-8 text for the latter)
// and writes llm.c shards: uint16 (magic 20240520, version 1) when the vocabulary has at most
// 65536 ids, uint32 (magic 20240801, version 7) otherwise. The last
// max(1, round(val_fraction * tokens)) tokens (none when val_fraction is 0) go to
// out_dir/val_NNNNNN.bin, the others to out_dir/train_NNNNNN.bin, at most max_shard_tokens
// tokens per shard. The inputs are streamed (a BPE tokenizer sees them in blocks cut at
// newlines, BpeTokenizer::safe_prefix_length, which gives the ids of the whole text), through
// a spool file of the tokens in the staging directory, so they may be larger than memory.
// out_dir is created when missing. The shards are written into a hidden staging directory
// out_dir/.prepare-tmp-<pid> and moved into out_dir only once all of them are complete, so a
// failure leaves out_dir as it was (the staging directory is removed); numbered
// train_/val_ shards left in out_dir by an earlier, larger run are then removed, so a glob
// over out_dir sees exactly this run's shards.
// Throws UserError when there is no input, an input does not exist or is a directory, the
// inputs hold under 1024 bytes with a validation split (too small for a useful split) or
// nothing at all, val_fraction is not in [0, 1), the tokenizer cannot be read (nothing is
// written then), append_eot has no tokenizer or the tokenizer no such token, a BPE input is
// not UTF-8, or a file cannot be written.
// REQUIRES: 1 <= max_shard_tokens <= 2^31 - 1.
PrepareResult prepare(const PrepareOptions& options);

// prepare() of one file with the byte tokenizer.
PrepareResult prepare(const std::string& input_txt_path, const std::string& out_dir,
                      double val_fraction = 0.1, size_t max_shard_tokens = kDefaultMaxShardTokens);

}  // namespace dstrain
