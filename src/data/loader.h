// TokenDataset (a list of token ranges) and DataLoader (deterministic, resumable batches).
//
// Geometry: B sequences of T tokens per rank, R ranks, this is rank r.
// A window is B*T+1 consecutive tokens of one shard: inputs (B, T) = window[0 : B*T],
// targets (B, T) = window[1 : B*T+1]. Windows start every B*T tokens inside a shard and never
// cross a shard boundary, so a shard of n tokens holds floor((n-1) / (B*T)) windows; its
// remaining tail is never read. Windows are numbered 0, 1, ... across shards in shard order.
//
// Round k of an epoch: rank r reads window order[k*R + r], where order is the identity
// without shuffle and, with shuffle, a permutation of all windows drawn from (seed, epoch)
// with core/rng.h + Fisher-Yates (the same on every platform). An epoch has
// floor(W / R) rounds for W windows; the W mod R windows left over are skipped that epoch
// (with shuffle, different ones each epoch). Then the next epoch starts at round 0.
//
// The whole position is {epoch, next_round}: state() / restore() resume bit-identically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "data/token_file.h"

namespace dstrain {

// A contiguous range [begin, begin + count) of one source's tokens.
struct TokenRange {
  std::shared_ptr<const TokenSource> source;
  size_t begin = 0;
  size_t count = 0;
};

class TokenDataset {
 public:
  TokenDataset() = default;
  // Every file the spec names (a path or a glob, see expand_data_paths), one shard each,
  // in sorted order; every token is checked against vocab_size (UserError on the first id
  // >= vocab_size, naming file, id and position). REQUIRES: vocab_size > 0.
  static TokenDataset open(const std::string& spec, int64_t vocab_size);
  // One shard holding an in-memory token stream (the synthetic corpus). Same id check.
  static TokenDataset from_tokens(std::vector<int32_t> tokens, int64_t vocab_size,
                                  std::string name = "in-memory tokens");

  // Appends a shard. REQUIRES: range.source and range.begin + range.count <= source size.
  void add(TokenRange range);

  const std::vector<TokenRange>& shards() const { return shards_; }
  size_t num_tokens() const;
  // What error messages call the data: the spec or name it was made from.
  const std::string& description() const { return description_; }
  void set_description(std::string description) { description_ = std::move(description); }

 private:
  std::vector<TokenRange> shards_;
  std::string description_ = "the data";
};

// The held-out split used when no validation data is given: the validation view is the tail
// of the dataset (its shards concatenated in order) holding
//   max(ceil(val_fraction * N), min_val_tokens) tokens,
// the training view is everything before it. Both share the sources (no copy). The cut may
// fall inside a shard; a tail spanning several shards keeps their boundaries, and windows
// still never cross them. Pass min_val_tokens = R*B*T + 1 so the tail holds at least one
// validation round when it lies in one shard (the DataLoader checks the window count).
// Throws UserError when the split would leave the training view without a token.
// REQUIRES: 0 < val_fraction < 1.
struct TrainValViews {
  TokenDataset train;
  TokenDataset val;
};
TrainValViews held_out_split(const TokenDataset& data, double val_fraction,
                             size_t min_val_tokens);

struct LoaderOptions {
  int64_t batch = 1;     // B: sequences per rank per round
  int64_t seq_len = 1;   // T
  int ranks = 1;         // R
  int rank = 0;          // r
  bool shuffle = false;
  uint64_t seed = 0;     // shuffle seed; unused without shuffle
};

// A state saved with R ranks, expressed for `ranks` ranks: the same windows consumed, so a
// run resumed on another number of ranks (with the same micro-batches per step) reads the
// same data next. Throws UserError when the position is not on a round boundary of `ranks`.
nlohmann::json rebase_loader_state(const nlohmann::json& state, int ranks);

class DataLoader {
 public:
  // Throws UserError when the dataset holds fewer than R windows (the message says how many
  // tokens one shard needs: R*B*T+1).
  // REQUIRES: B >= 1, T >= 1, R >= 1, 0 <= r < R.
  DataLoader(TokenDataset dataset, const LoaderOptions& options);

  // Reads this rank's batch of the current round and advances one round.
  // inputs and targets: (B, T) int32 each, row-major. REQUIRES: non-null, no overlap.
  void next_batch(int32_t* inputs, int32_t* targets);
  // Same into CPU tensors. REQUIRES: dtype I32, shape (B, T), device CPU.
  void next_batch(const Tensor& inputs, const Tensor& targets);

  int64_t num_windows() const { return num_windows_; }
  int64_t rounds_per_epoch() const { return num_windows_ / options_.ranks; }
  int64_t epoch() const { return epoch_; }
  int64_t next_round() const { return next_round_; }
  const LoaderOptions& options() const { return options_; }
  // The global window this rank reads in round `round` of `epoch`.
  // REQUIRES: 0 <= round < rounds_per_epoch(), epoch >= 0.
  // (Not const: with shuffle it draws, and caches, that epoch's permutation.)
  int64_t window_index(int64_t epoch, int64_t round);
  // Where window w starts: its shard and the offset of its first token inside that shard.
  // REQUIRES: 0 <= w < num_windows().
  std::pair<size_t, size_t> window_location(int64_t w) const;

  // Back to epoch 0, round 0 (e.g. to evaluate the same validation batches every time).
  void reset();

  // {"epoch", "next_round"} plus the geometry it was taken with ("windows", "batch",
  // "seq_len", "ranks", "shuffle", "seed"; the rank is left out so one state serves all ranks).
  nlohmann::json state() const;
  // Resumes from state(). Throws UserError when the state is malformed (not an object, a
  // missing or non-integer epoch / next_round, a negative value, next_round past the epoch's
  // rounds) or when a geometry field it carries differs from this loader's.
  void restore(const nlohmann::json& state);

 private:
  void build_order(int64_t epoch);

  TokenDataset dataset_;
  LoaderOptions options_;
  int64_t num_windows_ = 0;
  std::vector<int64_t> first_window_;  // (shards + 1,): prefix sums of windows per shard
  int64_t epoch_ = 0;
  int64_t next_round_ = 0;
  int64_t order_epoch_ = -1;           // the epoch `order_` was drawn for
  std::vector<int64_t> order_;         // (num_windows,) shuffled window ids; empty unshuffled
};

}  // namespace dstrain
