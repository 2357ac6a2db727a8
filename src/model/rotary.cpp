#include "model/rotary.h"

#include <cmath>
#include <numbers>

#include "kernels/rope_table.h"

namespace dstrain {

namespace {

bool yarn(const ModelConfig& config) {
  const nlohmann::json& scaling = config.rope_scaling;
  return scaling.is_object() && scaling.value("type", scaling.value("rope_type", "")) == "yarn";
}

}  // namespace

std::vector<double> rope_inverse_frequencies(const ModelConfig& config) {
  const nlohmann::json& scaling = config.rope_scaling;
  if (yarn(config)) {
    return rope_inv_freq_yarn(config.rotary_dim(), config.rope_theta, scaling["factor"],
                              scaling["original_max_position_embeddings"], scaling["beta_fast"],
                              scaling["beta_slow"]);
  }
  std::vector<double> inv_freq = rope_inv_freq(config.rotary_dim(), config.rope_theta);
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

double rope_table_magnitude(const ModelConfig& config) {
  if (!yarn(config)) return 1.0;
  const nlohmann::json& s = config.rope_scaling;
  return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"]);
}

double attention_softmax_factor(const ModelConfig& config) {
  const nlohmann::json& s = config.rope_scaling;
  if (!config.mla.enabled() || !s.is_object()) return 1.0;
  const double all_dim = s.value("mscale_all_dim", 0.0);
  if (all_dim == 0.0) return 1.0;
  const double mscale = yarn_mscale(s["factor"], all_dim);
  return mscale * mscale;
}

const float* RotaryTables::at_least(int64_t T) const {
  const int64_t half = static_cast<int64_t>(inv_freq_.size());
  std::lock_guard<std::mutex> lock(mutex_);
  if (tables_.empty() || static_cast<int64_t>(tables_.back()->size()) < T * half * 2) {
    auto table = std::make_unique<std::vector<float>>(static_cast<size_t>(T * half * 2));
    fill_rope_table(table->data(), T, inv_freq_, magnitude_);
    tables_.push_back(std::move(table));
  }
  return tables_.back()->data();
}

}  // namespace dstrain
