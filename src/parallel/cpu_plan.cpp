#include "parallel/cpu_plan.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/check.h"

namespace dstrain {

namespace {

uint64_t fp32_bytes(const std::vector<int64_t>& numels) {
  uint64_t bytes = 0;
  for (int64_t numel : numels) bytes += static_cast<uint64_t>(numel) * sizeof(float);
  return bytes;
}

// The final sample's host copies (train/rank_trainer.cpp's gather): rank 0 the whole model,
// every other rank its stage's blocks, and under tensor parallelism each rank its slices of
// them (rank 0 also one block of any rank's slices at a time: counted as all of them).
uint64_t sample_bytes(const MemoryModel& model, const Plan& plan) {
  Plan whole = plan;
  whole.tp = 1;
  whole.sequence_parallel = false;
  const uint64_t model_bytes = static_cast<uint64_t>(model.layout().total_numel()) * sizeof(float);
  uint64_t bytes = model_bytes;
  for (int stage = 0; stage < plan.pp; ++stage) {
    const uint64_t full = fp32_bytes(model.stage_block_numels(whole, stage));
    const uint64_t slices = plan.tp > 1 ? fp32_bytes(model.stage_block_numels(plan, stage)) : 0;
    const uint64_t ranks = static_cast<uint64_t>(plan.dp * plan.tp) - (stage == 0 ? 1 : 0);
    bytes += ranks * (full + slices) + (stage == 0 ? slices : 0);
  }
  return bytes + (plan.tp > 1 ? model_bytes / static_cast<uint64_t>(plan.tp) : 0);
}

}  // namespace

CpuRunBytes cpu_run_bytes(const MemoryModel& model, const Plan& plan, bool sample) {
  const uint64_t weights = static_cast<uint64_t>(model.layout().total_numel()) * sizeof(float);
  CpuRunBytes bytes;
  bytes.ranks = model.cpu_bytes_all_ranks(plan);
  bytes.starting = 3 * weights;
  bytes.sample = sample ? sample_bytes(model, plan) : 0;
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
        for (const int64_t micro : divisors_descending(sequences / dp)) {
          if (micro > plan.micro_batch) continue;
          Plan candidate = plan;
          candidate.dp = dp;
          candidate.zero = dp > 1 ? zero : 0;
          candidate.recompute = recompute;
          candidate.micro_batch = micro;
          candidate.grad_accum = sequences / (dp * micro);
          if (cpu_run_bytes(model, candidate, sample).total() > budget) continue;
          // Fewest changed settings; then more ranks, a larger micro-batch, less recompute.
          const auto rank = [&](const Plan& p) {
            return std::make_tuple(changes(plan, p), -p.dp, -p.micro_batch,
                                   static_cast<int>(p.recompute), p.zero);
          };
          if (!best || rank(candidate) < rank(*best)) best = candidate;
          break;  // smaller micro-batches of this shape only change more
        }
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
           << "), but " << format_bytes(budget.bytes) << " is available (" << budget.limited_by
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

}  // namespace dstrain
