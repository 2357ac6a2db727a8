#include "train/plan_run.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>

#include "core/allocator.h"
#include "parallel/cpu_plan.h"
#include "parallel/machine.h"
#include "parallel/pipeline_split.h"
#include "parallel/planner.h"
#include "topology/cluster.h"
#include "topology/host_memory.h"
#include "topology/probe.h"
#include "train/devices.h"

namespace dstrain {

namespace {

// --batch-tokens N: micro-batches planned as ceil(N / T) rows of T (a micro-batch of narrower
// rows holds more of them in the same positions).
int64_t batch_tokens_rows(const TrainOptions& options, int64_t seq_len) {
  return (options.batch_tokens + seq_len - 1) / seq_len;
}

// `gpus`: the world's (every node's); the request's are one node's.
PlanRequest request_from_flags(const TrainOptions& options, const ModelConfig& config, int gpus) {
  PlanRequest request;
  if (given_flag(options, "gpus")) request.gpus = options.gpus / options.rendezvous.nnodes;
  if (given_flag(options, "seq-len")) request.seq_len = options.seq_len;
  if (given_flag(options, "global-batch-tokens") && options.global_batch_tokens > 0) {
    request.global_batch_tokens = options.global_batch_tokens;
    request.exact_global_batch = options.exact_global_batch;
  } else if (given_flag(options, "batch") || given_flag(options, "grad-accum")) {
    const int64_t T =
        given_flag(options, "seq-len") ? options.seq_len : std::min<int64_t>(1024, config.n_positions);
    const int dp = std::max(1, gpus / (options.tp * options.pp));
    const int64_t B = options.batch_tokens > 0 ? batch_tokens_rows(options, T) : options.batch;
    request.global_batch_tokens = B * T * options.grad_accum * dp;
  }
  if (given_flag(options, "precision")) {
    Plan precision;
    set_precision(precision, options.precision);
    request.precision = precision.param_dtype;
    request.fp8 = precision.fp8;
  }
  if (given_flag(options, "zero")) request.zero = options.zero;
  if (given_flag(options, "offload")) {
    request.offload = options.offload;
    request.offload_params = options.offload_params;
  }
  request.bf16_optimizer_states = options.bf16_optimizer_states;
  if (given_flag(options, "recompute")) request.recompute = parse_recompute(options.recompute);
  if (given_flag(options, "batch") || given_flag(options, "micro-batch")) request.micro_batch = options.batch;
  if (options.batch_tokens > 0) {
    const int64_t T =
        given_flag(options, "seq-len") ? options.seq_len : std::min<int64_t>(1024, config.n_positions);
    request.micro_batch = batch_tokens_rows(options, T);
  }
  if (given_flag(options, "dp") && options.dp > 0) request.dp = options.dp;
  if (given_flag(options, "tp")) request.tp = options.tp;
  if (given_flag(options, "ep")) request.ep = options.ep;
  request.moe_capacity_factor = options.moe_capacity_factor;
  if (given_flag(options, "sequence-parallel")) request.sequence_parallel = options.sequence_parallel;
  if (given_flag(options, "pp")) request.pp = options.pp;
  if (given_flag(options, "pp-schedule")) request.pp_schedule = parse_pipeline_schedule(options.pp_schedule);
  if (given_flag(options, "pp-split") && !options.pp_split.empty()) {
    request.pp_split = parse_pipeline_split(options.pp_split);
  }
  return request;
}

// A Hugging Face model (its config.json or --init-from weights) without --seq-len: fine-tuning
// trains at the model's context, as far as it fits.
bool seq_len_from_model(const TrainOptions& options) {
  if (given_flag(options, "seq-len")) return false;
  const std::vector<std::string> presets = model_preset_names();
  const bool preset =
      std::find(presets.begin(), presets.end(), options.model) != presets.end() ||
      options.model.empty();
  return !preset || !options.init_from.empty();
}

// The sequence lengths to try for such a model: its context, then halving to a power of two
// and down to 64.
std::vector<int64_t> context_lengths(const ModelConfig& config) {
  std::vector<int64_t> lengths{config.n_positions};
  int64_t power = 1;
  while (power * 2 < config.n_positions) power *= 2;
  for (int64_t t = power; t >= 64 && t < config.n_positions; t /= 2) lengths.push_back(t);
  return lengths;
}

void say_seq_len(const ModelConfig& config, int64_t seq_len, const char* where,
                 std::ostream& out) {
  out << "dstrain: --seq-len " << seq_len;
  if (seq_len == config.n_positions) {
    out << " (the model's context)\n";
  } else {
    out << ": the model's context of " << config.n_positions << " tokens does not fit " << where
        << "; " << seq_len << " is the longest power of two that does (give --seq-len to choose)\n";
  }
}

// The planner's result for `machine`; a Hugging Face model's context tried first.
PlanResult plan_with_context(TrainOptions& options, const ModelConfig& config,
                             const NodeTopology& machine, const PlanRequest& request,
                             const ClusterShape& cluster, std::ostream& out) {
  if (!seq_len_from_model(options)) return choose_plan(config, machine, request, cluster);
  const std::vector<int64_t> lengths = context_lengths(config);
  for (size_t i = 0; i < lengths.size(); ++i) {
    PlanRequest at = request;
    at.seq_len = lengths[i];
    if (options.batch_tokens > 0) at.micro_batch = batch_tokens_rows(options, at.seq_len);
    if (!given_flag(options, "global-batch-tokens") &&
        (given_flag(options, "batch") || given_flag(options, "grad-accum"))) {
      // The sequences asked for, at this length (request_from_flags counted them at 1024);
      // with --batch-tokens, the micro-batches asked for of this length's rows.
      const int64_t T0 = std::min<int64_t>(1024, config.n_positions);
      at.global_batch_tokens =
          options.batch_tokens > 0
              ? request.global_batch_tokens / (batch_tokens_rows(options, T0) * T0) *
                    batch_tokens_rows(options, at.seq_len) * at.seq_len
              : request.global_batch_tokens / T0 * at.seq_len;
    } else if (at.global_batch_tokens % at.seq_len != 0) {
      at.global_batch_tokens = (at.global_batch_tokens / at.seq_len + 1) * at.seq_len;
    }
    try {
      PlanResult result = choose_plan(config, machine, at, cluster);
      say_seq_len(config, lengths[i], "the GPUs' memory", out);
      return result;
    } catch (const UserError&) {
      if (i + 1 == lengths.size()) throw;  // the shortest fails too: its sentence
    }
  }
  return choose_plan(config, machine, request, cluster);
}

// The planner's plan for `machine`.
Plan plan_for_machine(TrainOptions& options, const ModelConfig& config,
                      const NodeTopology& machine, std::ostream& out) {
  const int nnodes = options.rendezvous.nnodes;
  PlanRequest request =
      request_from_flags(options, config, static_cast<int>(machine.gpus.size()) * nnodes);
  const int gpus =
      (request.gpus > 0 ? request.gpus : static_cast<int>(machine.gpus.size())) * nnodes;
  const ClusterShape cluster = make_cluster_shape(nnodes, options.inter_node_bandwidth, machine);
  const PlanResult result = plan_with_context(options, config, machine, request, cluster, out);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.3g", result.best.cost.step_seconds);
  if (cluster.multi_node()) out << "cluster: " << describe_cluster(cluster, gpus / nnodes) << "\n";
  out << "plan for " << gpus << " x " << result.machine << ": " << describe(result.best.plan)
      << "\n  predicted " << format_bytes(result.best.memory.device_total()) << " per GPU, "
      << seconds << " s per step there (`dstrain plan` shows the alternatives)\n";
  return result.best.plan;
}

// CPU ranks: the plan the flags give, at a Hugging Face model's context as far as it fits this
// process's memory, checked against that memory before anything is allocated.
Plan plan_for_cpu_ranks(TrainOptions& options, const ModelConfig& config, std::ostream& out) {
  const MemoryModel model(config);
  const HostMemoryBudget budget = available_host_memory();
  const bool sample = options.sample_tokens > 0;
  if (seq_len_from_model(options)) {
    const std::vector<int64_t> lengths = context_lengths(config);
    for (size_t i = 0; i < lengths.size(); ++i) {
      options.seq_len = lengths[i];
      const Plan plan = plan_from_options(options, config);
      if (i + 1 == lengths.size() || budget.limited_by.empty() ||
          cpu_run_bytes(model, plan, sample).total() <= budget.bytes) {
        say_seq_len(config, lengths[i], "this machine's memory on CPU ranks", out);
        break;
      }
    }
  }
  return plan_from_options(options, config);
}

// Offloaded state lives in pinned (page-locked) host memory. Where this process's locked-memory
// limit (ulimit -l) is below this node's share, say so before anything is allocated: some
// drivers and container runtimes count CUDA's pinned allocations against it, others do not (so
// this is a notice, not a refusal; if the allocation does fail, its error names the limit).
void say_locked_memory_limit(const ModelConfig& config, const Plan& plan, int gpus_per_node,
                             std::ostream& out) {
  if (!plan.offload && !plan.offload_params) return;
  const std::optional<uint64_t> limit = locked_memory_limit();
  if (!limit) return;
  const MemoryModel model(config);
  std::vector<double> per_stage;
  for (int s = 0; s < plan.pp; ++s) {
    per_stage.push_back(static_cast<double>(model.predict_stage(plan, s).host_total()));
  }
  const auto needed =
      static_cast<uint64_t>(fullest_node_total(plan, std::max(1, gpus_per_node), per_stage));
  if (needed <= *limit) return;
  out << "note: the plan keeps " << format_bytes(needed)
      << " of offloaded state in pinned host memory on this node, above this process's "
         "locked-memory limit of "
      << format_bytes(*limit)
      << " (ulimit -l); if pinning fails, raise it (ulimit -l unlimited; in a container, docker "
         "run --ulimit memlock=-1, as NVIDIA's containers recommend)\n";
}

// The GPUs found here run the plan: this build and this machine must be able to.
void check_runs_here(const Plan& plan, const MachineSource& source, int nnodes) {
  DSTRAIN_USER_CHECK(!source.names_a_machine())
      << "the machine described (--topology, --from-nvidia-smi, --gpu) is not this one: run "
      << "its plan on simulated ranks with --device cpu";
  DSTRAIN_USER_CHECK(cuda_backend_built())
      << "this dstrain was built without the CUDA backend (DSTRAIN_CUDA=OFF): rebuild it with "
      << "the CUDA toolkit to train on the GPUs found, or run the plan on simulated ranks with "
      << "--device cpu";
  const int usable = usable_cuda_devices();
  DSTRAIN_USER_CHECK(usable >= plan.world() / nnodes)
      << "the plan needs " << plan.world() / nnodes << " GPUs"
      << (nnodes > 1 ? " on each node" : "") << ", but the CUDA runtime can use " << usable
      << " here (check the driver and CUDA_VISIBLE_DEVICES), or run the plan on simulated "
      << "ranks with --device cpu";
}

// Tensor parallelism's requirements: the model splits over tp ranks, and under sequence
// parallelism so do the token rows of a micro-batch.
void check_tensor_parallel(const ModelConfig& config, const Plan& plan) {
  const std::string reason = tp_unsupported_reason(config, plan.tp);
  DSTRAIN_USER_CHECK(reason.empty()) << "--tp " << plan.tp << ": " << reason;
  DSTRAIN_USER_CHECK(!plan.uses_sequence_parallel() || plan.micro_batch * plan.seq_len % plan.tp == 0)
      << "--tp " << plan.tp << " with sequence parallelism splits each micro-batch's "
      << plan.micro_batch << " x " << plan.seq_len << " tokens over " << plan.tp
      << " ranks: make --batch x --seq-len a multiple of " << plan.tp
      << ", or turn it off with --sequence-parallel false";
}

// The mixture-of-experts requirements: for expert parallelism a model whose experts split
// evenly, over ranks that divide the data-parallel group.
void check_mixture_of_experts(const ModelConfig& config, const Plan& plan) {
  const std::string reason = ep_unsupported_reason(config, plan.ep);
  DSTRAIN_USER_CHECK(reason.empty()) << "--ep " << plan.ep << ": " << reason;
  DSTRAIN_USER_CHECK(plan.dp % plan.ep == 0)
      << "--ep " << plan.ep << " splits the experts over data-parallel ranks, but the plan has "
      << plan.dp << " (dp = --gpus / (tp x pp)): ep must divide it";
}

// --precision fp8: the FP8 GEMMs take sides that are multiples of 16 (model/fp8_linear.h), the
// micro-batch's tokens among them: otherwise no projection would run in FP8.
void check_fp8(const Plan& plan) {
  DSTRAIN_USER_CHECK(!plan.fp8 || plan.micro_batch * plan.seq_len % 16 == 0)
      << "--precision fp8 runs the projections on FP8 tensor cores, whose GEMMs take multiples "
         "of 16: make a micro-batch's tokens (--batch "
      << plan.micro_batch << " x --seq-len " << plan.seq_len << ") a multiple of 16";
}

}  // namespace

Plan plan_from_options(const TrainOptions& options, const ModelConfig& config) {
  Plan plan;
  plan.tp = options.tp;
  plan.pp = options.pp;
  DSTRAIN_USER_CHECK(plan.pp <= config.n_layer)
      << "--pp " << plan.pp << " is more pipeline stages than the model's " << config.n_layer
      << " layers (stages cut at layer boundaries)";
  const int model_ranks = plan.tp * plan.pp;  // the ranks of one model replica
  int gpus = options.gpus;
  if (options.dp > 0) {
    DSTRAIN_USER_CHECK(!given_flag(options, "gpus") || options.gpus == options.dp * model_ranks)
        << "--dp " << options.dp << " x --tp " << plan.tp << " x --pp " << plan.pp << " is "
        << options.dp * model_ranks << " ranks, but --gpus is " << options.gpus
        << " (--gpus = dp x tp x pp)";
    gpus = options.dp * model_ranks;
  } else if (!given_flag(options, "gpus") && gpus < model_ranks) {
    gpus = model_ranks;  // --tp / --pp alone: one replica
  }
  DSTRAIN_USER_CHECK(gpus % model_ranks == 0)
      << "--gpus " << gpus << " ranks cannot be cut into " << plan.pp
      << " pipeline stages (--pp)"
      << (plan.tp > 1 ? " of " + std::to_string(plan.tp) + " tensor-parallel ranks (--tp)" : "")
      << " of equal data-parallel ranks";
  plan.dp = gpus / model_ranks;
  const int nnodes = options.rendezvous.nnodes;
  DSTRAIN_USER_CHECK(nnodes == 1 || (gpus % nnodes == 0 && (gpus / nnodes) % plan.tp == 0))
      << "--tp " << plan.tp << " would put one tensor-parallel group on two nodes: tp must divide "
      << "the ranks of a node (--gpus " << gpus / nnodes << ")";
  plan.zero = options.zero;
  plan.offload = options.offload;
  plan.offload_params = options.offload_params;
  plan.bf16_optimizer_states = options.bf16_optimizer_states;
  DSTRAIN_USER_CHECK(!plan.bf16_optimizer_states || plan.offload) << kBf16StatesNeedOffload;
  plan.recompute = parse_recompute(options.recompute);
  plan.micro_batch =
      options.batch_tokens > 0 ? batch_tokens_rows(options, options.seq_len) : options.batch;
  plan.grad_accum = options.grad_accum;
  plan.seq_len = options.seq_len;
  set_precision(plan, options.precision);
  plan.sequence_parallel = options.sequence_parallel;
  check_tensor_parallel(config, plan);
  plan.ep = options.ep;
  plan.moe_capacity_factor = options.moe_capacity_factor;
  check_mixture_of_experts(config, plan);
  plan.pp_schedule = parse_pipeline_schedule(options.pp_schedule);
  if (!options.pp_split.empty()) plan.pp_split = parse_pipeline_split(options.pp_split);
  plan.pp_split = pipeline_split(config, plan);  // checks a given one, balances otherwise
  return plan;
}

void remember_plan(const Plan& plan, TrainOptions& options) {
  options.gpus = plan.world();
  options.dp = plan.dp;
  options.tp = plan.tp;
  options.ep = plan.ep;
  options.moe_capacity_factor = plan.moe_capacity_factor;
  options.pp = plan.pp;
  options.zero = plan.zero;
  options.offload = plan.offload;
  options.offload_params = plan.offload_params;
  options.bf16_optimizer_states = plan.bf16_optimizer_states;
  options.recompute = recompute_name(plan.recompute);
  options.batch = plan.micro_batch;
  options.grad_accum = plan.grad_accum;
  options.seq_len = plan.seq_len;
  options.precision = precision_name(plan);
  options.pp_schedule = pipeline_schedule_name(plan.pp_schedule);
  options.pp_split = plan.pp > 1 ? pipeline_split_text(plan.pp_split) : "";
  options.sequence_parallel = plan.sequence_parallel;
}

RunMachine find_run_machine(const TrainOptions& options) {
  RunMachine machine;
  if (options.test.max_gpus > 0) return machine;  // testing: the flags are the plan
  MachineSource source{options.topology_file, options.nvidia_smi_file, options.gpu_model,
                       options.host_memory, options.gpu_memory};
  if (source.names_a_machine()) {
    machine.topology = load_machine(source, std::cin, &machine.report);
    machine.described = true;
  } else if (options.device != "cpu") {
    NodeTopology local = probe_local_topology(&machine.report);
    if (!options.gpu_memory.empty()) apply_gpu_memory(local, options.gpu_memory, true);
    if (!local.gpus.empty()) machine.topology = std::move(local);
  }
  DSTRAIN_USER_CHECK(options.device != "cuda" || (machine.topology && !machine.described))
      << "--device cuda: no CUDA device was found (" << machine.report << ")";
  return machine;
}

nlohmann::json machine_record(const RunMachine& machine, bool cpu_ranks, int ranks, int nnodes) {
  nlohmann::json record{{"device", cpu_ranks ? "cpu" : "gpu"}, {"ranks", ranks}, {"nnodes", nnodes}};
  if (machine.topology && !machine.topology->gpus.empty()) {
    record["gpu"] = machine.topology->gpus[0].name;
    record["gpu_memory"] = machine.topology->gpus[0].memory_bytes;
  }
  return record;
}

// --batch-tokens against the plan: a whole row of T fits, and --batch (if given) agrees.
static void check_batch_tokens(const TrainOptions& options, const Plan& plan) {
  if (options.batch_tokens == 0) return;
  DSTRAIN_USER_CHECK(options.batch_tokens >= plan.seq_len)
      << "--batch-tokens " << options.batch_tokens << " is below --seq-len " << plan.seq_len
      << ": a conversation as long as a row would fit no micro-batch; give at least "
      << plan.seq_len;
  // (A library caller's batch field is not a flag it gave: the budget decides.)
  const bool batch_given = options.explicit_flags.has_value() &&
                           (options.explicit_flags->count("batch") != 0 ||
                            options.explicit_flags->count("micro-batch") != 0);
  DSTRAIN_USER_CHECK(!batch_given || options.batch == plan.micro_batch)
      << "--batch-tokens " << options.batch_tokens << " plans micro-batches of "
      << plan.micro_batch << " rows of " << plan.seq_len << ", and --batch says "
      << options.batch << ": give one of them";
}

// The plan of a run before the options remember it (plan_run).
static Plan choose_run_plan(TrainOptions& options, const ModelConfig& config,
                            const RunMachine& machine, std::ostream& out) {
  if (options.test.max_gpus > 0) {
    // Testing: the ranks share at most max_gpus GPUs of this machine; the flags are the plan.
    return plan_from_options(options, config);
  }
  if (!machine.topology) {
    if (options.device == "auto") options.device = "cpu";  // nothing found: the CPU backend
    return plan_for_cpu_ranks(options, config, out);
  }
  Plan plan = plan_for_machine(options, config, *machine.topology, out);  // its split filled in
  if (options.device != "cpu") {
    MachineSource source{options.topology_file, options.nvidia_smi_file, options.gpu_model,
                         options.host_memory, options.gpu_memory};
    check_runs_here(plan, source, options.rendezvous.nnodes);
    say_locked_memory_limit(config, plan, options.gpus / options.rendezvous.nnodes, out);
    options.device = "cuda";
  }
  return plan;
}

Plan plan_run(TrainOptions& options, const ModelConfig& config, const RunMachine& machine,
              std::ostream& out) {
  Plan plan = choose_run_plan(options, config, machine, out);
  check_batch_tokens(options, plan);
  check_fp8(plan);
  remember_plan(plan, options);
  return plan;
}

Plan plan_run(TrainOptions& options, const ModelConfig& config, std::ostream& out) {
  return plan_run(options, config, find_run_machine(options), out);
}

}  // namespace dstrain
