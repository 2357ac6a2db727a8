// The synthetic corpus: the default training data when no --data is given. Its entropy rate
// is known exactly, so a run can show how close the model's loss gets to the best possible.
//
// Design: a second-order Markov chain over K tokens. For every context (a, b) of the two
// previous tokens, the next token c is drawn from
//   P(c | a, b) = kFloorMass / K  +  (1 - kFloorMass) * w_abc
// where w_ab. puts all its weight on 3 distinct successors chosen at random for that context,
// with random weights (core/rng.h, seeded), among a pool of 6 tokens that depends on b only.
// So the previous token narrows the next to its pool (a model learns that fast: the loss
// leaves ln K early), and the token two back picks which 3 of the 6: the conditional entropy
// given only the previous token stays well above the entropy rate, and a model needs
// attention to reach the rate.
//
// The floor makes every transition (a, b) -> (b, c) possible, so any pair state reaches any
// other in exactly 2 steps: the pair chain is irreducible and aperiodic, its stationary
// distribution pi is unique and positive, and a generated stream's statistics converge to it.
//
// Entropy rate (nats per token), exact up to rounding:
//   H = sum_{a,b} pi(a, b) * H(P(. | a, b)),  pi found by power iteration to 1e-15.
// With the default seed and K = 16 it is about 1.0 nats (see entropy_rate()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dstrain {

class SyntheticCorpus {
 public:
  static constexpr uint64_t kDefaultSeed = 1337;
  static constexpr int kDefaultVocab = 16;
  static constexpr int kSuccessors = 3;          // sparse successors per context
  static constexpr int kPoolSize = 6;            // the previous token's candidates
  static constexpr double kFloorMass = 0.02;     // spread uniformly over all K tokens

  // Builds the chain for `seed` and computes its stationary distribution and entropies.
  // Throws UserError when vocab is outside [4, 256] (the chain has K^3 probabilities).
  explicit SyntheticCorpus(uint64_t seed = kDefaultSeed, int vocab = kDefaultVocab);

  int vocab_size() const { return vocab_; }
  uint64_t seed() const { return seed_; }

  // n_tokens tokens of the chain, the first two drawn from the stationary distribution, the
  // rest from P(. | previous two). The same (corpus seed, stream_seed) gives the same stream
  // on every platform; use different stream seeds for the training and validation streams.
  std::vector<int32_t> generate(size_t n_tokens, uint64_t stream_seed) const;

  // H(X_t | X_{t-2}, X_{t-1}) under the stationary distribution: the best achievable
  // cross-entropy, in nats per token.
  double entropy_rate() const { return entropy_rate_; }
  // H(X_t | X_{t-1}) under the stationary distribution: what a model that ignores the token
  // two back can reach at best.
  double entropy_given_previous_only() const { return entropy_given_previous_; }
  // H(X_t): the entropy of the stationary token distribution.
  double unigram_entropy() const { return unigram_entropy_; }

  // P(c | a, b). REQUIRES: a, b, c in [0, vocab).
  double probability(int a, int b, int c) const;
  // Stationary probability of the pair state (X_{t-1}, X_t) = (a, b). REQUIRES: a, b in range.
  double stationary(int a, int b) const;

 private:
  size_t pair(int a, int b) const { return static_cast<size_t>(a) * vocab_ + b; }

  uint64_t seed_;
  int vocab_;
  std::vector<double> next_;        // (K*K, K): P(c | a, b) at [pair(a, b) * K + c]
  std::vector<double> next_cdf_;    // (K*K, K): running sums of next_, last entry 1
  std::vector<double> pi_;          // (K*K,): stationary distribution over pair states
  std::vector<double> pi_cdf_;      // (K*K,)
  double entropy_rate_ = 0.0;
  double entropy_given_previous_ = 0.0;
  double unigram_entropy_ = 0.0;
};

}  // namespace dstrain
