// Chat data in the loader: loss mask files beside token shards, the conversations they mark,
// and the rows the DataLoader makes of them (one conversation per row, padded, the untrained
// targets kIgnoreTarget), checked against rows built here from the raw tokens and flags.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "core/rng.h"
#include "data/conversations.h"
#include "data/loader.h"
#include "data/loss_mask.h"
#include "data/token_file.h"
#include "kernels/ops.h"
#include "test_util.h"

namespace dstrain {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// Random conversations: lengths in [2, max_length], each with a random prompt of 1+ tokens and
// then a trained reply (or, with probability 1/5, nothing trained at all).
struct ChatCorpus {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  std::vector<size_t> starts;  // each conversation's first token
};

ChatCorpus random_chat(uint64_t seed, int conversations, int max_length, int vocab) {
  std::mt19937_64 rng(seed);
  ChatCorpus c;
  for (int i = 0; i < conversations; ++i) {
    const int length = 2 + static_cast<int>(rng() % static_cast<uint64_t>(max_length - 1));
    const int prompt = 1 + static_cast<int>(rng() % static_cast<uint64_t>(length));
    const bool untrained = rng() % 5 == 0;
    c.starts.push_back(c.tokens.size());
    for (int t = 0; t < length; ++t) {
      c.tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
      uint8_t f = t == 0 ? kMaskConversationStart : 0;
      if (t >= prompt && !untrained) f |= kMaskTrained;
      c.flags.push_back(f);
    }
  }
  return c;
}

// The row the loader must make of the conversation [begin, end) of `c`, built independently.
void expected_row(const ChatCorpus& c, size_t begin, size_t end, int64_t T,
                  std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  inputs.assign(static_cast<size_t>(T), 0);
  targets.assign(static_cast<size_t>(T), kIgnoreTarget);
  for (size_t i = 0; i + 1 < end - begin && i < static_cast<size_t>(T); ++i) {
    inputs[i] = c.tokens[begin + i];
    if (c.flags[begin + i + 1] & kMaskTrained) targets[i] = c.tokens[begin + i + 1];
  }
}

TEST(LossMask, FileRoundTripsBesideItsShard) {
  TempDir dir;
  const ChatCorpus c = random_chat(1, 20, 12, 50);
  const std::string shard = dir.file("train_000000.bin");
  write_token_file(shard, c.tokens, TokenFormat::kLlmcU16);
  EXPECT_EQ(mask_path_for(shard), dir.file("train_000000.mask"));
  EXPECT_EQ(mask_path_for("x.u32"), "x.u32.mask");
  write_mask_file(mask_path_for(shard), c.flags);
  const auto source = TokenSource::open_file(shard, 50);
  ASSERT_EQ(source->mask().size(), c.tokens.size());
  EXPECT_TRUE(std::equal(c.flags.begin(), c.flags.end(), source->mask().begin()));
  // Without the mask: text.
  std::filesystem::remove(mask_path_for(shard));
  EXPECT_TRUE(TokenSource::open_file(shard, 50)->mask().empty());
}

TEST(LossMask, BadFilesAreRefused) {
  TempDir dir;
  const ChatCorpus c = random_chat(2, 5, 8, 30);
  const std::string shard = dir.file("train_000000.bin");
  const std::string mask = mask_path_for(shard);
  write_token_file(shard, c.tokens, TokenFormat::kLlmcU16);
  write_mask_file(mask, c.flags);
  const std::string good = read_bytes(mask);
  auto with = [&](std::string bytes) {
    write_bytes(mask, bytes);
    return [shard] { TokenSource::open_file(shard, 30); };
  };
  EXPECT_USER_ERROR(with(good.substr(0, 100))(), "shorter than its 1024-byte header");
  std::string magic = good;
  magic[0] = 'x';
  EXPECT_USER_ERROR(with(magic)(), "is not a dstrain loss mask");
  EXPECT_USER_ERROR(with(good.substr(0, good.size() - 1))(), "truncated or corrupt");
  std::string count = good;
  count[8] = static_cast<char>(count[8] + 1);
  EXPECT_USER_ERROR(with(count)(), "do not belong together");
  std::string bits = good;
  bits[1024 + 3] = 7;
  EXPECT_USER_ERROR(with(bits)(), "the byte 7 at token 3");
  std::string start = good;
  start[1024] = kMaskTrained;
  EXPECT_USER_ERROR(with(start)(), "does not begin a conversation");
}

TEST(LossMask, AGlobThatTakesTheMasksSaysSo) {
  TempDir dir;
  const ChatCorpus c = random_chat(9, 5, 8, 30);
  write_token_file(dir.file("train_000000.bin"), c.tokens, TokenFormat::kLlmcU16);
  write_mask_file(dir.file("train_000000.mask"), c.flags);
  EXPECT_USER_ERROR(TokenDataset::open(dir.file("train_*"), 30), "is the loss mask of a chat shard",
                    "train_*.bin");
}

TEST(LossMask, ChatAndTextShardsDoNotMix) {
  TempDir dir;
  const ChatCorpus c = random_chat(3, 5, 8, 30);
  write_token_file(dir.file("a.bin"), c.tokens, TokenFormat::kLlmcU16);
  write_mask_file(dir.file("a.mask"), c.flags);
  write_token_file(dir.file("b.bin"), c.tokens, TokenFormat::kLlmcU16);
  EXPECT_USER_ERROR(TokenDataset::open(dir.file("*.bin"), 30), "cannot be mixed");
}

TEST(ChatLoader, RowsAreWholeConversationsPaddedWithUntrainedTargetsIgnored) {
  const ChatCorpus c = random_chat(4, 60, 14, 40);
  const int64_t T = 9, B = 3;
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 40, "chat", c.flags);
  ASSERT_TRUE(data.masked());
  const ConversationIndex index = index_conversations(data, T);
  // Independently: which conversations keep a trained target in their first T+1 tokens.
  std::vector<size_t> kept;
  int64_t truncated = 0;
  for (size_t i = 0; i < c.starts.size(); ++i) {
    const size_t end = i + 1 < c.starts.size() ? c.starts[i + 1] : c.tokens.size();
    truncated += end - c.starts[i] > static_cast<size_t>(T + 1);
    bool trained = false;
    for (size_t t = c.starts[i] + 1; t < std::min(end, c.starts[i] + T + 1); ++t)
      trained |= (c.flags[t] & kMaskTrained) != 0;
    if (trained) kept.push_back(i);
  }
  ASSERT_GT(kept.size(), 10u);
  ASSERT_LT(kept.size(), c.starts.size()) << "the corpus must have left-out conversations";
  ASSERT_GT(truncated, 0);
  EXPECT_EQ(index.conversations.size(), kept.size());
  EXPECT_EQ(index.truncated + 0, truncated);
  EXPECT_EQ(index.untrained, static_cast<int64_t>(c.starts.size() - kept.size()));

