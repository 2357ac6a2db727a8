// Plans for CPU ranks: on the CPU backend every rank's buffers, and the run's own copies, are
// host memory of this one process, so a plan fits when their sum fits the memory this process
// may still allocate (topology/host_memory.h). Checked before anything is allocated, so a run
// that cannot fit says so in one sentence, naming a plan that does, instead of ending in
// std::bad_alloc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "parallel/memory_model.h"
#include "parallel/plan.h"
#include "topology/host_memory.h"

namespace dstrain {

constexpr uint64_t kCpuBaseAllowance = uint64_t{512} << 20;
constexpr uint64_t kCpuRankAllowance = uint64_t{128} << 20;  // an 8 MiB stack, a 64 MiB arena, ...

struct CpuRunBytes {
  uint64_t ranks = 0;     // every rank's buffers (MemoryModel::cpu_bytes_all_ranks)
  uint64_t starting = 0;  // the starting state train() holds while the ranks load it: the full
                          // fp32 weights and two Adam moments (train/checkpoint.h's
                          // FullTrainingState)
  uint64_t sample = 0;    // a sample at the end: the gathered fp32 weights (rank 0 all of
                          // them, the others one block at a time)
  // The process's own beyond its buffers, an allowance (not counted exactly): thread stacks
  // and allocator arenas per rank, BLAS buffers, the data (kCpuBaseAllowance +
  // kCpuRankAllowance per rank). Under `ulimit -v` address space reserved counts as used.
  uint64_t allowance = 0;
  uint64_t total() const { return ranks + starting + sample + allowance; }
};
CpuRunBytes cpu_run_bytes(const MemoryModel& model, const Plan& plan, bool sample);

// The closest plan to `plan` that fits `budget` bytes, keeping its global batch (sequences per
// step) and sequence length: ZeRO-3, full recompute, a smaller micro-batch with more
// accumulation, fewer data-parallel ranks, in the order of fewest changes; nullopt when none
// does.
std::optional<Plan> cpu_plan_that_fits(const MemoryModel& model, const Plan& plan, bool sample,
                                       uint64_t budget);

// The flags that turn `from` into `to` ("--zero 3 --recompute full --batch 2 --grad-accum 8").
std::string plan_flag_changes(const Plan& from, const Plan& to);

// Throws UserError when `plan` does not fit `budget` on CPU ranks: what it needs, what there is
// and what limits it, and the plan that fits (or that none does).
void check_cpu_memory(const MemoryModel& model, const Plan& plan, bool sample,
                      const HostMemoryBudget& budget);

}  // namespace dstrain

namespace dstrain {

// `dstrain plan --device cpu`: the plans of `ranks` CPU ranks for `request`'s fixed parts
// (dp, tp, pp, ZeRO, recompute, micro-batch; the global batch kept exactly), each ZeRO stage
// and recompute mode at the largest micro-batch that fits `budget`, and the chosen one: the
// fastest that fits (the least recompute, then the largest micro-batch, then the lowest ZeRO
// stage).
struct CpuPlanOption {
  Plan plan;
  CpuRunBytes bytes;
  bool fits = false;
};
struct CpuPlanResult {
  std::optional<CpuPlanOption> best;    // none when nothing fits
  std::vector<CpuPlanOption> options;   // per (ZeRO, recompute): the largest micro-batch that fits
                                        // (or micro-batch 1 when none does)
};
// REQUIRES: ranks >= 1, sequences >= 1 (the global batch), seq_len >= 1.
CpuPlanResult plan_cpu_ranks(const MemoryModel& model, const Plan& shape, int64_t sequences,
                             bool sample, uint64_t budget);

}  // namespace dstrain
