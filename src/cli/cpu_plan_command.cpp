// `dstrain plan --device cpu`: plans for this machine's CPU ranks, where everything a run holds
// is host memory of one process (parallel/cpu_plan.h), so that "run dstrain plan" is advice a
// machine without a GPU can follow too.
#include "cli/cpu_plan_command.h"

#include <cstdio>
#include <sstream>

#include "core/check.h"
#include "parallel/cpu_plan.h"
#include "topology/host_memory.h"

namespace dstrain {

namespace {

// The dstrain flags that run `plan` on CPU ranks.
std::string run_flags(const Plan& plan) {
  std::ostringstream flags;
  flags << "--device cpu --gpus " << plan.world();
  if (plan.tp > 1) flags << " --tp " << plan.tp;
  if (plan.pp > 1) flags << " --pp " << plan.pp;
  if (plan.zero > 0) flags << " --zero " << plan.zero;
  if (plan.recompute != Recompute::None) flags << " --recompute " << recompute_name(plan.recompute);
  flags << " --batch " << plan.micro_batch << " --grad-accum " << plan.grad_accum << " --seq-len "
        << plan.seq_len;
  if (plan.param_dtype != DType::F32) flags << " --precision " << precision_name(plan);
  return flags.str();
}

std::string needs(const CpuRunBytes& bytes) {
  return format_bytes(bytes.total()) + " (the ranks " + format_bytes(bytes.ranks) +
         ", the starting weights and moments " + format_bytes(bytes.starting) +
         (bytes.sample > 0 ? ", the final sample's copies " + format_bytes(bytes.sample) : "") +
         ", the process's own " + format_bytes(bytes.allowance) + ")";
}

void print_options(const CpuPlanResult& result, std::ostream& out) {
  out << "\nthe largest micro-batch that fits, by ZeRO stage and recompute:\n"
      << "  ZeRO  recompute  micro-batch  accumulation  memory\n";
  for (const CpuPlanOption& option : result.options) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-4d  %-9s  %-11s  %-12s  %s%s\n", option.plan.zero,
                  recompute_name(option.plan.recompute),
                  option.fits ? std::to_string(option.plan.micro_batch).c_str() : "-",
                  option.fits ? std::to_string(option.plan.grad_accum).c_str() : "-",
                  format_bytes(option.bytes.total()).c_str(),
                  option.fits ? "" : " at micro-batch 1: does not fit");
    out << line;
  }
}

}  // namespace

int run_cpu_plan(const ModelConfig& config, const CpuPlanRequest& request, std::ostream& out) {
  DSTRAIN_USER_CHECK(request.ranks % (request.tp * request.pp) == 0)
      << "--gpus " << request.ranks << " ranks cannot be cut into " << request.pp
      << " pipeline stages of " << request.tp << " tensor-parallel ranks";
  Plan shape;
  shape.tp = request.tp;
  shape.pp = request.pp;
  shape.dp = request.ranks / (request.tp * request.pp);
  shape.seq_len = request.seq_len;
  shape.param_dtype = request.precision;
  shape.fp8 = request.fp8;
  shape.sequence_parallel = request.tp > 1;
  const int64_t sequences = request.global_batch_tokens / request.seq_len;
  DSTRAIN_USER_CHECK(request.global_batch_tokens % request.seq_len == 0 && sequences % shape.dp == 0)
      << "--global-batch-tokens " << request.global_batch_tokens << " must be a multiple of "
      << "--seq-len " << request.seq_len << " x " << shape.dp << " data-parallel ranks";
  const MemoryModel model(config);
  const HostMemoryBudget budget = available_host_memory();
  const CpuPlanResult result = plan_cpu_ranks(model, shape, sequences, request.sample, budget.bytes);
  out << "CPU ranks of this machine: " << request.ranks << " (threads of one process), "
      << format_bytes(budget.bytes) << " of host memory available ("
      << (budget.limited_by.empty() ? "unknown" : budget.limited_by) << ")\n"
      << "model " << config.name << ", " << sequences << " sequences of " << request.seq_len
      << " tokens per step\n";
  if (result.best) {
    out << "\nplan: " << describe(result.best->plan) << "\n  needs " << needs(result.best->bytes)
        << "\n  run it with: dstrain --model " << config.name << " " << run_flags(result.best->plan)
        << "\n";
  } else {
    out << "\nno plan of " << request.ranks << " CPU ranks fits: use a smaller --seq-len or "
        << "model, or a machine with more memory\n";
  }
  print_options(result, out);
  return 0;
}

}  // namespace dstrain
