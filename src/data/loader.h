// TokenDataset (a list of token ranges) and DataLoader (deterministic, resumable batches).
//
// Geometry: B sequences of T tokens per rank, R ranks, this is rank r; S sequences per
// optimizer step (B*R times the accumulation).
// A sequence is T+1 consecutive tokens of one shard: inputs = seq[0 : T], targets =
// seq[1 : T+1]. Sequences start every T tokens inside a shard and never cross a shard
// boundary, so a shard of n tokens holds floor((n-1) / T) of them; its remaining tail is never
// read. Sequences are numbered 0, 1, ... across shards in shard order.
//
// An epoch reads the sequences in `order`: the identity without shuffle and, with shuffle, a
// permutation of all W sequences drawn from (seed, epoch) with core/rng.h + Fisher-Yates (the
// same on every platform). It reads floor(W / S) whole steps of S sequences; the W mod S left
// over are skipped that epoch (with shuffle, different ones each epoch). Round k of an epoch:
// rank r reads the B sequences order[(k*R + r)*B + i], i < B (unshuffled, consecutive tokens
// of one shard, as llm.c reads a batch, unless a shard ends among them).
//
// Chat data (every shard with a loss mask, data/loss_mask.h): a sequence is one conversation
// (data/conversations.h), not a window of T tokens; its row is padded and its prompt and padding
// targets are kIgnoreTarget. Conversations with no trained target in their window are left out.
// With packing, a sequence is a row of whole conversations instead: packed greedily in dataset
// order, each taking its n - 1 input positions (n = min(its length, T + 1)), a new row begun
// where the next does not fit; the positions (kernels/ops.h) restart at each conversation and
// at the padding after the last.
//
// With a token budget (batch_tokens, chat data without packing), a sequence is a micro-batch of
// whole conversations instead (batch_conversations): a rank reads one per round (B = 1), as
// rows of its own width t <= T; next_batch says its shape.
//
// The position is {epoch, next_sequence}: a count of sequences, whatever B, R and the
// accumulation, so a run resumed with another split of the same S sequences per step (other
// ranks, micro-batch or accumulation) reads the same sequences next. state() / restore()
// resume bit-identically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "data/conversations.h"
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
  // `mask`: none (text) or its loss mask's flags (TokenSource::from_tokens).
  static TokenDataset from_tokens(std::vector<int32_t> tokens, int64_t vocab_size,
                                  std::string name = "in-memory tokens",
                                  std::vector<uint8_t> mask = {});

  // Appends a shard. Throws UserError when it has a loss mask and the shards before it have
  // none, or the other way round (chat data and text cannot be mixed).
  // REQUIRES: range.source and range.begin + range.count <= source size.
  void add(TokenRange range);
  // Chat data: every shard has a loss mask (false without shards).
  bool masked() const { return !shards_.empty() && shards_[0].source->mask().size() > 0; }
  // Chat data: index_conversations(*this, seq_len), scanned once and shared by this dataset's
  // copies (each rank's loaders), whichever thread asks first. REQUIRES: masked().
  std::shared_ptr<const ConversationIndex> conversations(int64_t seq_len) const;

  const std::vector<TokenRange>& shards() const { return shards_; }
  size_t num_tokens() const;
  // What error messages call the data: the spec or name it was made from.
  const std::string& description() const { return description_; }
  void set_description(std::string description) { description_ = std::move(description); }

 private:
  std::vector<TokenRange> shards_;
  std::string description_ = "the data";
  // conversations() by seq_len; a new one whenever a shard is added.
  struct ConversationCache {
    std::mutex mutex;
    std::map<int64_t, std::shared_ptr<const ConversationIndex>> by_seq_len;
  };
  std::shared_ptr<ConversationCache> conversation_cache_ = std::make_shared<ConversationCache>();
};

// The held-out split used when no validation data is given: the validation view is the tail
// of the dataset (its shards concatenated in order) holding
//   max(ceil(val_fraction * N), min_val_tokens) tokens,
// the training view is everything before it. Both share the sources (no copy). The cut may
// fall inside a shard (of chat data: at the start of the conversation it would cut, so the tail
// holds whole conversations); a tail spanning several shards keeps their boundaries, and windows
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
  // S: sequences per optimizer step, a multiple of B*R (0: B*R, one round per step).
  int64_t sequences_per_step = 0;
  bool packing = false;  // chat data: several conversations per row (ignored for text)
  // Chat data without packing: micro-batches of at most this many positions (0: B rows of T),
  // their widths rounded up to width_multiple. REQUIRES: batch 1, batch_tokens >= seq_len.
  int64_t batch_tokens = 0;
  int64_t width_multiple = 1;
};

// What next_batch wrote: `rows` rows of `positions` each, contiguous from the buffers' start.
struct BatchShape {
  int64_t rows = 0, positions = 0;
};

// The sequences of T tokens (T+1 with the target) `dataset` holds: floor((n-1) / T) per shard;
// of chat data, its conversations with a trained target (index_conversations), or with packing
// the rows they pack into (pack_conversations).
int64_t count_sequences(const TokenDataset& dataset, int64_t seq_len, bool packing = false);
// The same under a token budget: the micro-batches of batch_conversations (or count_sequences'
// without one: batch_tokens 0).
int64_t count_sequences(const TokenDataset& dataset, const LoaderOptions& options);

