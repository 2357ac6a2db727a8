// The conversations of chat data (token shards with loss masks, data/loss_mask.h), as the
// DataLoader reads them without packing: one conversation per row of T+1 tokens, inputs its
// tokens [0, n-1) and targets its tokens [1, n), n = min(its length, T+1); a target whose mask
// has no kMaskTrained bit, and the padding after n-1, are kIgnoreTarget (kernels/ops.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dstrain {

class TokenDataset;

struct Conversation {
  uint32_t shard = 0;    // index into the dataset's shards
  uint64_t offset = 0;   // its first token, counted from the shard range's begin
  uint32_t length = 0;   // tokens a row reads: min(its length, T+1)
  uint32_t trained = 0;  // targets among tokens [1, length) with kMaskTrained
};

struct ConversationIndex {
  // In dataset order, those with at least one trained target within the window.
  std::vector<Conversation> conversations;
  int64_t truncated = 0;         // longer than T+1 tokens: their tail is not read
  int64_t untrained = 0;         // no trained target in their first T+1 tokens: left out
  int64_t first_untrained = -1;  // the first such one, counted from 0 in dataset order
  int64_t fragments = 0;         // tokens of a shard range before its first conversation start
  int64_t tokens = 0;            // tokens the kept rows read
  int64_t trained_targets = 0;   // trained targets of the kept rows
};

// Scans the masks of every shard of `dataset`. A shard range's tokens before its first
// conversation start (a range cut inside a conversation) are skipped and counted as fragments.
// REQUIRES: dataset.masked(), seq_len >= 1.
ConversationIndex index_conversations(const TokenDataset& dataset, int64_t seq_len);

// Rows of T positions packed greedily in order: a conversation takes its length - 1 positions
// (its inputs; <= T), and one that does not fit begins a new row. Row r holds conversations
// [row_first[r], row_first[r + 1]); trained[r] is its trained targets.
struct PackedRows {
  std::vector<int64_t> row_first;  // (rows + 1)
  std::vector<int64_t> trained;    // (rows)
  int64_t rows() const { return static_cast<int64_t>(trained.size()); }
};
PackedRows pack_conversations(const ConversationIndex& index, int64_t seq_len);

// Micro-batches under a token budget (--batch-tokens, as DeepSpeed's DynamicBatchSampler
// max_tokens): whole conversations in order, one per row, each micro-batch's rows as wide as its
// longest conversation's inputs rounded up to `multiple` (at most seq_len); a conversation joins
// while rows x width stays within batch_tokens, and begins the next micro-batch otherwise.
// Micro-batch m holds conversations [first[m], first[m + 1]) in rows of width[m] positions.
struct TokenBatches {
  std::vector<int64_t> first;    // (batches + 1)
  std::vector<int64_t> trained;  // (batches)
  std::vector<int64_t> width;    // (batches)
  int64_t batches() const { return static_cast<int64_t>(trained.size()); }
  int64_t rows(int64_t m) const {
    return first[static_cast<size_t>(m) + 1] - first[static_cast<size_t>(m)];
  }
};
// REQUIRES: seq_len >= 1, multiple >= 1, batch_tokens >= seq_len (a conversation fits alone).
TokenBatches batch_conversations(const ConversationIndex& index, int64_t seq_len,
                                 int64_t batch_tokens, int64_t multiple);

// One sentence for the run's header: the conversations, the truncated and the left-out ones.
std::string describe_conversations(const ConversationIndex& index, int64_t seq_len);

}  // namespace dstrain
