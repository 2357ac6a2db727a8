// What the model tests share: fresh parameters made non-trivial, a random token batch, the
// whole model as one stage on the CPU backend, and each parameter's gradient against central
// finite differences of the loss.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/architecture.h"
#include "model/layout.h"
#include "model/stage.h"
#include "tests/model/host_params.h"

namespace dstrain::test {

// The model's initialization plus noise N(0, spread(name)) (0.2 unless `spread` says otherwise),
// so that no weight is 0 or 1 and every path matters.
inline void randomize_parameters(const ParamLayout& layout, const ModelConfig& config,
                                 HostParams& params,
                                 const std::function<double(const std::string&)>& spread = {}) {
  std::vector<Tensor> flats;
  for (int block = 0; block < layout.num_blocks(); ++block) {
    flats.push_back(params.acquire_params(block));
  }
  init_model_parameters(layout, config, 7, flats);
  Rng rng(99);
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, flats[spec.block]).f32();
    const double sigma = spread ? spread(spec.name) : 0.2;
    for (int64_t i = 0; i < spec.file_numel(); ++i) data[i] += float(sigma * rng.normal());
  }
}

// B x T random tokens and targets of `config`'s vocabulary, drawn in turn from Rng(seed).
struct TokenBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs, targets;
  Tensor input_tensor() { return Tensor(inputs.data(), DType::I32, {B, T}); }
  Tensor target_tensor() { return Tensor(targets.data(), DType::I32, {B, T}); }
};
inline TokenBatch random_tokens(const ModelConfig& config, int64_t B, int64_t T, uint64_t seed) {
  Rng rng(seed);
  TokenBatch batch{B, T, {}, {}};
  for (int64_t i = 0; i < B * T; ++i) {
    batch.inputs.push_back(int32_t(rng.below(config.vocab_size)));
    batch.targets.push_back(int32_t(rng.below(config.vocab_size)));
  }
  return batch;
}

// The whole model as one F32 stage of micro-batches (B, T) on a CPU backend of `threads` threads.
struct WholeModelRun {
  WholeModelRun(const Architecture& arch, int64_t B, int64_t T, int threads,
                Recompute recompute = Recompute::None)
      : backend(make_cpu_backend(threads)),
        allocator(make_cpu_allocator()),
        stage(arch, whole_model(arch.config()), *backend, *allocator, B, T, DType::F32, true,
              recompute, 1) {}
  // Forward with the per-token loss weight dloss, then backward: the gradients in `params`.
  void forward_backward(HostParams& params, TokenBatch& batch, float dloss) {
    stage.forward(params, 0, batch.B, batch.T, batch.input_tensor(), batch.target_tensor(), dloss,
                  nullptr);
    stage.backward(params, 0, batch.input_tensor(), nullptr);
  }
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Allocator> allocator;
  ModelStage stage;
};

// Every gradient of one forward and backward (dloss 0.1, 2 threads) of `arch` with
// randomize_parameters(spread) on the random (B, T) batch of `seed`, under `recompute`: what the
// recompute tests compare bit for bit.
inline std::vector<std::vector<float>> model_gradients(
    const Architecture& arch, const std::function<double(const std::string&)>& spread, int64_t B,
    int64_t T, uint64_t seed, Recompute recompute) {
  HostParams params(arch.layout());
  randomize_parameters(arch.layout(), arch.config(), params, spread);
  TokenBatch batch = random_tokens(arch.config(), B, T, seed);
  WholeModelRun run(arch, B, T, 2, recompute);
  run.forward_backward(params, batch, 0.1f);
  return params.grads;
}

// After run.forward_backward(dloss 1/N) on `batch`: 4 random elements of every parameter against
// central differences (h = 1e-3) of the mean loss. Returns each parameter's squared gradient
// norm, by layout index.
inline std::vector<double> expect_gradients_match_finite_differences(WholeModelRun& run,
                                                                     HostParams& params,
                                                                     const ParamLayout& layout,
                                                                     TokenBatch& batch) {
  Rng rng(5);
  const double h = 1e-3;
  const auto loss = [&] {
    return run.stage.forward(params, 0, batch.B, batch.T, batch.input_tensor(),
                             batch.target_tensor(), 0.0f, nullptr);
  };
  std::vector<double> norms;
  for (const ParamSpec& spec : layout.params()) {
    float* param = ParamLayout::view(spec, params.acquire_params(spec.block)).f32();
    const float* grad = ParamLayout::view(spec, params.acquire_grads(spec.block)).f32();
    double grad_norm = 0.0;
    for (int64_t i = 0; i < spec.file_numel(); ++i) grad_norm += double(grad[i]) * grad[i];
    norms.push_back(grad_norm);
    for (int probe = 0; probe < 4; ++probe) {
      const int64_t i = int64_t(rng.below(spec.file_numel()));
      const float saved = param[i];
      param[i] = float(saved + h);
      const double plus = loss();
      param[i] = float(saved - h);
      const double minus = loss();
      param[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 5e-4 + 2e-2 * std::abs(numeric))
          << spec.name << "[" << i << "]";
    }
  }
  return norms;
}

}  // namespace dstrain::test
