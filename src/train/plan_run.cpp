#include "train/plan_run.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>

#include "core/allocator.h"
#include "parallel/machine.h"
#include "parallel/planner.h"
#include "topology/probe.h"
#include "train/devices.h"

namespace dstrain {

void plan_run(TrainOptions& options, const ModelConfig& config, std::ostream& out) {
  const bool library_call = !options.explicit_flags.has_value();
  auto given = [&](const char* flag) {
    return library_call || options.explicit_flags->count(flag);
  };
  if (options.max_gpus > 0) {
    // Testing: the ranks share at most max_gpus GPUs of this machine; the flags are the plan.
    DSTRAIN_USER_CHECK(options.tp == 1 && options.pp == 1)
        << "tensor and pipeline parallelism (--tp, --pp) are not implemented yet; use 1";
    return;
  }
  MachineSource source{options.topology_file, options.nvidia_smi_file, options.gpu_model,
                       options.host_memory};
  std::optional<NodeTopology> machine;
  std::string report;
  if (source.names_a_machine()) {
    machine = load_machine(source, std::cin, &report);
  } else if (options.device != "cpu") {
    NodeTopology local = probe_local_topology(&report);
    if (!local.gpus.empty()) machine = std::move(local);
  }
  DSTRAIN_USER_CHECK(options.device != "cuda" || (machine && !source.names_a_machine()))
      << "--device cuda: no CUDA device was found (" << report << ")";
  if (!machine) {
    if (options.device == "auto") options.device = "cpu";  // nothing found: the CPU backend
    DSTRAIN_USER_CHECK(options.tp == 1 && options.pp == 1)
        << "tensor and pipeline parallelism (--tp, --pp) are not implemented yet; use 1";
    if (options.dp > 0) {
      DSTRAIN_USER_CHECK(!given("gpus") || options.gpus == options.dp)
          << "--dp " << options.dp << " and --gpus " << options.gpus << " disagree (with "
          << "--tp 1 --pp 1, the data parallel degree is the number of ranks)";
      options.gpus = options.dp;
    }
    return;  // the CPU backend, as the flags say
  }

  PlanRequest request;
  if (given("gpus")) request.gpus = options.gpus;
  const int gpus = request.gpus > 0 ? request.gpus : static_cast<int>(machine->gpus.size());
  if (given("seq-len")) request.seq_len = options.seq_len;
  if (given("global-batch-tokens") && options.global_batch_tokens > 0) {
    request.global_batch_tokens = options.global_batch_tokens;
  } else if (given("batch") || given("grad-accum")) {
    const int64_t T =
        given("seq-len") ? options.seq_len : std::min<int64_t>(1024, config.n_positions);
    request.global_batch_tokens = options.batch * T * options.grad_accum * gpus;
  }
  if (given("precision")) request.precision = parse_dtype(options.precision);
  if (given("zero")) request.zero = options.zero;
  if (given("offload")) request.offload = options.offload;
  if (given("recompute")) request.recompute = parse_recompute(options.recompute);
  if (given("batch") || given("micro-batch")) request.micro_batch = options.batch;
  if (given("dp") && options.dp > 0) request.dp = options.dp;
  if (given("tp")) request.tp = options.tp;
  if (given("pp")) request.pp = options.pp;
  PlanResult result = choose_plan(config, *machine, request);
  if (result.best.plan.tp > 1 || result.best.plan.pp > 1) {
    // This build runs data parallelism and ZeRO only: say what would be best, take the best
    // plan without tensor and pipeline parallelism.
    DSTRAIN_USER_CHECK(!given("tp") && !given("pp"))
        << "tensor and pipeline parallelism (--tp, --pp) are not implemented yet; use 1";
    out << "the best plan for this machine, " << describe(result.best.plan) << ", uses "
        << (result.best.plan.pp > 1 ? "pipeline" : "tensor")
        << " parallelism, which this build cannot run yet; planning without it\n";
    request.tp = 1;
    request.pp = 1;
    result = choose_plan(config, *machine, request);
  }
  const Plan& plan = result.best.plan;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.3g", result.best.cost.step_seconds);
  out << "plan for " << gpus << " x " << result.machine << ": " << describe(plan)
      << "\n  predicted " << format_bytes(result.best.memory.device_total()) << " per GPU, "
      << seconds << " s per step there (`dstrain plan` shows the alternatives)\n";
  if (options.device != "cpu") {
    // The GPUs found here run the plan; a described machine is not this one.
    DSTRAIN_USER_CHECK(!source.names_a_machine())
        << "the machine described (--topology, --from-nvidia-smi, --gpu) is not this one: run "
        << "its plan on simulated ranks with --device cpu";
    DSTRAIN_USER_CHECK(cuda_backend_built())
        << "this dstrain was built without the CUDA backend (DSTRAIN_CUDA=OFF): rebuild it with "
        << "the CUDA toolkit to train on the GPUs found, or run the plan on simulated ranks with "
        << "--device cpu";
    const int usable = usable_cuda_devices();
    DSTRAIN_USER_CHECK(usable >= plan.dp)
        << "the plan needs " << plan.dp << " GPUs, but the CUDA runtime can use " << usable
        << " here (check the driver and CUDA_VISIBLE_DEVICES), or run the plan on simulated "
        << "ranks with --device cpu";
    options.device = "cuda";
  }
  options.gpus = plan.dp;
  options.zero = plan.zero;
  options.offload = plan.offload;
  options.recompute = recompute_name(plan.recompute);
  options.batch = plan.micro_batch;
  options.grad_accum = plan.grad_accum;
  options.seq_len = plan.seq_len;
  options.precision = precision_name(plan.param_dtype);
}

}  // namespace dstrain
