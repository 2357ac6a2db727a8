#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace dstrain {

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrSchedule::Constant;
  if (name == "cosine") return LrSchedule::Cosine;
  if (name == "warmup-lr") return LrSchedule::WarmupLr;
  if (name == "warmup-decay-lr") return LrSchedule::WarmupDecayLr;
  if (name == "warmup-cosine-lr") return LrSchedule::WarmupCosineLr;
  DSTRAIN_USER_ERROR() << "unknown --lr-schedule '" << name
                       << "' (expected constant, cosine, or DeepSpeed's warmup-lr, "
                          "warmup-decay-lr, warmup-cosine-lr)";
  return LrSchedule::Constant;
}

const char* lr_schedule_name(LrSchedule schedule) {
  switch (schedule) {
    case LrSchedule::Constant: return "constant";
    case LrSchedule::Cosine: return "cosine";
    case LrSchedule::WarmupLr: return "warmup-lr";
    case LrSchedule::WarmupDecayLr: return "warmup-decay-lr";
    case LrSchedule::WarmupCosineLr: return "warmup-cosine-lr";
  }
  return "cosine";
}

bool is_deepspeed_schedule(LrSchedule schedule) {
  return schedule == LrSchedule::WarmupLr || schedule == LrSchedule::WarmupDecayLr ||
         schedule == LrSchedule::WarmupCosineLr;
}

WarmupType parse_warmup_type(const std::string& name) {
  if (name == "linear") return WarmupType::Linear;
  if (name == "log") return WarmupType::Log;
  DSTRAIN_USER_ERROR() << "unknown --warmup-type '" << name << "' (expected linear or log)";
  return WarmupType::Linear;
}

namespace {

double dstrain_rate(const LrScheduleConfig& config, int64_t step) {
  if (step < config.warmup) {
    // (lr - 0) * (s+1) / warmup: without --warmup-min-lr, lr * (s+1) / warmup to the bit.
    return config.warmup_min_lr + (config.lr - config.warmup_min_lr) *
                                      static_cast<double>(step + 1) /
                                      static_cast<double>(config.warmup);
  }
  if (config.kind == LrSchedule::Constant) return config.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, config.total_steps - config.warmup));
  const double progress = std::min(1.0, static_cast<double>(step - config.warmup) / span);
  return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

// DeepSpeed's schedulers at last_batch_iteration i (lr_schedules.py, see the header).
double deepspeed_rate(const LrScheduleConfig& config, int64_t i) {
  const bool cosine = config.kind == LrSchedule::WarmupCosineLr;
  if (i < 0) return cosine ? 0.0 : config.warmup_min_lr;
  const int64_t W = std::max<int64_t>(2, config.warmup);
  const double lo = config.warmup_min_lr, delta = config.lr - config.warmup_min_lr;
  const double x = static_cast<double>(i);
  if (i < W) {
    const double g = config.warmup_type == WarmupType::Log
                         ? std::log(x + 1.0) / std::log(static_cast<double>(W))
                         : x / static_cast<double>(W);
    return lo + delta * g;
  }
  const double span = static_cast<double>(std::max<int64_t>(1, config.total_steps - W));
  if (config.kind == LrSchedule::WarmupLr) return config.lr;
  if (config.kind == LrSchedule::WarmupDecayLr) {
    return lo + delta * std::max(0.0, (static_cast<double>(config.total_steps) - x) / span);
  }
  const double progress = std::min(1.0, (x - static_cast<double>(W) + 1.0) / span);
  const double floor = config.lr > 0 ? config.min_lr / config.lr : 0.0;
  const double ratio = std::max(0.0, floor + (1.0 - floor) * (1.0 + std::cos(M_PI * progress)) / 2.0);
  return config.lr * ratio;
}

}  // namespace

double learning_rate(const LrScheduleConfig& config, int64_t step) {
  return is_deepspeed_schedule(config.kind) ? deepspeed_rate(config, step - 1)
                                            : dstrain_rate(config, step);
}

}  // namespace dstrain
