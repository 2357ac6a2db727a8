// Dynamic loss scaling for fp16 training, with PyTorch GradScaler's semantics and defaults:
// the loss (so every gradient) is multiplied by `scale`; a step whose gradients hold an inf
// or NaN on any rank is skipped and the scale halves; after `growth_interval` clean steps in
// a row the scale doubles. DeepSpeed's two extras are settings: hysteresis (its "delayed
// shift": that many overflows in a row before the scale halves; every overflow still skips its
// step) and a floor. Disabled (scale 1, never skips) for fp32 and bf16.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

namespace dstrain {

struct LossScaling {
  double initial_scale = 65536.0;  // 2^16
  int64_t growth_interval = 2000;  // clean steps in a row before the scale doubles
  int64_t hysteresis = 1;          // overflows until the scale halves (1: at each, PyTorch's)
  double min_scale = 0.0;          // the scale never halves below it (0: no floor)
};

class GradScaler {
 public:
  static constexpr double kGrowthFactor = 2.0;
  static constexpr double kBackoffFactor = 0.5;

  // REQUIRES: initial_scale > 0, growth_interval >= 1, hysteresis >= 1, min_scale >= 0.
  explicit GradScaler(bool enabled, const LossScaling& settings = {});

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  const LossScaling& settings() const { return settings_; }

  // After a step's gradients are known (found_inf agreed by all ranks): back off and skip, or
  // count a clean step and maybe grow. Returns true when the optimizer step must be skipped.
  bool update(bool found_inf);

  nlohmann::json state() const;
  // Throws UserError on a malformed state. A state of another growth interval keeps its count
  // of clean steps up to the new interval; one without hysteresis (older runs) starts it anew.
  void restore(const nlohmann::json& state);

 private:
  bool enabled_;
  LossScaling settings_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_left_;  // overflows still absorbed before the next halving
};

}  // namespace dstrain
