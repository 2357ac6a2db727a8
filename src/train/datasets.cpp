#include "train/datasets.h"

#include <algorithm>
#include <sstream>

#include "data/synthetic.h"

namespace dstrain {

namespace {
// The synthetic corpus: its seed is fixed (the corpus is part of the benchmark, not of the
// run), so every run and every resume sees the same data whatever --seed is.
constexpr uint64_t kSyntheticCorpusSeed = 20240520;
constexpr int kSyntheticVocab = 16;

}  // namespace

Datasets open_datasets(const TrainOptions& options, const ModelConfig& config, int64_t B, int64_t T,
                       int world) {
  Datasets data;
  const size_t window = static_cast<size_t>(world * B * T + 1);
  if (options.data.empty() || options.data == "synthetic") {
    DSTRAIN_USER_CHECK(options.val_data.empty())
        << "--val-data needs --data (the synthetic corpus makes its own validation stream)";
    const SyntheticCorpus corpus(kSyntheticCorpusSeed, kSyntheticVocab);
    DSTRAIN_USER_CHECK(config.vocab_size >= corpus.vocab_size())
        << "the synthetic corpus has " << corpus.vocab_size() << " tokens but the model's "
        << "vocab_size is " << config.vocab_size;
    // A fixed length (not derived from --steps: a resumed run must see the same windows),
    // more than a CPU run consumes.
    const size_t train_tokens = size_t{1} << 24;
    const size_t val_tokens =
        std::max<size_t>(window * static_cast<size_t>(options.eval_batches), 1 << 16);
    data.train = TokenDataset::from_tokens(corpus.generate(train_tokens, 1), config.vocab_size,
                                           "synthetic train stream");
    data.val = TokenDataset::from_tokens(corpus.generate(val_tokens, 2), config.vocab_size,
                                         "synthetic validation stream");
    data.entropy_floor = corpus.entropy_rate();
    data.entropy_previous_only = corpus.entropy_given_previous_only();
    data.synthetic = true;
    std::ostringstream text;
    text << "synthetic corpus (no --data given): order-2 Markov source over " << corpus.vocab_size()
         << " tokens, entropy floor " << *data.entropy_floor << " nats";
    data.description = text.str();
    return data;
  }
  TokenDataset all = TokenDataset::open(options.data, config.vocab_size);
  if (!options.val_data.empty()) {
    data.train = std::move(all);
    data.val = TokenDataset::open(options.val_data, config.vocab_size);
    data.description = options.data + " (validation: " + options.val_data + ")";
  } else {
    TrainValViews views = held_out_split(all, 0.1, window);
    data.train = std::move(views.train);
    data.val = std::move(views.val);
    data.description = options.data + " (validation: the last 10% held out)";
  }
  if (data.train.masked()) {
    data.description += "\n  chat data: " + describe_conversations(*data.train.conversations(T), T);
  }
  return data;
}

}  // namespace dstrain
