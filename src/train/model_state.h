// The trainable state of one rank: per block, the parameters, their gradients and the Adam
// moments, each a flat buffer in its memory category. (With one rank and fp32 the
// parameters are the master weights.)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/layout.h"
#include "optim/adamw.h"

namespace dstrain {

class ModelState : public ParamProvider {
 public:
  ModelState(const ModelConfig& config, Allocator& allocator);

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int num_blocks() const { return layout_.num_blocks(); }
  Tensor params(int block) const;
  Tensor grads(int block) const;
  Tensor exp_avg(int block) const;
  Tensor exp_avg_sq(int block) const;

  // ParamProvider: the replicated, whole buffers.
  Tensor acquire_params(int block) override { return params(block); }
  Tensor acquire_grads(int block) override { return grads(block); }

  // Weights as tensors with Hugging Face names and file shapes, and back.
  // Saves model.safetensors (F32) atomically.
  void save_weights(const std::string& path) const;
  // Loads a Hugging Face GPT-2 model.safetensors: names with or without the "transformer."
  // prefix; attn.bias / attn.masked_bias buffers and lm_head.weight (tied) are ignored;
  // F32/F16/BF16 accepted. Throws UserError on a missing tensor or a shape mismatch.
  void load_weights(const std::string& path);
  void save_optimizer(const std::string& path) const;
  void load_optimizer(const std::string& path);

  void zero_grads();

  // Clips by the global gradient norm and takes one AdamW step on every block (step is
  // 1-based). Returns the gradient norm before clipping.
  double optimizer_step(Backend& backend, const AdamWConfig& adam, double lr, int64_t step);

 private:
  ModelConfig config_;
  ParamLayout layout_;
  std::vector<Buffer> params_, grads_, exp_avg_, exp_avg_sq_;
};

}  // namespace dstrain
