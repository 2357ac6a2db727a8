#include "model/rotary.h"

#include <cmath>
#include <numbers>

#include "kernels/rope_table.h"

namespace dstrain {

std::vector<double> rope_inverse_frequencies(const ModelConfig& config) {
  std::vector<double> inv_freq = rope_inv_freq(config.head_dim(), config.rope_theta);
  const nlohmann::json& scaling = config.rope_scaling;
  if (scaling.is_null()) return inv_freq;
  // Llama 3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
  const double factor = scaling["factor"], low = scaling["low_freq_factor"];
  const double high = scaling["high_freq_factor"];
  const double context = scaling["original_max_position_embeddings"];
  const double low_freq_wavelength = context / low, high_freq_wavelength = context / high;
  for (double& f : inv_freq) {
    const double wavelength = 2 * std::numbers::pi / f;
    if (wavelength > low_freq_wavelength) {
      f /= factor;
    } else if (wavelength >= high_freq_wavelength) {
      const double smooth = (context / wavelength - low) / (high - low);
      f = (1 - smooth) * f / factor + smooth * f;
    }
  }
  return inv_freq;
}

const float* RotaryTables::at_least(int64_t T) const {
  const int64_t half = static_cast<int64_t>(inv_freq_.size());
  std::lock_guard<std::mutex> lock(mutex_);
  if (tables_.empty() || static_cast<int64_t>(tables_.back()->size()) < T * half * 2) {
    auto table = std::make_unique<std::vector<float>>(static_cast<size_t>(T * half * 2));
    fill_rope_table(table->data(), T, inv_freq_);
    tables_.push_back(std::move(table));
  }
  return tables_.back()->data();
}

}  // namespace dstrain
