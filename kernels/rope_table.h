// The host-side table of rotary position embeddings that Backend::rope_forward/rope_backward
// read: freqs (T, hd/2, 2) F32 = (cos, sin) of angle t * inv_freq[i]. Built once per model on
// the host, shared by the model and the tests. Needs no CUDA header.
//
// Precision: inv_freq, the angle and its cos/sin are all computed in double and only the final
// cos and sin are rounded to float. Hugging Face computes inv_freq and t * inv_freq in fp32,
// whose angle error grows with t (about 1e-4 rad at t = 2000); this table is the exact value
// to within one float rounding, so it can differ from a PyTorch run by that much, not more.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/check.h"

namespace dstrain {

// inv_freq[i] = 1 / theta^(2i / head_dim) for i < head_dim / 2, in double. A config with rope
// scaling (Llama 3's) adjusts these before fill_rope_table. REQUIRES: head_dim even, theta > 0.
inline std::vector<double> rope_inv_freq(int64_t head_dim, double theta) {
  DSTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0 && theta > 0.0)
      << "rope: head_dim " << head_dim << " must be even and rope_theta " << theta
      << " positive";
  std::vector<double> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  }
  return inv_freq;
}

// YaRN's rope scaling as DeepSeek-V2/V3 apply it (rope_scaling type "yarn"; their
// DeepseekV2YarnRotaryEmbedding), at every length: each frequency a blend of the original one
// (extrapolated) and it divided by `factor` (interpolated), by a ramp between the dims where
// `beta_fast` and `beta_slow` rotations fit the original context:
//   corr(r) = d ln(original / (2 pi r)) / (2 ln theta), low = max(floor(corr(beta_fast)), 0),
//   high = min(ceil(corr(beta_slow)), d - 1) (+ 0.001 where equal),
//   ramp_i = clamp((i - low) / (high - low), 0, 1),
//   inv_freq_i = inter_i ramp_i + extra_i (1 - ramp_i).
// REQUIRES: head_dim even, theta > 0, factor >= 1, original > 0, beta_fast > 0, beta_slow > 0.
inline std::vector<double> rope_inv_freq_yarn(int64_t head_dim, double theta, double factor,
                                              double original, double beta_fast,
                                              double beta_slow) {
  DSTRAIN_CHECK(factor >= 1.0 && original > 0.0 && beta_fast > 0.0 && beta_slow > 0.0)
      << "yarn: factor " << factor << ", original_max_position_embeddings " << original
      << ", beta_fast " << beta_fast << ", beta_slow " << beta_slow;
  std::vector<double> inv_freq = rope_inv_freq(head_dim, theta);
  const double d = static_cast<double>(head_dim);
  const auto corr = [&](double rotations) {
    return d * std::log(original / (rotations * 2.0 * 3.141592653589793)) / (2.0 * std::log(theta));
  };
  const double low = std::max(std::floor(corr(beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(beta_slow)), d - 1.0);
  if (low == high) high += 0.001;
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv_freq[i] = inv_freq[i] / factor * ramp + inv_freq[i] * (1.0 - ramp);
  }
  return inv_freq;
}

// YaRN's attention magnitude (DeepSeek's yarn_get_mscale): 0.1 mscale ln(factor) + 1, or 1 for
// factor <= 1.
inline double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

// table (T, inv_freq.size(), 2) floats: (cos, sin) of t * inv_freq[i], times `magnitude` (YaRN's
// mscale ratio; 1 otherwise), rounded once from double.
inline void fill_rope_table(float* table, int64_t T, const std::vector<double>& inv_freq,
                            double magnitude = 1.0) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      table[(t * half + i) * 2] = static_cast<float>(magnitude * std::cos(angle));
      table[(t * half + i) * 2 + 1] = static_cast<float>(magnitude * std::sin(angle));
    }
  }
}

// The unscaled table (T, head_dim/2, 2) as a vector: rope_inv_freq then fill_rope_table.
inline std::vector<float> rope_table(int64_t T, int64_t head_dim, double theta) {
  const std::vector<double> inv_freq = rope_inv_freq(head_dim, theta);
  std::vector<float> table(static_cast<size_t>(T * head_dim));
  fill_rope_table(table.data(), T, inv_freq);
  return table;
}

}  // namespace dstrain
