#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace dstrain {

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrSchedule::Constant;
  if (name == "cosine") return LrSchedule::Cosine;
  DSTRAIN_USER_ERROR() << "unknown --lr-schedule '" << name << "' (expected constant or cosine)";
  return LrSchedule::Constant;
}

const char* lr_schedule_name(LrSchedule schedule) {
  return schedule == LrSchedule::Constant ? "constant" : "cosine";
}

double learning_rate(const LrScheduleConfig& config, int64_t step) {
  if (step < config.warmup) {
    return config.lr * static_cast<double>(step + 1) / static_cast<double>(config.warmup);
  }
  if (config.kind == LrSchedule::Constant) return config.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, config.total_steps - config.warmup));
  const double progress = std::min(1.0, static_cast<double>(step - config.warmup) / span);
  return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace dstrain