  DataLoader loader(data, LoaderOptions{B, T, 1, 0, false, 0, 0});
  EXPECT_EQ(loader.num_sequences(), static_cast<int64_t>(kept.size()));
  std::vector<int32_t> inputs(B * T), targets(B * T), want_in, want_t;
  for (int64_t round = 0; round < loader.rounds_per_epoch(); ++round) {
    int64_t trained_ahead = loader.trained_targets_ahead(B);
    loader.next_batch(inputs.data(), targets.data());
    int64_t trained = 0;
    for (int64_t row = 0; row < B; ++row) {
      const size_t i = kept[static_cast<size_t>(round * B + row)];
      const size_t end = i + 1 < c.starts.size() ? c.starts[i + 1] : c.tokens.size();
      expected_row(c, c.starts[i], end, T, want_in, want_t);
      EXPECT_TRUE(std::equal(want_in.begin(), want_in.end(), inputs.begin() + row * T))
          << "inputs of conversation " << i;
      EXPECT_TRUE(std::equal(want_t.begin(), want_t.end(), targets.begin() + row * T))
          << "targets of conversation " << i;
      for (int32_t t : want_t) trained += t != kIgnoreTarget;
    }
    EXPECT_EQ(trained_ahead, trained) << "round " << round;
  }
}

TEST(ChatLoader, ShuffleAndRanksReadEveryConversationOnce) {
  const ChatCorpus c = random_chat(5, 80, 10, 40);
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 40, "chat", c.flags);
  const int64_t T = 16, B = 2, R = 3;
  std::vector<DataLoader> loaders;
  for (int r = 0; r < R; ++r) loaders.emplace_back(data, LoaderOptions{B, T, R, r, true, 7, 0});
  std::multiset<std::vector<int32_t>> seen;
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int64_t round = 0; round < loaders[0].rounds_per_epoch(); ++round) {
    const int64_t ahead = loaders[0].trained_targets_ahead(B * R);
    int64_t trained = 0;
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(loaders[static_cast<size_t>(r)].trained_targets_ahead(B * R), ahead);
      loaders[static_cast<size_t>(r)].next_batch(inputs.data(), targets.data());
      for (int64_t row = 0; row < B; ++row) {
        seen.insert(std::vector<int32_t>(inputs.begin() + row * T, inputs.begin() + (row + 1) * T));
      }
      for (int32_t t : targets) trained += t != kIgnoreTarget;
    }
    EXPECT_EQ(trained, ahead) << "the step's trained targets, counted ahead on every rank";
  }
  const int64_t read = loaders[0].rounds_per_epoch() * B * R;
  EXPECT_EQ(static_cast<int64_t>(seen.size()), read);
  EXPECT_GT(read, 0);
}

