#include "data/loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "core/rng.h"
#include "test_util.h"

namespace dstrain {
namespace {

using testing::TempDir;

// Tokens 0, 1, ..., n-1 (vocabulary n), so a token tells where it came from.
TokenDataset counting_dataset(size_t n) {
  std::vector<int32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), 0);
  return TokenDataset::from_tokens(std::move(tokens), static_cast<int64_t>(n), "counting");
}

LoaderOptions geometry(int64_t B, int64_t T, int ranks = 1, int rank = 0, bool shuffle = false,
                       uint64_t seed = 0) {
  LoaderOptions options;
  options.batch = B;
  options.seq_len = T;
  options.ranks = ranks;
  options.rank = rank;
  options.shuffle = shuffle;
  options.seed = seed;
  return options;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch draw(DataLoader& loader) {
  const size_t n = static_cast<size_t>(loader.options().batch * loader.options().seq_len);
  Batch batch{std::vector<int32_t>(n, -7), std::vector<int32_t>(n, -7)};
  loader.next_batch(batch.inputs.data(), batch.targets.data());
  return batch;
}

// Asserts the batch is window `w` of the counting dataset: B consecutive sequences from
// w*B*T, consecutive tokens, targets shifted by one (an unshuffled batch).
void expect_counting_window(const Batch& batch, int64_t w, int64_t stride) {
  ASSERT_EQ(batch.inputs.size(), static_cast<size_t>(stride));
  for (int64_t i = 0; i < stride; ++i) {
    ASSERT_EQ(batch.inputs[i], w * stride + i) << "window " << w << " token " << i;
    ASSERT_EQ(batch.targets[i], w * stride + i + 1) << "window " << w << " token " << i;
  }
}

// The counting sequences of a batch (each row must be one: T consecutive tokens from s*T,
// targets shifted by one): their ids, row by row.
std::vector<int64_t> counting_sequences(const Batch& batch, int64_t T) {
  std::vector<int64_t> ids;
  for (size_t row = 0; row * T < batch.inputs.size(); ++row) {
    const int32_t first = batch.inputs[row * T];
    EXPECT_EQ(first % T, 0) << "row " << row << " does not start a sequence";
    for (int64_t i = 0; i < T; ++i) {
      EXPECT_EQ(batch.inputs[row * T + i], first + i) << "row " << row;
      EXPECT_EQ(batch.targets[row * T + i], first + i + 1) << "row " << row;
    }
    ids.push_back(first / T);
  }
  return ids;
}

TEST(DataLoader, InOrder_one_rank_wraps_to_next_epoch) {
  // 34 tokens of T = 3: 11 sequences; steps of B = 2 read 10 of them, 5 rounds an epoch.
  DataLoader loader(counting_dataset(34), geometry(2, 3));
  EXPECT_EQ(loader.num_sequences(), 11);
  EXPECT_EQ(loader.rounds_per_epoch(), 5);
  for (int epoch = 0; epoch < 3; ++epoch)
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(loader.epoch(), epoch);
      EXPECT_EQ(loader.next_round(), k);
      expect_counting_window(draw(loader), k, 6);
    }
  EXPECT_EQ(loader.epoch(), 3);
}

TEST(DataLoader, InOrder_exact_fit_uses_last_token_as_target) {
  DataLoader loader(counting_dataset(13), geometry(2, 3));  // 4 sequences: 0..3 to 9..12
  EXPECT_EQ(loader.num_sequences(), 4);
  EXPECT_EQ(loader.rounds_per_epoch(), 2);
  DataLoader smaller(counting_dataset(12), geometry(2, 3));  // the last target is missing
  EXPECT_EQ(smaller.num_sequences(), 3);
  EXPECT_EQ(smaller.rounds_per_epoch(), 1);
  draw(loader);
  expect_counting_window(draw(loader), 1, 6);
}

TEST(DataLoader, InOrder_three_ranks_read_k_times_R_plus_r) {
  // 44 sequences of T = 5; rounds of 3 ranks x B = 4: 3 rounds, 8 sequences skipped.
  const size_t n = 11 * 20 + 1;
  std::vector<DataLoader> loaders;
  for (int r = 0; r < 3; ++r) loaders.emplace_back(counting_dataset(n), geometry(4, 5, 3, r));
  EXPECT_EQ(loaders[0].rounds_per_epoch(), 3);
  for (int epoch = 0; epoch < 2; ++epoch)
    for (int k = 0; k < 3; ++k)
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(loaders[r].sequence_index(epoch, (k * 3 + r) * 4), (k * 3 + r) * 4);
        expect_counting_window(draw(loaders[r]), k * 3 + r, 20);
      }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(loaders[r].epoch(), 2);
}

