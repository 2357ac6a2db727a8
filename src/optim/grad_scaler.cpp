#include "optim/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace dstrain {

GradScaler::GradScaler(bool enabled, const LossScaling& settings)
    : enabled_(enabled),
      settings_(settings),
      scale_(enabled ? settings.initial_scale : 1.0),
      hysteresis_left_(settings.hysteresis) {
  DSTRAIN_CHECK(settings.initial_scale > 0 && std::isfinite(settings.initial_scale) &&
                settings.growth_interval >= 1 && settings.hysteresis >= 1 &&
                settings.min_scale >= 0)
      << "loss scaling settings out of range";
}

bool GradScaler::update(bool found_inf) {
  if (!enabled_) return false;
  if (found_inf) {
    if (hysteresis_left_ > 1) {
      --hysteresis_left_;
    } else {
      scale_ = std::max(scale_ * kBackoffFactor, settings_.min_scale);
    }
    growth_tracker_ = 0;
    return true;
  }
  if (++growth_tracker_ == settings_.growth_interval) {
    scale_ *= kGrowthFactor;
    growth_tracker_ = 0;
    hysteresis_left_ = settings_.hysteresis;
  }
  return false;
}

nlohmann::json GradScaler::state() const {
  return nlohmann::json{{"enabled", enabled_},
                        {"scale", scale_},
                        {"growth_tracker", growth_tracker_},
                        {"hysteresis_left", hysteresis_left_}};
}

void GradScaler::restore(const nlohmann::json& state) {
  DSTRAIN_USER_CHECK(state.is_object() && state.contains("scale") && state["scale"].is_number() &&
                     state.contains("growth_tracker") && state["growth_tracker"].is_number_integer())
      << "the checkpoint's gradient scaler state is malformed";
  const double scale = state["scale"].get<double>();
  const int64_t tracker = state["growth_tracker"].get<int64_t>();
  const int64_t hysteresis = state.value("hysteresis_left", settings_.hysteresis);
  DSTRAIN_USER_CHECK(std::isfinite(scale) && scale > 0 && tracker >= 0 && hysteresis >= 1)
      << "the checkpoint's gradient scaler state is out of range (scale " << scale
      << ", growth_tracker " << tracker << ", hysteresis_left " << hysteresis << ")";
  if (!enabled_) return;  // resuming an fp16 run in another precision starts unscaled
  scale_ = scale;
  growth_tracker_ = std::min(tracker, settings_.growth_interval - 1);
  hysteresis_left_ = std::min(hysteresis, settings_.hysteresis);
}

}  // namespace dstrain
