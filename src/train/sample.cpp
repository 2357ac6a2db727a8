#include "train/sample.h"

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "model/architecture.h"
#include "model/stage.h"

namespace dstrain {

Tensor HostParams::acquire_grads(int block) {
  DSTRAIN_CHECK(false) << "HostParams has no gradients (block " << block << ")";
  return Tensor();
}

std::vector<int32_t> sample_tokens(const ModelConfig& config, Backend& backend,
                                   Allocator& allocator, ParamProvider& params,
                                   std::vector<int32_t> prompt, int64_t count, int64_t T,
                                   uint64_t seed) {
  const std::unique_ptr<Architecture> arch = make_architecture(config);
  ModelStage model(*arch, whole_model(config), backend, allocator, 1, T, DType::F32, false,
                   Recompute::None, 1);
  Rng rng(seed, 0x73616d706c65ull);  // "sample"
  std::vector<int32_t> tokens = std::move(prompt);
  const int64_t V = config.vocab_size, Vp = config.padded_vocab();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(tokens.size()), T);
    std::vector<int32_t> context(tokens.end() - t, tokens.end());
    Tensor input(context.data(), DType::I32, {1, t});
    model.forward(params, 0, 1, t, input, Tensor(), 0.0f, nullptr);
    const float* logits = model.logits().f32() + (t - 1) * Vp;
    const float max_logit = *std::max_element(logits, logits + V);
    std::vector<double> probs(static_cast<size_t>(V));
    double total = 0.0;
    for (int64_t v = 0; v < V; ++v) total += probs[v] = std::exp(double(logits[v]) - max_logit);
    double u = rng.uniform() * total;
    int32_t chosen = static_cast<int32_t>(V - 1);
    for (int64_t v = 0; v < V; ++v) {
      if ((u -= probs[v]) < 0) {
        chosen = static_cast<int32_t>(v);
        break;
      }
    }
    tokens.push_back(chosen);
  }
  return tokens;
}

}  // namespace dstrain
