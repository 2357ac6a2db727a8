// `dstrain plan`: the parallel plan for a model on a machine, and the flags that fix parts
// of a plan.
#include <iostream>
#include <optional>

#include "cli/commands.h"
#include "cli/cpu_plan_command.h"
#include "core/check.h"
#include "model/config.h"
#include "parallel/pipeline_split.h"
#include "parallel/plan_report.h"

namespace dstrain {

namespace po = boost::program_options;

po::options_description plan_flags() {
  po::options_description flags("Fix parts of the plan (the planner chooses the rest)");
  flags.add_options()
      ("dp", po::value<int>()->value_name("N"), "data-parallel ranks")
      ("tp", po::value<int>()->value_name("N"), "tensor-parallel ranks (inside an NVLink island of one node)")
      ("pp", po::value<int>()->value_name("N"), "pipeline stages")
      ("ep", po::value<int>()->value_name("N"),
       "mixture-of-experts models: the experts split over N data-parallel ranks")
      ("moe-expert-capacity-factor", po::value<double>()->value_name("F"),
       "mixture-of-experts models: an expert capacity (0: dropless), which bounds the experts' "
       "buffers")
      ("zero", po::value<int>()->value_name("STAGE"),
       "ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters")
      ("offload", po::value<std::string>()->implicit_value("optimizer")->value_name("WHAT"),
       "what lives in host memory: optimizer (fp32 master weights and Adam moments, the step on "
       "the host; a bare --offload), params (the 16-bit parameters and gradients, brought to "
       "the GPU block by block), all, none (on and off: optimizer and none). Default: the "
       "planner's choice")
      ("bf16-optimizer-states", po::bool_switch(),
       "plan with the Adam moments in bf16 (needs the optimizer offloaded)")
      ("recompute", po::value<std::string>()->value_name("MODE"), "none | selective | full")
      ("micro-batch", po::value<int64_t>()->value_name("B"), "sequences per micro-batch per rank")
      ("pp-schedule", po::value<std::string>()->value_name("KIND"), "pipeline schedule: 1f1b | gpipe")
      ("pp-split", po::value<std::string>()->value_name("N,N,..."),
       "layers per pipeline stage, e.g. 7,7,7,7 (default: balanced, counting the embedding and the head)");
  return flags;
}

po::options_description inter_node_flags(std::string& inter_node_bandwidth) {
  po::options_description flags("Across nodes");
  flags.add_options()(kInterNodeBandwidthFlag,
                      po::value(&inter_node_bandwidth)->value_name("RATE"),
                      kInterNodeBandwidthHelp);
  return flags;
}

void read_plan_flags(const po::variables_map& values, PlanRequest& request) {
  if (values.count("dp")) request.dp = values["dp"].as<int>();
  if (values.count("tp")) request.tp = values["tp"].as<int>();
  if (values.count("pp")) request.pp = values["pp"].as<int>();
  if (values.count("ep")) request.ep = values["ep"].as<int>();
  if (values.count("moe-expert-capacity-factor")) {
    request.moe_capacity_factor = values["moe-expert-capacity-factor"].as<double>();
    DSTRAIN_USER_CHECK(request.moe_capacity_factor >= 0)
        << "--moe-expert-capacity-factor must not be negative (0: dropless)";
  }
  if (values.count("zero")) request.zero = values["zero"].as<int>();
  request.bf16_optimizer_states =
      values.count("bf16-optimizer-states") && values["bf16-optimizer-states"].as<bool>();
  if (values.count("offload")) {
    Plan offload;
    set_offload(offload, values["offload"].as<std::string>());
    request.offload = offload.offload;
    request.offload_params = offload.offload_params;
  }
  if (values.count("recompute")) {
    request.recompute = parse_recompute(values["recompute"].as<std::string>());
  }
  if (values.count("micro-batch")) request.micro_batch = values["micro-batch"].as<int64_t>();
  if (values.count("pp-schedule")) {
    request.pp_schedule = parse_pipeline_schedule(values["pp-schedule"].as<std::string>());
  }
  if (values.count("pp-split")) {
    request.pp_split = parse_pipeline_split(values["pp-split"].as<std::string>());
  }
}

namespace {

// `dstrain plan --device cpu`: --gpus CPU ranks (default 1), the plan flags that fix the shape,
// the sequence length (default 64, as a CPU run's) and the global batch.
int plan_cpu(const std::string& model, const po::variables_map& values, std::ostream& out) {
  const ModelConfig config = load_model_config(model);
  CpuPlanRequest request;
  if (values.count("gpus")) request.ranks = values["gpus"].as<int>();
  if (values.count("tp")) request.tp = values["tp"].as<int>();
  if (values.count("pp")) request.pp = values["pp"].as<int>();
  if (values.count("dp")) request.ranks = values["dp"].as<int>() * request.tp * request.pp;
  request.seq_len = values.count("seq-len") ? values["seq-len"].as<int64_t>()
                                            : std::min<int64_t>(64, config.n_positions);
  DSTRAIN_USER_CHECK(request.seq_len <= config.n_positions)
      << "--seq-len " << request.seq_len << " is longer than the model's " << config.n_positions;
  const int dp = std::max(1, request.ranks / (request.tp * request.pp));
  request.global_batch_tokens = values["global-batch-tokens"].defaulted()
                                    ? 16 * request.seq_len * dp  // a CPU run's batch of 16
                                    : values["global-batch-tokens"].as<int64_t>();
  if (values.count("precision")) {
    Plan precision;
    set_precision(precision, values["precision"].as<std::string>());
    request.precision = precision.param_dtype;
    request.fp8 = precision.fp8;
  }
  return run_cpu_plan(config, request, out);
}

}  // namespace

int run_plan_command(const std::vector<std::string>& args, std::ostream& out) {
  std::string model, precision;
  int gpus = 0;
  int64_t global_batch_tokens = kDefaultGlobalBatchTokens, seq_len = 0;
  int alternatives = 8;
  int nnodes = 1;
  std::string inter_node_bandwidth;
  std::string device = "gpu";
  MachineSource source;
  po::options_description main_flags("dstrain plan");
  main_flags.add_options()
      ("model", po::value(&model)->value_name("NAME|PATH"), "preset name or path of a config.json")
      ("gpus", po::value(&gpus)->value_name("N"), "GPUs per node to plan for (default: all of the machine's)")
      ("nnodes", po::value(&nnodes)->default_value(nnodes)->value_name("N"),
       "nodes like this machine, joined by the inter-node link: tensor parallelism stays inside "
       "a node, pipeline stages and data parallelism may span nodes")
      ("global-batch-tokens", po::value(&global_batch_tokens)->default_value(global_batch_tokens)->value_name("K"),
       "tokens per optimizer step over all ranks (GPT-2's 0.5M)")
      ("seq-len", po::value(&seq_len)->value_name("T"), "tokens per sequence (default: min(1024, n_positions))")
      ("precision", po::value(&precision)->value_name("fp32|fp16|bf16|fp8"),
       "default: bf16 where the GPU has it (compute capability 8.0+), else fp16; fp8: bf16 with "
       "the layers' GEMMs on FP8 tensor cores (compute capability 8.9+)")
      ("alternatives", po::value(&alternatives)->default_value(alternatives)->value_name("N"),
       "fitting alternatives to show")
      ("device", po::value(&device)->default_value(device)->value_name("KIND"),
       "gpu: plan for the GPUs (of this machine or the one described) | cpu: for this "
       "machine's CPU ranks (--gpus of them), against the host memory this process may use")
      ("plan-json", "print the result as JSON")
      ("help,h", "this help");
  po::options_description flags;
  flags.add(main_flags).add(machine_flags(source)).add(inter_node_flags(inter_node_bandwidth))
      .add(plan_flags());
  const po::variables_map values = parse_command_flags(args, flags);
  if (values.count("help")) {
    out << "Usage: dstrain plan --model M [--gpus N] [--topology FILE | --from-nvidia-smi FILE "
           "--gpu NAME --host-memory SIZE] [--nnodes N [--inter-node-bandwidth RATE]] "
           "[--global-batch-tokens K] [--seq-len T] [--plan-json]\n"
        << "Chooses how to train M on the GPUs: data, tensor and pipeline parallelism, ZeRO "
           "stage, optimizer offload, recompute and micro-batch, by predicted memory and step "
           "time.\n"
        << "With --nnodes N the plan is for N such machines (ranks node x GPUs per node + GPU): "
           "the link between them is --inter-node-bandwidth, else read from the NICs "
           "`nvidia-smi topo -m` lists (InfiniBand/RoCE mlx5_* at an assumed 200 Gbit/s each, "
           "else 25 Gbit/s Ethernet); the report says which.\n\n"
        << flags << "\n";
    return 0;
  }
  DSTRAIN_USER_CHECK(!model.empty())
      << "dstrain plan needs --model (a preset name or the path of a config.json)";
  DSTRAIN_USER_CHECK(!values.count("gpus") || gpus >= 1) << "--gpus must be at least 1, not " << gpus;
  DSTRAIN_USER_CHECK(!values.count("seq-len") || seq_len >= 1)
      << "--seq-len must be at least 1, not " << seq_len;
  DSTRAIN_USER_CHECK(alternatives >= 0) << "--alternatives must not be negative";
  DSTRAIN_USER_CHECK(nnodes >= 1 && nnodes <= kMaxNodes)
      << "--nnodes must be between 1 and " << kMaxNodes << ", not " << nnodes;

  DSTRAIN_USER_CHECK(device == "gpu" || device == "cpu")
      << "--device must be gpu or cpu, not '" << device << "'";
  if (device == "cpu") return plan_cpu(model, values, out);

  PlanRequest request;
  request.gpus = gpus;
  request.global_batch_tokens = global_batch_tokens;
  request.seq_len = seq_len;
  request.max_alternatives = alternatives;
  if (!precision.empty()) {
    Plan words;
    set_precision(words, precision);  // a UserError naming the choices
    request.precision = words.param_dtype;
    request.fp8 = words.fp8;
  }
  read_plan_flags(values, request);

  const ModelConfig config = load_model_config(model);
  std::string report;
  const NodeTopology topology = load_machine(source, std::cin, &report);
  DSTRAIN_USER_CHECK(source.names_a_machine() || topology.gpu_count() > 0)
      << "dstrain plan found no GPU on this machine (" << report
      << "); plan this machine's CPU ranks with --device cpu, or another machine with "
         "--topology FILE, or --from-nvidia-smi FILE with --gpu NAME (and --host-memory SIZE "
         "for offload)";
  const ClusterShape cluster = make_cluster_shape(nnodes, inter_node_bandwidth, topology);
  const PlanResult result = choose_plan(config, topology, request, cluster);
  if (values.count("plan-json")) {
    out << plan_result_to_json(config, result).dump(2) << "\n";
  } else {
    out << format_plan_report(config, topology, result);
  }
  return 0;
}

}  // namespace dstrain