TEST(DataLoader, TensorOverloadFillsI32Tensors) {
  DataLoader loader(counting_dataset(100), geometry(3, 4));
  std::vector<int32_t> inputs(12, -1), targets(12, -1);
  const Tensor input_tensor(inputs.data(), DType::I32, {3, 4});
  const Tensor target_tensor(targets.data(), DType::I32, {3, 4});
  loader.next_batch(input_tensor, target_tensor);
  loader.next_batch(input_tensor, target_tensor);
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(inputs[i], 12 + i);
    EXPECT_EQ(targets[i], 13 + i);
  }
  std::vector<float> wrong(12);
  EXPECT_THROW(loader.next_batch(Tensor(wrong.data(), DType::F32, {3, 4}), target_tensor), Error);
  EXPECT_THROW(loader.next_batch(Tensor(inputs.data(), DType::I32, {4, 3}), target_tensor), Error);
}

TEST(DataLoader, Shuffle_epoch_is_a_permutation_of_sequences_and_deterministic) {
  const int64_t sequences = 74, T = 4;  // 37 rounds of B = 2
  const size_t n = sequences * T + 1;
  DataLoader a(counting_dataset(n), geometry(2, T, 1, 0, true, 42));
  DataLoader b(counting_dataset(n), geometry(2, T, 1, 0, true, 42));
  DataLoader other_seed(counting_dataset(n), geometry(2, T, 1, 0, true, 43));
  std::vector<std::vector<int64_t>> epochs;
  std::vector<int64_t> other_first_epoch;
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> order;
    for (int k = 0; k < sequences / 2; ++k) {
      const Batch batch = draw(a);
      ASSERT_EQ(batch, draw(b));
      for (int64_t s : counting_sequences(batch, T)) order.push_back(s);
      if (epoch == 0) {
        for (int64_t s : counting_sequences(draw(other_seed), T)) other_first_epoch.push_back(s);
      }
    }
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> identity(sequences);
    std::iota(identity.begin(), identity.end(), 0);
    EXPECT_EQ(sorted, identity) << "epoch " << epoch << " is not a permutation";
    EXPECT_NE(order, identity) << "epoch " << epoch << " was not shuffled";
    epochs.push_back(order);
  }
  EXPECT_NE(epochs[0], epochs[1]) << "each epoch draws its own permutation";
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_NE(epochs[0], other_first_epoch) << "the seed must change the order";
}

TEST(DataLoader, Shuffle_ranks_read_disjoint_sequences) {
  const int R = 3;
  const int64_t sequences = 40, T = 3;  // rounds of 3 x 2: 6 rounds, 4 left over per epoch
  std::vector<DataLoader> loaders;
  for (int r = 0; r < R; ++r)
    loaders.emplace_back(counting_dataset(sequences * T + 1), geometry(2, T, R, r, true, 7));
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::set<int64_t> seen;
    for (int k = 0; k < 6; ++k)
      for (int r = 0; r < R; ++r) {
        for (int64_t s : counting_sequences(draw(loaders[r]), T)) {
          EXPECT_TRUE(seen.insert(s).second) << "sequence " << s << " read twice in epoch " << epoch;
        }
      }
    EXPECT_EQ(seen.size(), 36u);
  }
}

