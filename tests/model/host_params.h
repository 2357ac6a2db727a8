// Flat per-block parameter and gradient buffers in host memory: the simplest ParamProvider,
// for the model tests.
#pragma once

#include <vector>

#include "model/layout.h"
#include "model/param_provider.h"

namespace dstrain::test {

struct HostParams : ParamProvider {
  explicit HostParams(const ParamLayout& layout) {
    for (int block = 0; block < layout.num_blocks(); ++block) {
      params.emplace_back(layout.block_numel(block), 0.0f);
      grads.emplace_back(layout.block_numel(block), 0.0f);
    }
  }
  Tensor acquire_params(int block) override {
    return Tensor(params[block].data(), DType::F32, {int64_t(params[block].size())});
  }
  Tensor acquire_grads(int block) override {
    return Tensor(grads[block].data(), DType::F32, {int64_t(grads[block].size())});
  }
  std::vector<std::vector<float>> params, grads;
};

}  // namespace dstrain::test
