// Checks every model test runs the same way: fresh parameters made non-trivial, and each
// parameter's gradient against central finite differences of the loss.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
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

// After model.forward(dloss 1/N) and backward on (inputs, targets): 4 random elements of every
// parameter against central differences (h = 1e-3) of the mean loss. Returns each parameter's
// squared gradient norm, by layout index.
inline std::vector<double> expect_gradients_match_finite_differences(
    ModelStage& model, HostParams& params, const ParamLayout& layout, int64_t B, int64_t T,
    Tensor inputs, Tensor targets) {
  Rng rng(5);
  const double h = 1e-3;
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
      const double plus = model.forward(params, 0, B, T, inputs, targets, 0.0f, nullptr);
      param[i] = float(saved - h);
      const double minus = model.forward(params, 0, B, T, inputs, targets, 0.0f, nullptr);
      param[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 5e-4 + 2e-2 * std::abs(numeric))
          << spec.name << "[" << i << "]";
    }
  }
  return norms;
}

}  // namespace dstrain::test
