// The rotary position part (model/parts.h, PositionKind::Rotary): the frequencies a config asks
// for, and the host tables of (cos, sin) the decoder copies to its workspace for
// Backend::rope_forward / rope_backward (kernels/rope_table.h computes them).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "model/config.h"

namespace dstrain {

// The rotary frequencies of `config` (rotary_dim / 2 of them: head_dim, or latent attention's
// rope part): inv_freq[i] = rope_theta^(-2i/d), with Llama 3's or DeepSeek's YaRN rope scaling
// when the config has it. In double.
std::vector<double> rope_inverse_frequencies(const ModelConfig& config);
// What the (cos, sin) table is multiplied by: YaRN's mscale / mscale_all_dim magnitudes
// (DeepseekV2YarnRotaryEmbedding); 1 otherwise.
double rope_table_magnitude(const ModelConfig& config);
// The attention's softmax scale beyond head_dim^-1/2: DeepSeek's mscale^2 where rope_scaling has
// a non-zero mscale_all_dim (mscale = yarn_mscale(factor, mscale_all_dim)); 1 otherwise.
double attention_softmax_factor(const ModelConfig& config);

// The (T, hd/2, 2) host tables of (cos, sin) a rotary position part copies to its workspace:
// one per longer T asked so far, kept and never moved (a stream may still copy from one).
class RotaryTables {
 public:
  explicit RotaryTables(std::vector<double> inv_freq, double magnitude = 1.0)
      : inv_freq_(std::move(inv_freq)), magnitude_(magnitude) {}
  // The table of at least T positions. Thread-safe.
  const float* at_least(int64_t T) const;

 private:
  std::vector<double> inv_freq_;
  double magnitude_ = 1.0;
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<const std::vector<float>>> tables_;
};

}  // namespace dstrain
