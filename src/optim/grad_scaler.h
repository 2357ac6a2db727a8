// Dynamic loss scaling for fp16 training, with PyTorch GradScaler's semantics and defaults:
// the loss (so every gradient) is multiplied by `scale`; a step whose gradients hold an inf
// or NaN on any rank is skipped and the scale halves; after `growth_interval` clean steps in
// a row the scale doubles. Disabled (scale 1, never skips) for fp32 and bf16.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

namespace dstrain {

class GradScaler {
 public:
  static constexpr double kInitialScale = 65536.0;
  static constexpr double kGrowthFactor = 2.0;
  static constexpr double kBackoffFactor = 0.5;
  static constexpr int64_t kGrowthInterval = 2000;

  explicit GradScaler(bool enabled) : enabled_(enabled), scale_(enabled ? kInitialScale : 1.0) {}

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }

  // After a step's gradients are known (found_inf agreed by all ranks): back off and skip, or
  // count a clean step and maybe grow. Returns true when the optimizer step must be skipped.
  bool update(bool found_inf);

  nlohmann::json state() const;
  // Throws UserError on a malformed state.
  void restore(const nlohmann::json& state);

 private:
  bool enabled_;
  double scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace dstrain
