// Model weights and optimizer state as files. In memory: one full (unsharded) F32 host
// buffer per block, laid out by ParamLayout. On disk: safetensors with Hugging Face GPT-2
// names and file shapes (wte.weight holds the real vocabulary rows only).
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/layout.h"

namespace dstrain {

// Full F32 host copies of every block (zeroed).
class HostBlocks {
 public:
  explicit HostBlocks(const ParamLayout& layout);
  const std::vector<Tensor>& tensors() const { return tensors_; }
  Tensor block(int b) const { return tensors_.at(b); }

 private:
  std::vector<std::vector<float>> storage_;
  std::vector<Tensor> tensors_;
};

// model.safetensors (F32), written atomically.
void save_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path);
// Loads a Hugging Face GPT-2 model.safetensors: names with or without the "transformer."
// prefix; attn.bias / attn.masked_bias buffers and lm_head.weight (tied) are ignored;
// F32/F16/BF16 accepted. Throws UserError on a missing or unknown tensor or a shape mismatch.
void load_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path);
// optimizer.safetensors: "<name>.exp_avg" and "<name>.exp_avg_sq".
void save_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);
void load_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);

}  // namespace dstrain