TEST(ChatLoader, HeldOutSplitCutsBetweenConversations) {
  const ChatCorpus c = random_chat(6, 40, 10, 40);
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 40, "chat", c.flags);
  const TrainValViews views = held_out_split(data, 0.1, 1);
  const TokenRange& val = views.val.shards().at(0);
  EXPECT_NE(std::find(c.starts.begin(), c.starts.end(), val.begin), c.starts.end())
      << "the validation tail starts at token " << val.begin << ", inside a conversation";
  EXPECT_EQ(views.train.num_tokens() + views.val.num_tokens(), c.tokens.size());
  const int64_t T = 16;
  EXPECT_EQ(index_conversations(views.train, T).fragments, 0);
  EXPECT_EQ(index_conversations(views.val, T).fragments, 0);
}

TEST(ChatLoader, TooFewConversationsIsOneSentence) {
  const ChatCorpus c = random_chat(7, 3, 6, 20);
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 20, "chat", c.flags);
  EXPECT_USER_ERROR(DataLoader(data, LoaderOptions{4, 8, 2, 0, false, 0, 0}), "conversation(s)",
                    "one step reads 8");
}

// Each kept conversation's inputs and targets as one conversation per row of T reads them (the
// unpacked loader, in order).
std::pair<std::vector<std::vector<int32_t>>, std::vector<std::vector<int32_t>>>
rows_one_per_conversation(const TokenDataset& data, int64_t T) {
  DataLoader unpacked(data, LoaderOptions{1, T, 1, 0, false, 0, 0});
  std::vector<std::vector<int32_t>> inputs_of, targets_of;
  for (int64_t i = 0; i < unpacked.rounds_per_epoch(); ++i) {
    std::vector<int32_t> in(T), tg(T);
    unpacked.next_batch(in.data(), tg.data());
    inputs_of.push_back(in);
    targets_of.push_back(tg);
  }
  return {inputs_of, targets_of};
}

// Packing: rows of whole conversations in file order, each taking its n - 1 positions, a new row
// where the next does not fit; positions restart at each conversation and at the padding; the
// trained count ahead is the rows'.
TEST(ChatLoader, PackedRowsHoldWholeConversationsInOrder) {
  const ChatCorpus c = random_chat(8, 90, 14, 40);
  const int64_t T = 24, B = 2;
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 40, "chat", c.flags);
  LoaderOptions options{B, T, 1, 0, false, 0, 0};
  options.packing = true;
  DataLoader loader(data, options);
  ASSERT_TRUE(loader.packed());
  // Independently: the kept conversations' rows (as unpacked), then greedy packing.
  const auto [inputs_of, targets_of] = rows_one_per_conversation(data, T);
  const ConversationIndex index = index_conversations(data, T);
  std::vector<std::vector<size_t>> rows(1);
  int64_t used = 0;
  for (size_t k = 0; k < index.conversations.size(); ++k) {
    const int64_t n = index.conversations[k].length - 1;
    if (used + n > T) {
      rows.emplace_back();
      used = 0;
    }
    rows.back().push_back(k);
    used += n;
  }
  ASSERT_EQ(loader.num_sequences(), static_cast<int64_t>(rows.size()));
  ASSERT_LT(rows.size(), index.conversations.size()) << "nothing was packed: the test is void";
  std::vector<int32_t> in(B * T), tg(B * T), pos(B * T);
  for (int64_t round = 0; round < loader.rounds_per_epoch(); ++round) {
    const int64_t ahead = loader.trained_targets_ahead(B);
    loader.next_batch(in.data(), tg.data(), pos.data());
    int64_t trained = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t t = 0;
      for (size_t k : rows[static_cast<size_t>(round * B + b)]) {
        const int64_t n = index.conversations[k].length - 1;
        for (int64_t i = 0; i < n; ++i, ++t) {
          EXPECT_EQ(in[b * T + t], inputs_of[k][i]) << "row " << round * B + b << " token " << t;
          EXPECT_EQ(tg[b * T + t], targets_of[k][i]) << "row " << round * B + b << " token " << t;
          EXPECT_EQ(pos[b * T + t], i);
        }
      }
      for (int64_t p = 0; t < T; ++t, ++p) {
        EXPECT_EQ(tg[b * T + t], kIgnoreTarget);
        EXPECT_EQ(pos[b * T + t], p) << "the padding counts as one more sequence";
      }
    }
    for (int32_t target : tg) trained += target != kIgnoreTarget;
    EXPECT_EQ(trained, ahead);
  }
  // A state saved packed does not resume unpacked.
  const nlohmann::json state = loader.state();
  DataLoader other(data, LoaderOptions{B, T, 1, 0, false, 0, 0});
  EXPECT_USER_ERROR(other.restore(state), "packing");
}