// The step's sequences are the same whatever splits them (ranks x micro-batch x accumulation):
// a run resumed with another split of the same global batch reads the same data.
TEST(DataLoader, AStepsSequencesDoNotDependOnItsSplit) {
  const int64_t T = 4, S = 8;  // 8 sequences per step
  const size_t n = 50 * T + 3;  // 50 sequences: 6 steps an epoch, 2 left over
  for (const bool shuffle : {false, true}) {
    // (B, R): 8 x 1, 4 x 2 (accumulation 1), 2 x 2 (accumulation 2), 1 x 4 (2), 1 x 1 (8).
    std::vector<std::vector<std::set<int64_t>>> by_split;
    for (const auto& [B, R] : {std::pair{8, 1}, {4, 2}, {2, 2}, {1, 4}, {1, 1}}) {
      std::vector<DataLoader> ranks;
      for (int r = 0; r < R; ++r) {
        LoaderOptions options = geometry(B, T, R, r, shuffle, 11);
        options.sequences_per_step = S;
        ranks.emplace_back(counting_dataset(n), options);
      }
      std::vector<std::set<int64_t>> steps;
      for (int step = 0; step < 14; ++step) {  // into the third epoch
        std::set<int64_t> step_sequences;
        for (int64_t round = 0; round < S / (B * R); ++round)
          for (DataLoader& rank : ranks)
            for (int64_t s : counting_sequences(draw(rank), T)) step_sequences.insert(s);
        EXPECT_EQ(step_sequences.size(), static_cast<size_t>(S));
        steps.push_back(step_sequences);
      }
      EXPECT_EQ(ranks[0].epoch(), 2);
      by_split.push_back(steps);
    }
    for (size_t split = 1; split < by_split.size(); ++split) {
      EXPECT_EQ(by_split[split], by_split[0]) << "split " << split << ", shuffle " << shuffle;
    }
  }
}

// Shards whose tokens say shard and offset: token = 1000 * shard + offset.
TokenDataset tagged_shards(const std::vector<size_t>& sizes) {
  TokenDataset dataset;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<int32_t> tokens(sizes[s]);
    for (size_t i = 0; i < sizes[s]; ++i) tokens[i] = static_cast<int32_t>(1000 * s + i);
    auto source = TokenSource::from_tokens(std::move(tokens), 1000 * sizes.size());
    dataset.add(TokenRange{source, 0, sizes[s]});
  }
  return dataset;
}

TEST(DataLoader, MultipleShards_sequences_never_cross_boundaries) {
  // T = 5: shards of 25 (4 sequences), 10 (1), 31 (6) and 11 (2) tokens: 13 sequences, steps
  // of B = 2 read 12 of them.
  const std::vector<size_t> sizes = {25, 10, 31, 11};
  std::vector<std::pair<int, int>> all;  // (shard, offset) of every sequence, in order
  for (int s = 0; s < 4; ++s)
    for (size_t offset = 0; offset + 6 <= sizes[s]; offset += 5) all.emplace_back(s, offset);
  ASSERT_EQ(all.size(), 13u);
  for (const bool shuffle : {false, true}) {
    DataLoader loader(tagged_shards(sizes), geometry(2, 5, 1, 0, shuffle, 3));
    ASSERT_EQ(loader.num_sequences(), 13);
    std::set<std::pair<int, int>> seen;
    for (int k = 0; k < 6; ++k) {
      const Batch batch = draw(loader);
      for (int row = 0; row < 2; ++row) {
        const int32_t first = batch.inputs[row * 5];
        const int shard = first / 1000, offset = first % 1000;
        for (int i = 0; i < 5; ++i) {
          ASSERT_EQ(batch.inputs[row * 5 + i], 1000 * shard + offset + i);
          ASSERT_EQ(batch.targets[row * 5 + i], 1000 * shard + offset + i + 1);
          ASSERT_LT(static_cast<size_t>(offset + i + 1), sizes[shard]) << "read past the shard";
        }
        if (!shuffle) {
          EXPECT_EQ(std::make_pair(shard, offset), all[k * 2 + row]) << "round " << k;
        }
        EXPECT_TRUE(seen.insert({shard, offset}).second);
      }
    }
    EXPECT_EQ(seen.size(), 12u);
  }
}

TEST(DataLoader, SaveRestoreContinuesIdentically) {
  for (const bool shuffle : {false, true}) {
    const auto make = [&] {
      return DataLoader(tagged_shards({301, 157, 240}), geometry(3, 4, 2, 1, shuffle, 99));
    };
    DataLoader original = make();
    const int rounds = static_cast<int>(original.rounds_per_epoch());
    ASSERT_GT(rounds, 3);
    for (int i = 0; i < rounds + 3; ++i) draw(original);  // into the second epoch
    // Through text, as a checkpoint stores it.
    const nlohmann::json saved = nlohmann::json::parse(original.state().dump());
    EXPECT_EQ(saved["epoch"], 1);
    EXPECT_EQ(saved["next_sequence"], 3 * 6);
    std::vector<Batch> expected;
    for (int i = 0; i < 2 * rounds; ++i) expected.push_back(draw(original));

    DataLoader resumed = make();
    draw(resumed);  // a position restore() must overwrite
    resumed.restore(saved);
    EXPECT_EQ(resumed.epoch(), 1);
    EXPECT_EQ(resumed.next_round(), 3);
    for (int i = 0; i < 2 * rounds; ++i) ASSERT_EQ(draw(resumed), expected[i]) << "batch " << i;
  }
}

