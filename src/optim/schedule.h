// Learning-rate schedules. Step s is the 0-based index of the optimizer step.
#pragma once

#include <cstdint>
#include <string>

namespace dstrain {

enum class LrSchedule { Constant, Cosine };
LrSchedule parse_lr_schedule(const std::string& name);  // "constant" | "cosine"
const char* lr_schedule_name(LrSchedule schedule);

struct LrScheduleConfig {
  LrSchedule kind = LrSchedule::Cosine;
  double lr = 6e-4;       // peak
  double min_lr = 0.0;    // the cosine floor
  int64_t warmup = 0;     // linear warmup steps: lr * (s+1) / warmup for s < warmup
  int64_t total_steps = 1;
};

// Warmup (both kinds), then constant, or cosine decay from lr to min_lr over the remaining
// steps: min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (s - warmup) / max(1, total - warmup))).
double learning_rate(const LrScheduleConfig& config, int64_t step);

}  // namespace dstrain
