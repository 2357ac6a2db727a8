#include "data/conversations.h"

#include <algorithm>
#include <sstream>

#include "core/check.h"
#include "data/loader.h"

namespace dstrain {

namespace {

// Adds the conversation of flags [begin, end) of shard `shard` (offsets in its range).
void add_conversation(ConversationIndex& index, const uint8_t* flags, uint32_t shard, size_t begin,
                      size_t end, int64_t seq_len) {
  const size_t window = static_cast<size_t>(seq_len) + 1;
  const size_t length = std::min(end - begin, window);
  if (end - begin > window) ++index.truncated;
  uint32_t trained = 0;
  for (size_t i = begin + 1; i < begin + length; ++i) trained += (flags[i] & kMaskTrained) != 0;
  const int64_t number = static_cast<int64_t>(index.conversations.size()) + index.untrained;
  if (trained == 0) {
    if (index.untrained++ == 0) index.first_untrained = number;
    return;
  }
  index.conversations.push_back(Conversation{shard, begin, static_cast<uint32_t>(length), trained});
  index.tokens += static_cast<int64_t>(length);
  index.trained_targets += trained;
}

}  // namespace

ConversationIndex index_conversations(const TokenDataset& dataset, int64_t seq_len) {
  DSTRAIN_CHECK(dataset.masked() && seq_len >= 1) << "conversations of unmasked data";
  ConversationIndex index;
  for (size_t s = 0; s < dataset.shards().size(); ++s) {
    const TokenRange& range = dataset.shards()[s];
    const uint8_t* flags = range.source->mask().data() + range.begin;
    size_t start = 0;
    while (start < range.count && (flags[start] & kMaskConversationStart) == 0) ++start;
    index.fragments += static_cast<int64_t>(start);
    while (start < range.count) {
      size_t end = start + 1;
      while (end < range.count && (flags[end] & kMaskConversationStart) == 0) ++end;
      add_conversation(index, flags, static_cast<uint32_t>(s), start, end, seq_len);
      start = end;
    }
  }
  return index;
}

PackedRows pack_conversations(const ConversationIndex& index, int64_t seq_len) {
  PackedRows packed;
  int64_t used = seq_len;  // the first conversation begins a row
  for (size_t c = 0; c < index.conversations.size(); ++c) {
    const int64_t positions = index.conversations[c].length - 1;  // <= seq_len
    if (used + positions > seq_len) {
      packed.row_first.push_back(static_cast<int64_t>(c));
      packed.trained.push_back(0);
      used = 0;
    }
    used += positions;
    packed.trained.back() += index.conversations[c].trained;
  }
  packed.row_first.push_back(static_cast<int64_t>(index.conversations.size()));
  return packed;
}

TokenBatches batch_conversations(const ConversationIndex& index, int64_t seq_len,
                                 int64_t batch_tokens, int64_t multiple) {
  DSTRAIN_CHECK(seq_len >= 1 && multiple >= 1 && batch_tokens >= seq_len)
      << "seq_len " << seq_len << ", multiple " << multiple << ", batch_tokens " << batch_tokens;
  const auto width_of = [&](int64_t positions) {
    return std::min(seq_len, (positions + multiple - 1) / multiple * multiple);
  };
  TokenBatches batches;
  for (size_t c = 0; c < index.conversations.size(); ++c) {
    const int64_t own = width_of(index.conversations[c].length - 1);  // its inputs, <= seq_len
    const int64_t rows = batches.first.empty() ? 0 : static_cast<int64_t>(c) - batches.first.back();
    const int64_t wider = rows == 0 ? own : std::max(batches.width.back(), own);
    if (rows == 0 || (rows + 1) * wider > batch_tokens) {  // begins a micro-batch
      batches.first.push_back(static_cast<int64_t>(c));
      batches.trained.push_back(0);
      batches.width.push_back(own);
    } else {
      batches.width.back() = wider;
    }
    batches.trained.back() += index.conversations[c].trained;
  }
  batches.first.push_back(static_cast<int64_t>(index.conversations.size()));
  return batches;
}

std::string describe_conversations(const ConversationIndex& index, int64_t seq_len) {
  std::ostringstream text;
  const int64_t kept = static_cast<int64_t>(index.conversations.size());
  text << kept << " conversation(s), " << index.trained_targets << " trained token(s) of "
       << index.tokens << " read";
  if (kept > 0) {
    // One conversation per row of T positions: how much of them the conversations fill and train.
    const double positions = static_cast<double>(kept) * static_cast<double>(seq_len);
    text.precision(3);
    text << " (rows of " << seq_len << ": "
         << 100.0 * static_cast<double>(index.tokens - kept) / positions << "% filled, "
         << 100.0 * static_cast<double>(index.trained_targets) / positions << "% trained)";
  }
  if (index.truncated > 0) {
    text << "; " << index.truncated << " longer than --seq-len " << seq_len
         << " + 1 tokens, truncated";
  }
  if (index.untrained > 0) {
    text << "; " << index.untrained << " left out with no trained token in their first "
         << seq_len + 1 << " (the first is conversation " << index.first_untrained
         << ", counting from 0)";
  }
  return text.str();
}

}  // namespace dstrain
