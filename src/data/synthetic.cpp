#include "data/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"
#include "core/rng.h"

namespace dstrain {

namespace {

double entropy_of(const double* p, size_t n) {
  double h = 0.0;
  for (size_t i = 0; i < n; ++i)
    if (p[i] > 0.0) h -= p[i] * std::log(p[i]);
  return h;
}

// Running sums with the last entry pinned to 1, so a uniform draw in [0, 1) always lands.
void cumulative(const double* p, size_t n, double* cdf) {
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) cdf[i] = (sum += p[i]);
  cdf[n - 1] = 1.0;
}

// The first index whose running sum exceeds u.
size_t draw(const double* cdf, size_t n, double u) {
  return static_cast<size_t>(std::upper_bound(cdf, cdf + n - 1, u) - cdf);
}

}  // namespace

SyntheticCorpus::SyntheticCorpus(uint64_t seed, int vocab) : seed_(seed), vocab_(vocab) {
  DSTRAIN_USER_CHECK(vocab >= 4 && vocab <= 256)
      << "the synthetic corpus vocabulary must have between 4 and 256 tokens, not " << vocab
      << ".";
  const size_t K = static_cast<size_t>(vocab);
  const size_t pairs = K * K;

  // The chain: for each context, a floor over all tokens plus 3 weighted successors, chosen
  // among a pool of kPoolSize tokens that depends on the previous token only. So the previous
  // token alone narrows the next one to its pool (a model learns that first, in a few dozen
  // steps), and the token two back picks the successors inside the pool (that takes
  // attention, and gets the loss down to the entropy rate).
  Rng pool_rng(seed, hash_name("synthetic.pool"));
  std::vector<std::vector<int>> pools(K);
  std::vector<int> tokens(K);
  for (size_t b = 0; b < K; ++b) {
    std::iota(tokens.begin(), tokens.end(), 0);
    const size_t pool_size = std::min<size_t>(kPoolSize, K);
    for (size_t s = 0; s < pool_size; ++s) {
      const size_t j = s + static_cast<size_t>(pool_rng.below(K - s));
      std::swap(tokens[s], tokens[j]);
    }
    pools[b].assign(tokens.begin(), tokens.begin() + static_cast<long>(pool_size));
  }
  Rng rng(seed, hash_name("synthetic.chain"));
  next_.assign(pairs * K, kFloorMass / static_cast<double>(K));
  for (size_t context = 0; context < pairs; ++context) {
    std::vector<int> pool = pools[context % K];  // context = a * K + b
    double weights[kSuccessors];
    double weight_sum = 0.0;
    for (int s = 0; s < kSuccessors; ++s) {
      // Partial Fisher-Yates: pool[s] becomes a successor not chosen before.
      const size_t j = s + static_cast<size_t>(rng.below(pool.size() - s));
      std::swap(pool[s], pool[j]);
      // Weights in [0.1, 1.1): no successor is negligible, and contexts differ in sharpness.
      weights[s] = 0.1 + rng.uniform();
      weight_sum += weights[s];
    }
    for (int s = 0; s < kSuccessors; ++s)
      next_[context * K + pool[s]] += (1.0 - kFloorMass) * weights[s] / weight_sum;
  }

  // Stationary distribution over pair states: pi'(b, c) = sum_a pi(a, b) P(c | a, b).
  pi_.assign(pairs, 1.0 / static_cast<double>(pairs));
  std::vector<double> stepped(pairs);
  bool converged = false;
  for (int iteration = 0; iteration < 100000 && !converged; ++iteration) {
    std::fill(stepped.begin(), stepped.end(), 0.0);
    for (size_t a = 0; a < K; ++a)
      for (size_t b = 0; b < K; ++b) {
        const double mass = pi_[a * K + b];
        const double* p = &next_[(a * K + b) * K];
        for (size_t c = 0; c < K; ++c) stepped[b * K + c] += mass * p[c];
      }
    const double total = std::accumulate(stepped.begin(), stepped.end(), 0.0);
    double change = 0.0;
    for (size_t i = 0; i < pairs; ++i) {
      stepped[i] /= total;  // keep the rounding drift of the sum out of the iteration
      change = std::max(change, std::abs(stepped[i] - pi_[i]));
    }
    pi_.swap(stepped);
    converged = change <= 1e-15;
  }
  DSTRAIN_CHECK(converged) << "stationary distribution of the synthetic chain did not converge";

  // Entropies under pi.
  entropy_rate_ = 0.0;
  for (size_t context = 0; context < pairs; ++context)
    entropy_rate_ += pi_[context] * entropy_of(&next_[context * K], K);
  std::vector<double> previous(K, 0.0);   // P(X_{t-1} = b)
  std::vector<double> joint(K * K, 0.0);  // P(X_{t-1} = b, X_t = c)
  for (size_t a = 0; a < K; ++a)
    for (size_t b = 0; b < K; ++b) {
      previous[b] += pi_[a * K + b];
      for (size_t c = 0; c < K; ++c) joint[b * K + c] += pi_[a * K + b] * next_[(a * K + b) * K + c];
    }
  entropy_given_previous_ = entropy_of(joint.data(), K * K) - entropy_of(previous.data(), K);
  unigram_entropy_ = entropy_of(previous.data(), K);

  next_cdf_.resize(pairs * K);
  for (size_t context = 0; context < pairs; ++context)
    cumulative(&next_[context * K], K, &next_cdf_[context * K]);
  pi_cdf_.resize(pairs);
  cumulative(pi_.data(), pairs, pi_cdf_.data());
}

std::vector<int32_t> SyntheticCorpus::generate(size_t n_tokens, uint64_t stream_seed) const {
  const size_t K = static_cast<size_t>(vocab_);
  Rng rng(seed_ ^ hash_name("synthetic.stream"), stream_seed);
  std::vector<int32_t> stream(n_tokens);
  if (n_tokens == 0) return stream;
  const size_t first_pair = draw(pi_cdf_.data(), K * K, rng.uniform());
  stream[0] = static_cast<int32_t>(first_pair / K);
  if (n_tokens > 1) stream[1] = static_cast<int32_t>(first_pair % K);
  for (size_t t = 2; t < n_tokens; ++t) {
    const size_t context = pair(stream[t - 2], stream[t - 1]);
    stream[t] = static_cast<int32_t>(draw(&next_cdf_[context * K], K, rng.uniform()));
  }
  return stream;
}

double SyntheticCorpus::probability(int a, int b, int c) const {
  DSTRAIN_CHECK(a >= 0 && a < vocab_ && b >= 0 && b < vocab_ && c >= 0 && c < vocab_)
      << "tokens (" << a << ", " << b << ", " << c << ") of " << vocab_;
  return next_[pair(a, b) * vocab_ + c];
}

double SyntheticCorpus::stationary(int a, int b) const {
  DSTRAIN_CHECK(a >= 0 && a < vocab_ && b >= 0 && b < vocab_)
      << "tokens (" << a << ", " << b << ") of " << vocab_;
  return pi_[pair(a, b)];
}

}  // namespace dstrain