class DataLoader {
 public:
  // Throws UserError when the dataset holds fewer sequences than one step reads (the message
  // says how many tokens one shard needs: S*T+1).
  // REQUIRES: B >= 1, T >= 1, R >= 1, 0 <= r < R, S a positive multiple of B*R (or 0).
  DataLoader(TokenDataset dataset, const LoaderOptions& options);

  // Reads this rank's batch of the current round and advances one round.
  // inputs and targets: (B, T) int32 each, row-major; positions (B, T) or null: each token's
  // place in its conversation with packing, t otherwise. With a token budget, (rows, t) of the
  // micro-batch (rows * t <= batch_tokens). REQUIRES: inputs and targets non-null, no overlap,
  // room for B * T (or batch_tokens) each.
  BatchShape next_batch(int32_t* inputs, int32_t* targets, int32_t* positions = nullptr);
  // Same into CPU tensors (positions may be empty). REQUIRES: dtype I32, shape (B, T), device CPU.
  BatchShape next_batch(const Tensor& inputs, const Tensor& targets, const Tensor& positions = {});
  // Rows of several conversations (chat data with options().packing).
  bool packed() const { return !row_first_.empty() && row_width_.empty(); }
  // Micro-batches under a token budget (options().batch_tokens with chat data).
  bool token_batches() const { return !row_width_.empty(); }
  // The positions the next `sequences` sequences hold (every rank's, in order): sequences * T,
  // or the rows x width of each micro-batch under a token budget. For tokens/s.
  // REQUIRES: as trained_targets_ahead.
  int64_t positions_ahead(int64_t sequences);

  int64_t num_sequences() const { return num_sequences_; }
  int64_t sequences_per_step() const { return step_; }
  int64_t steps_per_epoch() const { return num_sequences_ / step_; }
  int64_t rounds_per_epoch() const { return steps_per_epoch() * step_ / round_; }
  int64_t epoch() const { return epoch_; }
  int64_t next_round() const { return next_round_; }
  const LoaderOptions& options() const { return options_; }
  // The sequence at `position` (0-based, in sequences) of `epoch`'s order.
  // REQUIRES: 0 <= position < steps_per_epoch() * S, epoch >= 0.
  // (Not const: with shuffle it draws, and caches, that epoch's permutation.)
  int64_t sequence_index(int64_t epoch, int64_t position);
  // Where sequence s starts: its shard and the offset of its first token inside that shard.
  // REQUIRES: 0 <= s < num_sequences().
  std::pair<size_t, size_t> sequence_location(int64_t s) const;

  // The targets the loss counts in the next `sequences` sequences from the current position
  // (every rank's, in order): sequences * T for text; of chat data, the trained ones. Divides
  // the summed loss of a step into its mean over trained tokens (of every micro-batch and rank).
  // REQUIRES: the current position + sequences stays within the epoch.
  int64_t trained_targets_ahead(int64_t sequences);
  // Chat data: its conversations; nullptr for text.
  const ConversationIndex* conversations() const { return conversations_.get(); }

  // Back to epoch 0, round 0 (e.g. to evaluate the same validation batches every time).
  void reset();

  // {"epoch", "next_sequence"} plus the geometry it was taken with ("sequences",
  // "sequences_per_step", "seq_len", "shuffle", "seed"; not B, R or r: one state serves every
  // rank and any split of the step).
  nlohmann::json state() const;
  // Resumes from state(), or from a state of an earlier version ({"epoch", "next_round",
  // "ranks", "batch", ...}: next_round * ranks * batch sequences read). Throws UserError when
  // the state is malformed (not an object, a missing or non-integer epoch / position, a
  // negative value, a position past the epoch or between rounds of this geometry) or when a
  // geometry field it carries differs from this loader's.
  void restore(const nlohmann::json& state);

 private:
  void build_order(int64_t epoch);
  void read_text_row(int64_t sequence, int32_t* inputs, int32_t* targets) const;
  void read_conversation_row(int64_t sequence, int32_t* inputs, int32_t* targets) const;
  // Conversation c into positions [0, n-1) of the row pointers; returns n - 1.
  int64_t read_conversation(const Conversation& c, int32_t* inputs, int32_t* targets) const;
  void read_packed_row(int64_t row, int32_t* inputs, int32_t* targets, int32_t* positions) const;
  void pack_rows();
  void batch_rows();
  BatchShape read_token_batch(int64_t batch, int32_t* inputs, int32_t* targets,
                              int32_t* positions) const;

  TokenDataset dataset_;
  LoaderOptions options_;
  int64_t round_ = 1;                  // B*R: sequences per round
  int64_t step_ = 1;                   // S
  int64_t num_sequences_ = 0;
  std::vector<int64_t> first_sequence_;  // (shards + 1,): prefix sums of sequences per shard
  int64_t epoch_ = 0;
  int64_t next_round_ = 0;
  int64_t order_epoch_ = -1;           // the epoch `order_` was drawn for
  std::vector<int64_t> order_;         // (num_sequences,) shuffled ids; empty unshuffled
  std::shared_ptr<const ConversationIndex> conversations_;  // chat data; null for text
  // Packing: row r holds conversations [row_first_[r], row_first_[r + 1]); its trained targets.
  // A token budget: the same of micro-batch r, and its width.
  std::vector<int64_t> row_first_, row_trained_, row_width_;
};

}  // namespace dstrain
