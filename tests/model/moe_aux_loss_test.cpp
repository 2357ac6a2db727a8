// The auxiliary losses of model/moe_aux_loss.h on the CPU backend: for random routings (softmax
// probabilities and their top-k choices), each kind's value against a float64 evaluation of the
// formula written here, and its gradient w.r.t. the probabilities against central finite
// differences of that evaluation (the choices held fixed, as the models' code treats them).
#include "model/moe_aux_loss.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/ops.h"

namespace dstrain {
namespace {

constexpr int64_t kExperts = 5, kTopK = 2;

// One layer's routing: N tokens' probabilities (N, E) and their top-k choices (N, k).
struct Routing {
  std::vector<float> scores;
  std::vector<int32_t> chosen;
};

Routing random_routing(int64_t tokens, uint64_t seed) {
  Rng rng(seed);
  Routing r;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> logits(kExperts);
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(2 * rng.normal()));
    std::vector<int> order(kExperts);
    for (int e = 0; e < kExperts; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return logits[a] > logits[b]; });
    for (double l : logits) r.scores.push_back(static_cast<float>(l / sum));
    for (int j = 0; j < kTopK; ++j) r.chosen.push_back(order[static_cast<size_t>(j)]);
  }
  return r;
}

MoeActivations activations(Routing& r) {
  MoeActivations a;
  const int64_t N = static_cast<int64_t>(r.scores.size()) / kExperts;
  a.scores = Tensor(r.scores.data(), DType::F32, {N, kExperts});
  a.topk_expert = Tensor(r.chosen.data(), DType::I32, {N, kTopK});
  return a;
}

// transformers' load_balancing_loss_func over every layer's rows together, in float64.
double transformers_aux(const std::vector<Routing>& layers, const std::vector<double>* probs) {
  std::vector<double> f(kExperts, 0), p(kExperts, 0);
  double rows = 0;
  size_t at = 0;
  for (const Routing& r : layers) {
    for (int32_t e : r.chosen) f[static_cast<size_t>(e)] += 1;
    for (size_t i = 0; i < r.scores.size(); ++i, ++at) {
      p[i % kExperts] += probs != nullptr ? (*probs)[at] : r.scores[i];
    }
    rows += static_cast<double>(r.scores.size() / kExperts);
  }
  double aux = 0;
  for (int64_t e = 0; e < kExperts; ++e) aux += (f[e] / rows) * (p[e] / rows);
  return kExperts * aux;
}

// DeepSeek's MoEGate loss (without alpha) of one layer, per sequence of T tokens or (T = N) all.
double deepseek_aux(const Routing& r, int64_t T, const std::vector<double>& probs) {
  const int64_t N = static_cast<int64_t>(probs.size()) / kExperts, groups = N / T;
  double aux = 0;
  for (int64_t s = 0; s < groups; ++s) {
    for (int64_t e = 0; e < kExperts; ++e) {
      double count = 0, p = 0;
      for (int64_t i = s * T * kTopK; i < (s + 1) * T * kTopK; ++i) count += r.chosen[i] == e;
      for (int64_t t = s * T; t < (s + 1) * T; ++t) p += probs[t * kExperts + e];
      aux += count * kExperts / static_cast<double>(T * kTopK) * (p / T);
    }
  }
  return aux / static_cast<double>(groups);
}

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST(MoeAuxLoss, TransformersValueAndGradientOverEveryLayer) {
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  std::vector<Routing> layers = {random_routing(12, 1), random_routing(12, 2),
                                 random_routing(12, 3)};
  const double coef = 0.3, scale = 8.0;
  MoeAuxLoss aux(AuxLossKind::Transformers, kExperts, kTopK, coef, nullptr);
  aux.begin_step(scale, 2, 1);  // weight scale / accumulation
  for (size_t l = 0; l < layers.size(); ++l) {
    aux.add_layer(*backend, activations(layers[l]), nullptr);
  }
  std::vector<double> all;
  for (const Routing& r : layers) all.insert(all.end(), r.scores.begin(), r.scores.end());
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<float> dscores(layers[l].scores.size());
    aux.layer_gradient(*backend, activations(layers[l]), 4,
                       Tensor(dscores.data(), DType::F32, {12, kExperts}), nullptr);
    const size_t offset = l * layers[l].scores.size();
    for (size_t i = 0; i < dscores.size(); i += 7) {
      std::vector<double> up = all, down = all;
      const double h = 1e-6;
      up[offset + i] += h;
      down[offset + i] -= h;
      const double fd = (transformers_aux(layers, &up) - transformers_aux(layers, &down)) / (2 * h);
      EXPECT_NEAR(dscores[i], coef * scale / 2 * fd, 1e-5) << "layer " << l << " [" << i << "]";
    }
  }
  EXPECT_NEAR(aux.take_step_sum(), transformers_aux(layers, nullptr), 1e-12);
  EXPECT_EQ(aux.take_step_sum(), 0.0);
}

TEST(MoeAuxLoss, DeepSeekValueAndGradientPerSequenceAndOverTokens) {
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  for (AuxLossKind kind : {AuxLossKind::DeepSeekSequence, AuxLossKind::DeepSeekToken}) {
    const bool per_sequence = kind == AuxLossKind::DeepSeekSequence;
    SCOPED_TRACE(per_sequence ? "seq_aux" : "over tokens");
    Routing r = random_routing(12, per_sequence ? 4 : 5);
    const double alpha = 0.05, scale = 4.0;
    const int dp = 2;
    MoeAuxLoss aux(kind, kExperts, kTopK, alpha, nullptr);
    aux.begin_step(scale, 3, dp);  // weight scale / dp, whatever the accumulation
    std::vector<float> dscores(r.scores.size());
    const int64_t T = 4, groups_of = per_sequence ? T : 12;
    aux.layer_gradient(*backend, activations(r), T,
                       Tensor(dscores.data(), DType::F32, {12, kExperts}), nullptr);
    const std::vector<double> probs = as_double(r.scores);
    for (size_t i = 0; i < dscores.size(); ++i) {
      std::vector<double> up = probs, down = probs;
      const double h = 1e-6;
      up[i] += h;
      down[i] -= h;
      const double fd =
          (deepseek_aux(r, groups_of, up) - deepseek_aux(r, groups_of, down)) / (2 * h);
      EXPECT_NEAR(dscores[i], alpha * scale / dp * fd, 1e-5) << "[" << i << "]";
    }
    EXPECT_NEAR(aux.take_step_sum(), deepseek_aux(r, groups_of, probs), 1e-12);
  }
}

}  // namespace
}  // namespace dstrain