// A token budget (--batch-tokens): micro-batches of whole conversations in file order, one per
// row, the rows as wide as the longest's inputs rounded up to 8 (at most T), as many as keep
// rows x width within the budget; over 3 ranks with shuffle every conversation is read once an
// epoch, and the trained targets and positions are counted ahead on every rank.
TEST(ChatLoader, TokenBudgetMicroBatchesHoldWholeConversations) {
  const ChatCorpus c = random_chat(9, 150, 30, 40);
  const int64_t T = 40, N = 80, R = 3;
  TokenDataset data = TokenDataset::from_tokens(c.tokens, 40, "chat", c.flags);
  const ConversationIndex index = index_conversations(data, T);
  // Independently: the greedy cut.
  std::vector<std::vector<size_t>> batches;
  std::vector<int64_t> widths;
  for (size_t k = 0; k < index.conversations.size(); ++k) {
    const int64_t n = index.conversations[k].length - 1;
    const int64_t width = std::min<int64_t>(T, (n + 7) / 8 * 8);
    const int64_t wider = batches.empty() ? width : std::max(widths.back(), width);
    if (batches.empty() || static_cast<int64_t>(batches.back().size() + 1) * wider > N) {
      batches.emplace_back();
      widths.push_back(width);
    } else {
      widths.back() = wider;
    }
    batches.back().push_back(k);
  }
  std::set<int64_t> distinct(widths.begin(), widths.end());
  ASSERT_GT(distinct.size(), 2u) << "the micro-batches must differ in width";
  LoaderOptions options{1, T, R, 0, true, 11, 0};
  options.batch_tokens = N;
  options.width_multiple = 8;
  EXPECT_EQ(count_sequences(data, options), static_cast<int64_t>(batches.size()));
  const auto [inputs_of, targets_of] = rows_one_per_conversation(data, T);
  std::vector<DataLoader> loaders;
  for (int r = 0; r < R; ++r) {
    options.rank = r;
    loaders.emplace_back(data, options);
    ASSERT_TRUE(loaders.back().token_batches());
  }
  std::multiset<size_t> seen;
  std::vector<int32_t> in(N), tg(N);
  for (int64_t round = 0; round < loaders[0].rounds_per_epoch(); ++round) {
    const int64_t trained_ahead = loaders[0].trained_targets_ahead(R);
    const int64_t positions_ahead = loaders[0].positions_ahead(R);
    int64_t trained = 0, positions = 0;
    for (int r = 0; r < R; ++r) {
      DataLoader& loader = loaders[static_cast<size_t>(r)];
      EXPECT_EQ(loader.trained_targets_ahead(R), trained_ahead);
      const int64_t m = loader.sequence_index(loader.epoch(), round * R + r);
      const BatchShape shape = loader.next_batch(in.data(), tg.data());
      const std::vector<size_t>& batch = batches[static_cast<size_t>(m)];
      ASSERT_EQ(shape.rows, static_cast<int64_t>(batch.size()));
      ASSERT_EQ(shape.positions, widths[static_cast<size_t>(m)]);
      EXPECT_LE(shape.rows * shape.positions, N);
      positions += shape.rows * shape.positions;
      for (int64_t row = 0; row < shape.rows; ++row) {
        const size_t k = batch[static_cast<size_t>(row)];
        seen.insert(k);
        for (int64_t t = 0; t < shape.positions; ++t) {
          EXPECT_EQ(in[row * shape.positions + t], inputs_of[k][t]) << "conversation " << k;
          EXPECT_EQ(tg[row * shape.positions + t], targets_of[k][t]) << "conversation " << k;
        }
      }
      for (int64_t i = 0; i < shape.rows * shape.positions; ++i) trained += tg[i] != kIgnoreTarget;
    }
    EXPECT_EQ(trained, trained_ahead) << "round " << round;
    EXPECT_EQ(positions, positions_ahead) << "round " << round;
  }
  const int64_t read_batches = loaders[0].rounds_per_epoch() * R;
  EXPECT_EQ(read_batches, static_cast<int64_t>(batches.size()) / R * R);
  for (size_t k : seen) EXPECT_EQ(seen.count(k), 1u) << "conversation " << k << " read twice";
  EXPECT_GT(seen.size(), index.conversations.size() / 2);
  // A state saved with a budget does not resume without it.
  const nlohmann::json state = loaders[0].state();
  DataLoader other(data, LoaderOptions{1, T, R, 0, true, 11, 0});
  EXPECT_USER_ERROR(other.restore(state), "batch-tokens");
}

}  // namespace
}  // namespace dstrain
