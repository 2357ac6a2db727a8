#include "data/loader.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "core/check.h"
#include "core/rng.h"
#include "kernels/ops.h"

namespace dstrain {

// ---------------------------------------------------------------------------------------------
// TokenDataset

TokenDataset TokenDataset::open(const std::string& spec, int64_t vocab_size) {
  TokenDataset dataset;
  for (const std::string& path : expand_data_paths(spec)) {
    std::shared_ptr<const TokenSource> source = TokenSource::open_file(path, vocab_size);
    const size_t count = source->size();
    dataset.add(TokenRange{std::move(source), 0, count});
  }
  dataset.description_ = "data '" + spec + "'";
  return dataset;
}

TokenDataset TokenDataset::from_tokens(std::vector<int32_t> tokens, int64_t vocab_size,
                                       std::string name, std::vector<uint8_t> mask) {
  TokenDataset dataset;
  std::shared_ptr<const TokenSource> source =
      TokenSource::from_tokens(std::move(tokens), vocab_size, name, std::move(mask));
  const size_t count = source->size();
  dataset.add(TokenRange{std::move(source), 0, count});
  dataset.description_ = "'" + name + "'";
  return dataset;
}

void TokenDataset::add(TokenRange range) {
  DSTRAIN_CHECK(range.source != nullptr) << "shard without a source";
  DSTRAIN_CHECK(range.begin <= range.source->size() &&
                range.count <= range.source->size() - range.begin)
      << "range [" << range.begin << ", " << range.begin + range.count << ") of "
      << range.source->size() << " tokens of '" << range.source->name() << "'";
  if (!shards_.empty()) {
    const bool has_mask = range.source->mask().size() > 0;
    DSTRAIN_USER_CHECK(has_mask == masked())
        << "'" << range.source->name() << "' " << (has_mask ? "has" : "has no")
        << " loss mask beside it (" << mask_path_for(range.source->name()) << ") but '"
        << shards_[0].source->name() << "' " << (has_mask ? "has none" : "has one")
        << "; chat data (prepare --chat) and text cannot be mixed in one --data.";
  }
  shards_.push_back(std::move(range));
  conversation_cache_ = std::make_shared<ConversationCache>();
}

std::shared_ptr<const ConversationIndex> TokenDataset::conversations(int64_t seq_len) const {
  std::lock_guard<std::mutex> lock(conversation_cache_->mutex);
  std::shared_ptr<const ConversationIndex>& index = conversation_cache_->by_seq_len[seq_len];
  if (!index) index = std::make_shared<const ConversationIndex>(index_conversations(*this, seq_len));
  return index;
}

size_t TokenDataset::num_tokens() const {
  size_t total = 0;
  for (const TokenRange& shard : shards_) total += shard.count;
  return total;
}

namespace {

// Where to cut `shard` at `position` (tokens of its range): there for text; of chat data, at the
// start of the conversation holding it (0 when it lies in the range's first conversation).
size_t conversation_cut(const TokenRange& shard, size_t position) {
  const std::span<const uint8_t> mask = shard.source->mask();
  if (mask.empty()) return position;
  while (position > 0 && (mask[shard.begin + position] & kMaskConversationStart) == 0) --position;
  return position;
}

}  // namespace

TrainValViews held_out_split(const TokenDataset& data, double val_fraction,
                             size_t min_val_tokens) {
  DSTRAIN_CHECK(val_fraction > 0.0 && val_fraction < 1.0) << "val_fraction " << val_fraction;
  const size_t total = data.num_tokens();
  const size_t val_tokens = std::max(
      static_cast<size_t>(std::ceil(val_fraction * static_cast<double>(total))), min_val_tokens);
  DSTRAIN_USER_CHECK(val_tokens < total)
      << data.description() << " has " << total << " tokens, too few to hold out " << val_tokens
      << " for validation and still train on the rest; give separate validation data or more "
      << "training data.";
  // Walk the shards from the back, giving the last val_tokens tokens to val.
  TrainValViews views;
  const std::vector<TokenRange>& shards = data.shards();
  std::vector<TokenRange> val_reversed;
  size_t still_needed = val_tokens;
  size_t keep = shards.size();  // shards [0, keep) go to train, the last possibly cut
  TokenRange cut_train;
  bool has_cut = false;
  while (still_needed > 0) {
    --keep;
    const TokenRange& shard = shards[keep];
    if (shard.count <= still_needed) {
      val_reversed.push_back(shard);
      still_needed -= shard.count;
    } else {
      const size_t train_part = conversation_cut(shard, shard.count - still_needed);
      val_reversed.push_back(
          TokenRange{shard.source, shard.begin + train_part, shard.count - train_part});
      cut_train = TokenRange{shard.source, shard.begin, train_part};
      has_cut = train_part > 0;
      still_needed = 0;
    }
  }
  for (size_t i = 0; i < keep; ++i) views.train.add(shards[i]);
  if (has_cut) views.train.add(cut_train);
  DSTRAIN_USER_CHECK(!views.train.shards().empty())
      << data.description() << " is one conversation at the place the held-out split of "
      << val_tokens << " tokens would cut it, too little to split; give separate validation "
      << "data (--val-data) or --val-fraction 0.";
  for (auto it = val_reversed.rbegin(); it != val_reversed.rend(); ++it) views.val.add(*it);
  views.train.set_description(data.description() + " (training part)");
  views.val.set_description(data.description() + " (held-out validation tail)");
  return views;
}

// ---------------------------------------------------------------------------------------------
// DataLoader

namespace {

// The sequences of T+1 tokens, starting every T, that one shard holds.
int64_t sequences_in(const TokenRange& shard, int64_t seq_len) {
  return shard.count >= 1 ? static_cast<int64_t>((shard.count - 1) / static_cast<size_t>(seq_len))
                          : 0;
}

}  // namespace

int64_t count_sequences(const TokenDataset& dataset, int64_t seq_len, bool packing) {
  DSTRAIN_CHECK(seq_len >= 1) << "seq_len " << seq_len;
  if (dataset.masked()) {
    const std::shared_ptr<const ConversationIndex> index = dataset.conversations(seq_len);
    if (packing) return pack_conversations(*index, seq_len).rows();
    return static_cast<int64_t>(index->conversations.size());
  }
  int64_t sequences = 0;
  for (const TokenRange& shard : dataset.shards()) sequences += sequences_in(shard, seq_len);
  return sequences;
}

int64_t count_sequences(const TokenDataset& dataset, const LoaderOptions& options) {
  if (options.batch_tokens == 0 || !dataset.masked() || options.packing) {
    return count_sequences(dataset, options.seq_len, options.packing);
  }
  return batch_conversations(*dataset.conversations(options.seq_len), options.seq_len,
                             options.batch_tokens, options.width_multiple)
      .batches();
}

DataLoader::DataLoader(TokenDataset dataset, const LoaderOptions& options)
    : dataset_(std::move(dataset)), options_(options) {
  const int64_t B = options.batch, T = options.seq_len, R = options.ranks;
  DSTRAIN_CHECK(B >= 1 && T >= 1) << "batch " << B << ", seq_len " << T;
  DSTRAIN_CHECK(R >= 1 && options.rank >= 0 && options.rank < R)
      << "rank " << options.rank << " of " << R;
  round_ = B * R;
  step_ = options.sequences_per_step > 0 ? options.sequences_per_step : round_;
  DSTRAIN_CHECK(step_ % round_ == 0) << step_ << " sequences per step, rounds of " << round_;
  first_sequence_.assign(1, 0);
  if (dataset_.masked()) {
    conversations_ = dataset_.conversations(T);
    num_sequences_ = static_cast<int64_t>(conversations_->conversations.size());
    if (options.packing) {
      pack_rows();
    } else if (options.batch_tokens > 0) {
      batch_rows();
    }
    DSTRAIN_USER_CHECK(num_sequences_ >= step_)
        << dataset_.description() << " holds " << describe_conversations(*conversations_, T)
        << (packed() ? ", packed into " + std::to_string(num_sequences_) + " row(s)" : "")
        << (token_batches() ? ", in " + std::to_string(num_sequences_) +
                                  " micro-batch(es) of --batch-tokens " +
                                  std::to_string(options.batch_tokens)
                            : "")
        << ", but one step reads " << step_ << " (B=" << B << ", " << R << " rank(s)"
        << (step_ > round_ ? ", " + std::to_string(step_ / round_) + " micro-batches each" : "")
        << "); give more conversations or a smaller batch or rank count.";
    return;
  }
  for (const TokenRange& shard : dataset_.shards()) {
    first_sequence_.push_back(first_sequence_.back() + sequences_in(shard, T));
  }
  num_sequences_ = first_sequence_.back();
  DSTRAIN_USER_CHECK(num_sequences_ >= step_)
      << dataset_.description() << " holds " << dataset_.num_tokens() << " tokens in "
      << dataset_.shards().size() << " shard(s), which make " << num_sequences_
      << " sequence(s) of T+1 = " << T + 1 << " tokens, but one step reads " << step_
      << " (B=" << B << ", T=" << T << ", " << R << " rank(s)"
      << (step_ > round_ ? ", " + std::to_string(step_ / round_) + " micro-batches each" : "")
      << "): a shard of at least " << step_ * T + 1
      << " tokens; give more data or a smaller batch, sequence length or rank count.";
}

void DataLoader::build_order(int64_t epoch) {
  if (order_epoch_ == epoch) return;
  order_.resize(static_cast<size_t>(num_sequences_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  Rng rng(options_.seed, static_cast<uint64_t>(epoch));  // one stream per epoch
  for (size_t i = order_.size() - 1; i > 0; --i) {  // Fisher-Yates
    const size_t j = static_cast<size_t>(rng.below(i + 1));
    std::swap(order_[i], order_[j]);
  }
  order_epoch_ = epoch;
}

int64_t DataLoader::sequence_index(int64_t epoch, int64_t position) {
  DSTRAIN_CHECK(epoch >= 0 && position >= 0 && position < steps_per_epoch() * step_)
      << "epoch " << epoch << ", sequence " << position << " of " << steps_per_epoch() * step_;
  if (!options_.shuffle) return position;
  build_order(epoch);
  return order_[static_cast<size_t>(position)];
}

std::pair<size_t, size_t> DataLoader::sequence_location(int64_t s) const {
  DSTRAIN_CHECK(s >= 0 && s < num_sequences_) << "sequence " << s << " of " << num_sequences_;
  if (conversations_) {  // the conversation, or a packed row's or micro-batch's first
    const size_t c = !row_first_.empty() ? static_cast<size_t>(row_first_[static_cast<size_t>(s)])
                              : static_cast<size_t>(s);
    return {conversations_->conversations[c].shard, conversations_->conversations[c].offset};
  }
  // The last shard whose first sequence is <= s (empty shards share a first one; skip them).
  const auto it = std::upper_bound(first_sequence_.begin(), first_sequence_.end(), s);
  const size_t shard = static_cast<size_t>(it - first_sequence_.begin()) - 1;
  return {shard, static_cast<size_t>(s - first_sequence_[shard]) *
                     static_cast<size_t>(options_.seq_len)};
}

BatchShape DataLoader::next_batch(int32_t* inputs, int32_t* targets, int32_t* positions) {
  DSTRAIN_CHECK(inputs != nullptr && targets != nullptr) << "null batch buffer";
  const int64_t B = options_.batch, T = options_.seq_len;
  const int64_t first = (next_round_ * options_.ranks + options_.rank) * B;
  BatchShape shape{B, T};
  if (token_batches()) {
    shape = read_token_batch(sequence_index(epoch_, first), inputs, targets, positions);
  }
  for (int64_t row = 0; row < B && !token_batches(); ++row) {
    const int64_t sequence = sequence_index(epoch_, first + row);
    int32_t* row_positions = positions != nullptr ? positions + row * T : nullptr;
    if (packed()) {
      read_packed_row(sequence, inputs + row * T, targets + row * T, row_positions);
      continue;
    }
    if (conversations_) {
      read_conversation_row(sequence, inputs + row * T, targets + row * T);
    } else {
      read_text_row(sequence, inputs + row * T, targets + row * T);
    }
    if (row_positions != nullptr) std::iota(row_positions, row_positions + T, 0);
  }
  if (++next_round_ == rounds_per_epoch()) {
    next_round_ = 0;
    ++epoch_;
  }
  return shape;
}

// Micro-batch `batch`'s conversations, one per row of its width, padded as read_conversation_row.
BatchShape DataLoader::read_token_batch(int64_t batch, int32_t* inputs, int32_t* targets,
                                        int32_t* positions) const {
  const size_t m = static_cast<size_t>(batch);
  const int64_t width = row_width_[m];
  const auto& all = conversations_->conversations;
  int64_t row = 0;
  for (int64_t c = row_first_[m]; c < row_first_[m + 1]; ++c, ++row) {
    int32_t* row_inputs = inputs + row * width;
    int32_t* row_targets = targets + row * width;
    const int64_t n = read_conversation(all[static_cast<size_t>(c)], row_inputs, row_targets);
    std::fill(row_inputs + n, row_inputs + width, 0);
    std::fill(row_targets + n, row_targets + width, kIgnoreTarget);
    if (positions != nullptr) std::iota(positions + row * width, positions + (row + 1) * width, 0);
  }
  return BatchShape{row, width};
}

void DataLoader::read_text_row(int64_t sequence, int32_t* inputs, int32_t* targets) const {
  const auto [shard_index, offset] = sequence_location(sequence);
  const TokenRange& shard = dataset_.shards()[shard_index];
  const size_t count = static_cast<size_t>(options_.seq_len);
  shard.source->read(shard.begin + offset, count, inputs);       // seq[0 : T]
  shard.source->read(shard.begin + offset + 1, count, targets);  // seq[1 : T+1]
}

// inputs = tokens [0, n-1), targets = tokens [1, n) where trained, else kIgnoreTarget; the rest
// of the row padded with token 0 (any id in the vocabulary: its targets are not counted, and
// causal attention keeps it from the tokens before it).
int64_t DataLoader::read_conversation(const Conversation& c, int32_t* inputs,
                                      int32_t* targets) const {
  const TokenRange& shard = dataset_.shards()[c.shard];
  const size_t n = c.length - 1;
  shard.source->read(shard.begin + c.offset, n, inputs);
  shard.source->read(shard.begin + c.offset + 1, n, targets);
  const uint8_t* flags = shard.source->mask().data() + shard.begin + c.offset + 1;
  for (size_t i = 0; i < n; ++i) {
    if ((flags[i] & kMaskTrained) == 0) targets[i] = kIgnoreTarget;
  }
  return static_cast<int64_t>(n);
}

void DataLoader::read_conversation_row(int64_t sequence, int32_t* inputs,
                                       int32_t* targets) const {
  const Conversation& c = conversations_->conversations[static_cast<size_t>(sequence)];
  const int64_t n = read_conversation(c, inputs, targets);
  std::fill(inputs + n, inputs + options_.seq_len, 0);
  std::fill(targets + n, targets + options_.seq_len, kIgnoreTarget);
}

// The row's conversations one after the other, then padding: input 0, target ignored, the
// positions of one more sequence (valid positions: each run counts from 0).
void DataLoader::read_packed_row(int64_t row, int32_t* inputs, int32_t* targets,
                                 int32_t* positions) const {
  int64_t t = 0;
  const auto& all = conversations_->conversations;
  for (int64_t c = row_first_[static_cast<size_t>(row)]; c < row_first_[static_cast<size_t>(row) + 1];
       ++c) {
    const int64_t n = read_conversation(all[static_cast<size_t>(c)], inputs + t, targets + t);
    if (positions != nullptr) std::iota(positions + t, positions + t + n, 0);
    t += n;
  }
  const int64_t T = options_.seq_len;
  std::fill(inputs + t, inputs + T, 0);
  std::fill(targets + t, targets + T, kIgnoreTarget);
  if (positions != nullptr) std::iota(positions + t, positions + T, 0);
}

void DataLoader::pack_rows() {
  PackedRows packed = pack_conversations(*conversations_, options_.seq_len);
  row_first_ = std::move(packed.row_first);
  row_trained_ = std::move(packed.trained);
  num_sequences_ = static_cast<int64_t>(row_trained_.size());
}

void DataLoader::batch_rows() {
  DSTRAIN_CHECK(options_.batch == 1) << "a token budget reads one micro-batch per round, not "
                                     << options_.batch;
  TokenBatches batches = batch_conversations(*conversations_, options_.seq_len,
                                             options_.batch_tokens, options_.width_multiple);
  row_first_ = std::move(batches.first);
  row_trained_ = std::move(batches.trained);
  row_width_ = std::move(batches.width);
  num_sequences_ = static_cast<int64_t>(row_trained_.size());
}

int64_t DataLoader::positions_ahead(int64_t sequences) {
  const int64_t first = next_round_ * round_;
  DSTRAIN_CHECK(sequences >= 0 && first + sequences <= steps_per_epoch() * step_)
      << sequences << " sequences from " << first << " of an epoch of " << steps_per_epoch() * step_;
  if (!token_batches()) return sequences * options_.seq_len;
  int64_t positions = 0;
  for (int64_t p = first; p < first + sequences; ++p) {
    const int64_t m = sequence_index(epoch_, p);
    positions += (row_first_[static_cast<size_t>(m) + 1] - row_first_[static_cast<size_t>(m)]) *
                 row_width_[static_cast<size_t>(m)];
  }
  return positions;
}

int64_t DataLoader::trained_targets_ahead(int64_t sequences) {
  const int64_t first = next_round_ * round_;
  DSTRAIN_CHECK(sequences >= 0 && first + sequences <= steps_per_epoch() * step_)
      << sequences << " sequences from " << first << " of an epoch of " << steps_per_epoch() * step_;
  if (!conversations_) return sequences * options_.seq_len;
  int64_t trained = 0;
  for (int64_t p = first; p < first + sequences; ++p) {
    const size_t s = static_cast<size_t>(sequence_index(epoch_, p));
    trained += !row_first_.empty() ? row_trained_[s] : conversations_->conversations[s].trained;
  }
  return trained;
}

BatchShape DataLoader::next_batch(const Tensor& inputs, const Tensor& targets,
                                  const Tensor& positions) {
  DSTRAIN_CHECK(!token_batches()) << "a token budget's micro-batches have shapes of their own";
  for (const Tensor* t : {&inputs, &targets, &positions}) {
    if (t == &positions && positions.empty()) continue;
    DSTRAIN_CHECK(t->device.is_cpu() && t->ndim == 2 && t->shape[0] == options_.batch &&
                  t->shape[1] == options_.seq_len)
        << "batch tensor " << t->shape_str() << " on " << t->device.str() << ", expected ("
        << options_.batch << ", " << options_.seq_len << ") I32 on cpu";
  }
  return next_batch(inputs.i32(), targets.i32(), positions.empty() ? nullptr : positions.i32());
}

void DataLoader::reset() {
  epoch_ = 0;
  next_round_ = 0;
}

nlohmann::json DataLoader::state() const {
  return nlohmann::json{{"epoch", epoch_},
                        {"next_sequence", next_round_ * round_},
                        {"sequences", num_sequences_},
                        {"sequences_per_step", step_},
                        {"seq_len", options_.seq_len},
                        {"shuffle", options_.shuffle},
                        {"seed", options_.seed},
                        {"packing", packed()},
                        {"batch_tokens", options_.batch_tokens}};
}

namespace {

// A required non-negative integer field of a loader state.
int64_t state_count(const nlohmann::json& state, const char* key) {
  DSTRAIN_USER_CHECK(state.contains(key))
      << "the data loader state to resume from has no '" << key
      << "' field; it is not a state saved by dstrain's DataLoader.";
  const nlohmann::json& value = state.at(key);
  const bool in_range =
      value.is_number_unsigned()
          ? value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
          : value.is_number_integer() && value.get<int64_t>() >= 0;
  DSTRAIN_USER_CHECK(in_range)
      << "the data loader state to resume from has '" << key << "' = " << value.dump()
      << ", which is not a non-negative integer; the state is corrupt.";
  return value.get<int64_t>();
}

// The sequences of the epoch a state has read: next_sequence, or an earlier version's
// next_round of `ranks` x `batch` sequences each.
int64_t sequences_read(const nlohmann::json& state) {
  if (state.contains("next_sequence") || !state.contains("next_round")) {
    return state_count(state, "next_sequence");
  }
  const int64_t round = state_count(state, "next_round");
  const int64_t ranks = state.contains("ranks") ? state_count(state, "ranks") : 1;
  const int64_t batch = state.contains("batch") ? state_count(state, "batch") : 1;
  return round * ranks * batch;
}

}  // namespace

void DataLoader::restore(const nlohmann::json& state) {
  DSTRAIN_USER_CHECK(state.is_object())
      << "the data loader state to resume from is " << state.type_name()
      << ", not an object with 'epoch' and 'next_sequence'; the state is corrupt.";
  const int64_t epoch = state_count(state, "epoch");
  const int64_t read = sequences_read(state);
  // Packing changes what a sequence is: checked before the counts it changes.
  if (state.contains("packing")) {
    DSTRAIN_USER_CHECK(state["packing"].is_boolean() && state["packing"].get<bool>() == packed())
        << "the data loader state to resume from was saved with packing "
        << state["packing"].dump() << " but this run has it " << (packed() ? "on" : "off")
        << "; resume with the same --packing.";
  }
  // Geometry the state was taken with: a resume with other data, sequence length, global
  // batch or token budget would read other sequences, so refuse it instead of continuing
  // silently.
  const std::pair<const char*, int64_t> expected[] = {{"sequences", num_sequences_},
                                                      {"sequences_per_step", step_},
                                                      {"seq_len", options_.seq_len},
                                                      {"batch_tokens", options_.batch_tokens}};
  for (const auto& [key, value] : expected) {
    if (!state.contains(key)) continue;
    const int64_t saved = state_count(state, key);
    DSTRAIN_USER_CHECK(saved == value)
        << "the data loader state to resume from was saved with " << key << " = " << saved
        << " but this run has " << key << " = " << value
        << "; resume with the same data, sequence length, sequences per step and --batch-tokens.";
  }
  DSTRAIN_USER_CHECK(read < steps_per_epoch() * step_)
      << "the data loader state to resume from has read " << read << " sequences of the epoch, "
      << "but an epoch of " << dataset_.description() << " has only "
      << steps_per_epoch() * step_ << "; resume with the same data and batch geometry.";
  DSTRAIN_USER_CHECK(read % round_ == 0)
      << "the data loader state to resume from has read " << read << " sequences of the epoch, "
      << "which is not a whole number of rounds of " << round_ << " (" << options_.ranks
      << " rank(s) x " << options_.batch << "); resume with ranks and a micro-batch that "
      << "divide it.";
  if (state.contains("shuffle")) {
    DSTRAIN_USER_CHECK(state["shuffle"].is_boolean())
        << "the data loader state to resume from has 'shuffle' = " << state["shuffle"].dump()
        << ", not true or false; the state is corrupt.";
    DSTRAIN_USER_CHECK(state["shuffle"].get<bool>() == options_.shuffle)
        << "the data loader state to resume from was saved with shuffle "
        << (options_.shuffle ? "off" : "on") << " but this run has it "
        << (options_.shuffle ? "on" : "off") << "; resume with the same shuffle setting.";
  }
  if (options_.shuffle && state.contains("seed")) {
    const nlohmann::json& seed = state["seed"];
    DSTRAIN_USER_CHECK(seed.is_number_unsigned() ||
                       (seed.is_number_integer() && seed.get<int64_t>() >= 0))
        << "the data loader state to resume from has 'seed' = " << seed.dump()
        << ", not a non-negative integer; the state is corrupt.";
    DSTRAIN_USER_CHECK(seed.get<uint64_t>() == options_.seed)
        << "the data loader state to resume from was saved with shuffle seed "
        << seed.get<uint64_t>() << " but this run uses " << options_.seed
        << "; resume with the same seed.";
  }
  epoch_ = epoch;
  next_round_ = read / round_;
}

}  // namespace dstrain
