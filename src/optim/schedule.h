// Learning-rate schedules. Step s is the 0-based index of the optimizer step.
#pragma once

#include <cstdint>
#include <string>

namespace dstrain {

// dstrain's own: constant or cosine after a linear warmup. DeepSpeed's three schedulers, step
// for step as deepspeed/runtime/lr_schedules.py computes them (WarmupLR, WarmupDecayLR,
// WarmupCosineLR), so a ds_config.json trains on the curve DeepSpeed would.
enum class LrSchedule { Constant, Cosine, WarmupLr, WarmupDecayLr, WarmupCosineLr };
// "constant" | "cosine" | "warmup-lr" | "warmup-decay-lr" | "warmup-cosine-lr".
LrSchedule parse_lr_schedule(const std::string& name);
const char* lr_schedule_name(LrSchedule schedule);
bool is_deepspeed_schedule(LrSchedule schedule);

// DeepSpeed's warmup shapes (its warmup_type): log (its default) or linear.
enum class WarmupType { Linear, Log };
WarmupType parse_warmup_type(const std::string& name);  // "linear" | "log"

struct LrScheduleConfig {
  LrSchedule kind = LrSchedule::Cosine;
  double lr = 6e-4;       // peak
  double min_lr = 0.0;    // the floor the decay ends at
  int64_t warmup = 0;     // warmup steps
  int64_t total_steps = 1;  // the decay's horizon (DeepSpeed's total_num_steps)
  WarmupType warmup_type = WarmupType::Linear;  // DeepSpeed's schedules only
  double warmup_min_lr = 0.0;  // where the warmup starts (DeepSpeed's warmup_min_lr)
};

// dstrain's (s: every step, skipped ones too): warmup lr * (s+1) / warmup for s < warmup,
// then constant, or cosine decay from lr to min_lr over the remaining steps:
// min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * min(1, (s - warmup) / max(1, total - warmup)))).
// DeepSpeed's (s: the steps applied before this one; DeepSpeed does not step its scheduler on
// an fp16 overflow), with i = s - 1 (its last_batch_iteration: the first step runs at the
// value the scheduler's constructor sets) and W = max(2, warmup):
//   warmup (0 <= i < W):  g = ln(i + 1) / ln(W) (log) or i / W (linear);
//                         lr' = warmup_min_lr + (lr - warmup_min_lr) * g
//   i < 0:                warmup_min_lr (WarmupLR, WarmupDecayLR), 0 (WarmupCosineLR)
//   after the warmup:     WarmupLR: lr; WarmupDecayLR: warmup_min_lr + (lr - warmup_min_lr) *
//                         max(0, (T - i) / max(1, T - W)); WarmupCosineLR: lr * max(0, c +
//                         (1 - c) * (1 + cos(pi * min(1, (i - W + 1) / max(1, T - W)))) / 2),
//                         c = min_lr / lr (its cos_min_ratio).
double learning_rate(const LrScheduleConfig& config, int64_t step);

}  // namespace dstrain
