#include "parallel/cpu_plan.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/check.h"

namespace dstrain {

namespace {

// The final sample's host copies (train/rank_trainer.cpp's gather): rank 0 the whole model and
// one block of another rank's slices at a time, every other rank one block at a time.
uint64_t sample_bytes(const MemoryModel& model, const Plan& plan) {
  const ParamLayout& layout = model.layout();
  int64_t largest = 0;
  for (int block = 0; block < layout.num_blocks(); ++block) {
    largest = std::max(largest, layout.block_numel(block));
  }
  const uint64_t model_bytes = static_cast<uint64_t>(layout.total_numel()) * sizeof(float);
  // Unsliced, rank 0 gathers in place; sliced, it also holds its own slice and another's.
  const int buffers = plan.tp > 1 ? plan.world() + 1 : plan.world() - 1;
  return model_bytes + static_cast<uint64_t>(largest) * sizeof(float) *
                           static_cast<uint64_t>(buffers);
}

}  // namespace

CpuRunBytes cpu_run_bytes(const MemoryModel& model, const Plan& plan, bool sample) {
  const uint64_t weights = static_cast<uint64_t>(model.layout().total_numel()) * sizeof(float);
  CpuRunBytes bytes;
  bytes.ranks = model.cpu_bytes_all_ranks(plan);
  bytes.starting = 3 * weights;
  bytes.sample = sample ? sample_bytes(model, plan) : 0;
  bytes.allowance = kCpuBaseAllowance + kCpuRankAllowance * static_cast<uint64_t>(plan.world());
  return bytes;
}

namespace {

// The divisors of n from n down to 1 (micro-batches that keep a global batch whole).
std::vector<int64_t> divisors_descending(int64_t n) {
  std::vector<int64_t> found;
  for (int64_t d = n; d >= 1; --d) {
    if (n % d == 0) found.push_back(d);
  }
  return found;
}

// `shape` (its dp, ZeRO stage and recompute as set) at the largest micro-batch up to `most`
// that divides a rank's share of `sequences` and fits `budget`, the accumulation reaching the
// step; not fitting: micro-batch 1 and its bytes.
CpuPlanOption largest_that_fits(const MemoryModel& model, const Plan& shape, int64_t sequences,
                                int64_t most, bool sample, uint64_t budget) {
  const int64_t per_rank = sequences / shape.dp;
  CpuPlanOption option;
  for (const int64_t micro : divisors_descending(per_rank)) {
    if (micro > most) continue;
    Plan plan = shape;
    plan.micro_batch = micro;
    plan.grad_accum = per_rank / micro;
    option = CpuPlanOption{plan, cpu_run_bytes(model, plan, sample), false};
    option.fits = option.bytes.total() <= budget;
    if (option.fits) break;
  }
  return option;
}

int changes(const Plan& from, const Plan& to) {
  return (from.zero != to.zero) + (from.recompute != to.recompute) +
         (from.micro_batch != to.micro_batch) + (from.dp != to.dp);
}

}  // namespace

std::optional<Plan> cpu_plan_that_fits(const MemoryModel& model, const Plan& plan, bool sample,
                                       uint64_t budget) {
  const int64_t sequences = plan.micro_batch * plan.grad_accum * plan.dp;  // per step
  std::optional<Plan> best;
  for (int dp = plan.dp; dp >= 1; --dp) {
    if (sequences % dp != 0 || (dp != plan.dp && plan.dp % dp != 0)) continue;
    for (const int zero : {plan.zero, 3}) {
      for (const Recompute recompute : {plan.recompute, Recompute::Full}) {
        Plan shape = plan;
        shape.dp = dp;
        shape.zero = dp > 1 ? zero : 0;
        shape.recompute = recompute;
        const CpuPlanOption option =
            largest_that_fits(model, shape, sequences, plan.micro_batch, sample, budget);
        if (!option.fits) continue;
        // Fewest changed settings; then more ranks, a larger micro-batch, less recompute.
        const auto rank = [&](const Plan& p) {
          return std::make_tuple(changes(plan, p), -p.dp, -p.micro_batch,
                                 static_cast<int>(p.recompute), p.zero);
        };
        if (!best || rank(option.plan) < rank(*best)) best = option.plan;
      }
    }
  }
  return best;
}

std::string plan_flag_changes(const Plan& from, const Plan& to) {
  std::ostringstream flags;
  if (to.dp != from.dp) flags << " --gpus " << to.world();
  if (to.zero != from.zero) flags << " --zero " << to.zero;
  if (to.recompute != from.recompute) flags << " --recompute " << recompute_name(to.recompute);
  if (to.micro_batch != from.micro_batch) flags << " --batch " << to.micro_batch;
  if (to.grad_accum != from.grad_accum) flags << " --grad-accum " << to.grad_accum;
  const std::string text = flags.str();
  return text.empty() ? text : text.substr(1);
}

void check_cpu_memory(const MemoryModel& model, const Plan& plan, bool sample,
                      const HostMemoryBudget& budget) {
  if (budget.limited_by.empty()) return;  // nothing could be read: nothing to check against
  const CpuRunBytes needed = cpu_run_bytes(model, plan, sample);
  if (needed.total() <= budget.bytes) return;
  std::ostringstream sentence;
  sentence << "this run needs " << format_bytes(needed.total()) << " of host memory on CPU ranks ("
           << describe(plan) << ": the ranks " << format_bytes(needed.ranks)
           << ", the starting weights and moments " << format_bytes(needed.starting)
           << (needed.sample > 0 ? ", the final sample's copies " + format_bytes(needed.sample)
                                 : std::string())
           << ", the process's own " << format_bytes(needed.allowance) << "), but " << format_bytes(budget.bytes) << " is available (" << budget.limited_by
           << ")";
  const std::optional<Plan> fits = cpu_plan_that_fits(model, plan, sample, budget.bytes);
  if (fits) {
    sentence << "; " << plan_flag_changes(plan, *fits) << " would need "
             << format_bytes(cpu_run_bytes(model, *fits, sample).total())
             << " (dstrain plan --device cpu shows the options)";
  } else {
    sentence << "; no plan of these ranks fits: use a smaller --seq-len or model, or a machine "
             << "with more memory";
  }
  DSTRAIN_USER_ERROR() << sentence.str();
}

CpuPlanResult plan_cpu_ranks(const MemoryModel& model, const Plan& shape, int64_t sequences,
                             bool sample, uint64_t budget) {
  CpuPlanResult result;
  const int64_t per_rank = sequences / shape.dp;
  const std::vector<int> zeros = shape.dp > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0};
  for (const int zero : zeros) {
    for (const Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      Plan plan = shape;
      plan.zero = zero;
      plan.recompute = recompute;
      result.options.push_back(largest_that_fits(model, plan, sequences, per_rank, sample, budget));
    }
  }
  // The fastest that fits: recompute costs compute, a larger micro-batch runs larger GEMMs,
  // and ZeRO's collectives are copies between the threads: less recompute first, then the
  // larger micro-batch, then the lower stage.
  const auto speed = [](const Plan& p) {
    return std::make_tuple(static_cast<int>(p.recompute), -p.micro_batch, p.zero);
  };
  for (const CpuPlanOption& option : result.options) {
    if (option.fits && (!result.best || speed(option.plan) < speed(result.best->plan))) {
      result.best = option;
    }
  }
  return result;
}

}  // namespace dstrain
