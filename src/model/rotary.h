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

// The rotary frequencies of `config` (head_dim / 2 of them): inv_freq[i] = rope_theta^(-2i/hd),
// with Llama 3's rope scaling when the config has it. In double.
std::vector<double> rope_inverse_frequencies(const ModelConfig& config);

// The (T, hd/2, 2) host tables of (cos, sin) a rotary position part copies to its workspace:
// one per longer T asked so far, kept and never moved (a stream may still copy from one).
class RotaryTables {
 public:
  explicit RotaryTables(std::vector<double> inv_freq) : inv_freq_(std::move(inv_freq)) {}
  // The table of at least T positions. Thread-safe.
  const float* at_least(int64_t T) const;

 private:
  std::vector<double> inv_freq_;
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<const std::vector<float>>> tables_;
};

}  // namespace dstrain
