// prepare: a text file -> byte-level llm.c token shards for training and validation.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace dstrain {

constexpr size_t kDefaultMaxShardTokens = 100'000'000;

struct PrepareResult {
  size_t train_tokens = 0;
  size_t val_tokens = 0;
  std::vector<std::string> train_files;  // out_dir/train_000000.bin, train_000001.bin, ...
  std::vector<std::string> val_files;    // out_dir/val_000000.bin, ...
};

// Reads input_txt_path, byte-tokenizes it (vocabulary 256) and writes llm.c uint16 shards
// (magic 20240520, version 1): the first bytes go to out_dir/train_NNNNNN.bin, the last
// max(1, round(val_fraction * size)) bytes to out_dir/val_NNNNNN.bin, at most
// max_shard_tokens tokens per shard. The input is streamed, so it may be larger than memory.
// out_dir is created when missing. The shards are written into a hidden staging directory
// out_dir/.prepare-tmp-<pid> and moved into out_dir only once all of them are complete, so a
// failure leaves out_dir as it was (the staging directory is removed); numbered
// train_/val_ shards left in out_dir by an earlier, larger run are then removed, so a glob
// over out_dir sees exactly this run's shards.
// Throws UserError when the input does not exist or is a directory, is under 1024 bytes (too
// small for a useful split), val_fraction is not in (0, 1), or a file cannot be written.
// REQUIRES: 1 <= max_shard_tokens <= 2^31 - 1.
PrepareResult prepare(const std::string& input_txt_path, const std::string& out_dir,
                      double val_fraction = 0.1, size_t max_shard_tokens = kDefaultMaxShardTokens);

}  // namespace dstrain