// A state saved with one split of the step resumes on another: the same sequences next.
TEST(DataLoader, RestoreOnAnotherSplitOfTheStep) {
  const int64_t T = 4;
  const size_t n = 60 * T + 1;
  const auto loader = [&](int64_t B, int R, int r) {
    LoaderOptions options = geometry(B, T, R, r, true, 5);
    options.sequences_per_step = 8;
    return DataLoader(counting_dataset(n), options);
  };
  DataLoader one = loader(8, 1, 0);
  for (int i = 0; i < 3; ++i) draw(one);
  const nlohmann::json saved = one.state();
  const std::vector<int64_t> next = counting_sequences(draw(one), T);
  // 2 ranks x 2 sequences x 2 micro-batches: the next step is the same 8 sequences.
  std::set<int64_t> split;
  for (int r = 0; r < 2; ++r) {
    DataLoader rank = loader(2, 2, r);
    rank.restore(saved);
    for (int m = 0; m < 2; ++m)
      for (int64_t s : counting_sequences(draw(rank), T)) split.insert(s);
  }
  EXPECT_EQ(split, std::set<int64_t>(next.begin(), next.end()));
  // Another global batch is refused: its epochs end elsewhere.
  LoaderOptions other = geometry(2, T, 1, 0, true, 5);
  other.sequences_per_step = 4;
  DataLoader wrong(counting_dataset(n), other);
  EXPECT_USER_ERROR(wrong.restore(saved), "sequences_per_step = 8", "sequences_per_step = 4");
  // A state of an earlier version: next_round rounds of ranks x batch sequences.
  DataLoader old = loader(8, 1, 0);
  old.restore(nlohmann::json{{"epoch", 0}, {"next_round", 3}, {"ranks", 1}, {"batch", 8},
                             {"shuffle", true}, {"seed", 5}});
  EXPECT_EQ(counting_sequences(draw(old), T), next);
}

TEST(DataLoader, ResetStartsOver) {
  DataLoader loader(counting_dataset(100), geometry(2, 4, 1, 0, true, 5));
  const Batch first = draw(loader);
  for (int i = 0; i < 20; ++i) draw(loader);
  loader.reset();
  EXPECT_EQ(draw(loader), first);
}

TEST(DataLoader, RestoreRejectsMalformedState) {
  DataLoader loader(counting_dataset(100), geometry(2, 4, 1, 0, true, 5));
  const int64_t epoch_sequences = loader.rounds_per_epoch() * 2;
  using nlohmann::json;
  EXPECT_USER_ERROR(loader.restore(json::array({1, 2})), "not an object");
  EXPECT_USER_ERROR(loader.restore(json{{"next_sequence", 0}}), "no 'epoch' field");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", 0}}), "no 'next_sequence' field");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", -1}, {"next_sequence", 0}}), "'epoch' = -1",
                    "non-negative integer");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", "2"}, {"next_sequence", 0}}), "'epoch'");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", 1.5}, {"next_sequence", 0}}), "'epoch' = 1.5");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", 0}, {"next_sequence", epoch_sequences}}),
                    "read " + std::to_string(epoch_sequences), "only");
  EXPECT_USER_ERROR(loader.restore(json{{"epoch", 0}, {"next_sequence", 3}}),
                    "not a whole number of rounds of 2");
  json other_geometry = loader.state();
  other_geometry["seq_len"] = 5;
  EXPECT_USER_ERROR(loader.restore(other_geometry), "seq_len = 5", "seq_len = 4");
  json other_seed = loader.state();
  other_seed["seed"] = 6;
  EXPECT_USER_ERROR(loader.restore(other_seed), "seed 6");
  json unshuffled = loader.state();
  unshuffled["shuffle"] = false;
  EXPECT_USER_ERROR(loader.restore(unshuffled), "shuffle off");
  // Failed restores leave the position alone; the minimal state is accepted.
  EXPECT_EQ(loader.epoch(), 0);
  loader.restore(json{{"epoch", 4}, {"next_sequence", 2}});
  EXPECT_EQ(loader.epoch(), 4);
  EXPECT_EQ(loader.next_round(), 1);
}

