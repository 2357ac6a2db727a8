#include "optim/grad_scaler.h"

#include <cmath>

#include "core/check.h"

namespace dstrain {

bool GradScaler::update(bool found_inf) {
  if (!enabled_) return false;
  if (found_inf) {
    scale_ *= kBackoffFactor;
    growth_tracker_ = 0;
    return true;
  }
  if (++growth_tracker_ == kGrowthInterval) {
    scale_ *= kGrowthFactor;
    growth_tracker_ = 0;
  }
  return false;
}

nlohmann::json GradScaler::state() const {
  return nlohmann::json{{"enabled", enabled_}, {"scale", scale_}, {"growth_tracker", growth_tracker_}};
}

void GradScaler::restore(const nlohmann::json& state) {
  DSTRAIN_USER_CHECK(state.is_object() && state.contains("scale") && state["scale"].is_number() &&
                     state.contains("growth_tracker") && state["growth_tracker"].is_number_integer())
      << "the checkpoint's gradient scaler state is malformed";
  const double scale = state["scale"].get<double>();
  const int64_t tracker = state["growth_tracker"].get<int64_t>();
  DSTRAIN_USER_CHECK(std::isfinite(scale) && scale > 0 && tracker >= 0 && tracker < kGrowthInterval)
      << "the checkpoint's gradient scaler state is out of range (scale " << scale
      << ", growth_tracker " << tracker << ")";
  if (!enabled_) return;  // resuming an fp16 run in another precision starts unscaled
  scale_ = scale;
  growth_tracker_ = tracker;
}

}  // namespace dstrain