TEST(DataLoader, DatasetTooSmallForOneStep) {
  // B=4, T=8, 2 ranks read 8 sequences a step: a shard of at least 8*8+1 = 65 tokens.
  EXPECT_USER_ERROR(DataLoader(counting_dataset(64), geometry(4, 8, 2, 0)), "64 tokens",
                    "at least 65 tokens", "B=4", "T=8");
  EXPECT_USER_ERROR(DataLoader(counting_dataset(32), geometry(4, 8)), "at least 33 tokens");
  DataLoader fits(counting_dataset(65), geometry(4, 8, 2, 1));
  EXPECT_EQ(fits.num_sequences(), 8);
  // Many tokens, but in shards each too small for a sequence.
  EXPECT_USER_ERROR(DataLoader(tagged_shards({8, 8, 8}), geometry(4, 8)), "24 tokens",
                    "3 shard(s)", "0 sequence(s)");
}

TEST(DataLoader, OpensShardGlobAndChecksVocab) {
  TempDir dir;
  std::vector<int32_t> all;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> tokens(50);
    Rng rng(s);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(100));
    all.insert(all.end(), tokens.begin(), tokens.end());
    write_token_file(dir.file("train_00000" + std::to_string(s) + ".bin"), tokens,
                     TokenFormat::kLlmcU16);
  }
  const TokenDataset dataset = TokenDataset::open(dir.file("train_*.bin"), 100);
  ASSERT_EQ(dataset.shards().size(), 3u);
  EXPECT_EQ(dataset.num_tokens(), 150u);
  DataLoader loader(dataset, geometry(1, 49));  // one sequence per shard
  for (int s = 0; s < 3; ++s) {
    const Batch batch = draw(loader);
    EXPECT_TRUE(std::equal(batch.inputs.begin(), batch.inputs.end(), all.begin() + 50 * s));
  }
  EXPECT_USER_ERROR(TokenDataset::open(dir.file("train_*.bin"), 50), "train_00000",
                    "vocabulary has 50 tokens");
  EXPECT_USER_ERROR(TokenDataset::open(dir.file("val_*.bin"), 100), "no file matches");
}

TEST(HeldOutSplit, TailOfOneSourceIsValidation) {
  const TokenDataset data = counting_dataset(1000);
  const TrainValViews views = held_out_split(data, 0.1, 0);
  EXPECT_EQ(views.train.num_tokens(), 900u);
  EXPECT_EQ(views.val.num_tokens(), 100u);
  ASSERT_EQ(views.val.shards().size(), 1u);
  EXPECT_EQ(views.val.shards()[0].source->token(views.val.shards()[0].begin), 900);
  // The views feed loaders that read only their own tokens.
  DataLoader train(views.train, geometry(1, 899));
  DataLoader val(views.val, geometry(1, 99));
  EXPECT_EQ(draw(train).targets.back(), 899);
  EXPECT_EQ(draw(val).inputs.front(), 900);
  // The minimum wins over the fraction.
  EXPECT_EQ(held_out_split(data, 0.1, 257).val.num_tokens(), 257u);
}

TEST(HeldOutSplit, TailSpanningShards) {
  const TrainValViews views = held_out_split(tagged_shards({100, 50, 30}), 0.25, 0);  // 45
  EXPECT_EQ(views.val.num_tokens(), 45u);
  ASSERT_EQ(views.val.shards().size(), 2u);
  EXPECT_EQ(views.val.shards()[0].source->token(views.val.shards()[0].begin), 1000 + 35);
  EXPECT_EQ(views.val.shards()[0].count, 15u);
  EXPECT_EQ(views.val.shards()[1].count, 30u);
  ASSERT_EQ(views.train.shards().size(), 2u);
  EXPECT_EQ(views.train.shards()[1].count, 35u);
  EXPECT_EQ(views.train.num_tokens(), 135u);
}

TEST(HeldOutSplit, TooSmallToSplit) {
  EXPECT_USER_ERROR(held_out_split(counting_dataset(100), 0.1, 100), "100 tokens",
                    "too few to hold out 100");
}

}  // namespace
}  // namespace dstrain
