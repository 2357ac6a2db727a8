#include "parallel/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "core/format.h"
#include "parallel/pipeline_split.h"

namespace dstrain {

namespace {

std::string seconds_text(double seconds) {
  char text[32];
  if (seconds >= 100)
    std::snprintf(text, sizeof text, "%.0f s", seconds);
  else if (seconds >= 0.1)
    std::snprintf(text, sizeof text, "%.2f s", seconds);
  else
    std::snprintf(text, sizeof text, "%.1f ms", seconds * 1e3);
  return text;
}

std::string padded(std::string text, size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

// "compute 34.86 s (GEMMs 30.12 s, attention 2.50 s, memory-bound 2.24 s), pipeline bubble
// 0.83 s, ...": the non-zero parts.
std::string breakdown_text(const StepCost& c) {
  std::ostringstream text;
  const std::string compute_parts = " (GEMMs " + seconds_text(c.gemm_seconds) + ", attention " +
                                    seconds_text(c.attention_seconds) + ", memory-bound " +
                                    seconds_text(c.memory_bound_seconds) + ")";
  const std::pair<const char*, double> parts[] = {
      {"compute", c.compute_seconds},
      {"pipeline bubble", c.bubble_seconds},
      {"tensor-parallel collectives", c.tp_comm_seconds},
      {"expert-parallel all-to-alls", c.ep_comm_seconds},
      {"pipeline sends", c.pp_comm_seconds},
      {"data-parallel collectives not hidden", c.dp_comm_seconds},
      {"offload transfers and host optimizer", c.offload_seconds},
      {"optimizer", c.optimizer_seconds}};
  bool first = true;
  for (const auto& [name, seconds] : parts) {
    if (seconds <= 0) continue;
    text << (first ? "" : ", ") << name << " " << seconds_text(seconds);
    if (std::string_view(name) == "compute") text << compute_parts;
    first = false;
  }
  return text.str();
}

// "  GEMMs at 74% of 165 TFLOP/s bf16 peak; attention on tensor cores at 83 / 71 TFLOP/s ...".
std::string compute_rates_text(const ComputeRates& r, const Plan& plan) {
  std::ostringstream out;
  out.precision(0);
  out << std::fixed << "  GEMMs at " << r.gemm_efficiency * 100 << "% of "
      << r.gemm_peak_flops / 1e12 << " TFLOP/s " << precision_name(plan.param_dtype)
      << (plan.param_dtype == DType::F32 ? " (CUDA cores)" : "") << " peak";
  if (plan.fp8) {
    out << ", the layers' in FP8 at " << r.fp8_gemm_flops / 1e12 << " TFLOP/s";
  }
  out << "; attention on "
      << (r.attention == AttentionKernels::TensorCore ? "tensor cores" : "CUDA cores") << " at "
      << r.attention_forward_flops / 1e12 << " / " << r.attention_backward_flops / 1e12
      << " TFLOP/s forward / backward (causal tiles skipped); memory-bound kernels at "
      << r.memory_bytes_per_s / 1e9 << " GB/s (estimates: cost_model.cpp)\n";
  return out.str();
}

// "  cluster: ..." and where the chosen plan's groups sit, for a plan across nodes.
std::string cluster_text(const PlanResult& result) {
  const Plan& plan = result.best.plan;
  const int per_node = result.gpus_per_node;
  std::ostringstream out;
  out << "  cluster: " << describe_cluster(result.cluster, per_node) << "\n";
  out << "  across nodes: rank = node x " << per_node
      << " + GPU; tensor parallelism stays inside a node (it all-reduces activations in every "
         "layer: tp divides the "
      << per_node << " GPUs per node); pipeline stages and data parallelism may span nodes, "
      << "their traffic at the inter-node link\n";
  const int stage_ranks = plan.dp * plan.tp;
  bool dp_spans = false;  // the first and the last member of some data-parallel group
  for (int s = 0; s < plan.pp && plan.dp > 1; ++s) {
    for (int t = 0; t < plan.tp; ++t) {
      const int first = s * stage_ranks + t, last = first + (plan.dp - 1) * plan.tp;
      dp_spans |= first / per_node != last / per_node;
    }
  }
  out << "  placement: data-parallel groups " << (dp_spans ? "span nodes" : "stay inside a node");
  if (plan.pp > 1) {
    out << "; pipeline stage";
    for (int s = 0; s < plan.pp && s < 8; ++s) {
      const int first = s * stage_ranks / per_node, last = ((s + 1) * stage_ranks - 1) / per_node;
      out << (s ? ", " : " ") << s << " on node " << first;
      if (last != first) out << "-" << last;
    }
    if (plan.pp > 8) out << ", ...";
  }
  out << "\n";
  return out.str();
}

}  // namespace

std::string format_plan_report(const ModelConfig& config, const NodeTopology& topology,
                               const PlanResult& result) {
  const PlanCandidate& best = result.best;
  const Plan& plan = best.plan;
  const int gpus = plan.world();
  std::ostringstream out;
  out.precision(2);
  out << std::fixed;
  out << "dstrain plan: " << config.name << " (" << model_type_name(config.type) << ", "
      << config.num_parameters() / 1e9 << "B parameters: " << config.n_layer << " layers, width "
      << config.n_embd << ", " << config.n_head << " heads";
  if (config.kv_heads() != config.n_head) out << " (" << config.kv_heads() << " key/value)";
  out << ") on " << gpus << " x " << result.machine << "\n";
  out << (result.cluster.multi_node() ? "  each node: " : "  machine: ") << result.wiring << " Host memory "
      << (result.host_memory_bytes ? format_bytes(result.host_memory_bytes) : "unknown") << ".\n";
  if (result.cluster.multi_node()) out << cluster_text(result);
  out << "  global batch: " << plan.tokens_per_step()
      << " tokens = " << plan.dp * plan.micro_batch * plan.grad_accum << " sequences of "
      << plan.seq_len << " tokens\n\n";

  out << "plan: " << describe(plan) << "\n";
  if (plan.pp > 1) {
    out << "  pipeline: " << plan.pp << " stages of " << pipeline_split_text(plan.pp_split)
        << " layers (the embedding with the first, the LM head with the last), "
        << pipeline_schedule_name(plan.pp_schedule) << ": up to "
        << activation_slots(plan.pp_schedule, plan.pp, 0, static_cast<int>(plan.grad_accum))
        << " micro-batches in flight on the first stage\n";
  }
  out << "\n";

  out << "memory per GPU";
  if (plan.pp > 1) {
    out << " (pipeline stage " << best.memory.stage << ", the fullest of " << plan.pp << ")";
  }
  out << ":\n";
  std::vector<MemoryItem> items = best.memory.items;
  std::stable_sort(items.begin(), items.end(), [](const MemoryItem& a, const MemoryItem& b) {
    return std::make_pair(a.host, a.category) < std::make_pair(b.host, b.category);
  });
  constexpr size_t kWidth = 56;
  for (const MemoryItem& item : items) {
    if (item.host) continue;
    out << "  " << padded(item.what, kWidth) << format_bytes(item.bytes) << "\n";
  }
  out << "  " << padded("total", kWidth) << format_bytes(best.memory.device_total()) << " of "
      << format_bytes(result.usable_device_bytes) << " usable ("
      << format_bytes(result.gpu_memory_bytes) << " less 10% and 1 GiB)\n";
  if (plan.recompute != Recompute::None) {
    out << "  (" << recompute_name(plan.recompute) << " recompute: the activations would take "
        << format_bytes(best.memory.activations_without_recompute) << " without it)\n";
  }
  if (best.memory.host_total() > 0) {
    out << "host memory per rank:\n";
    for (const MemoryItem& item : items) {
      if (!item.host) continue;
      out << "  " << padded(item.what, kWidth) << format_bytes(item.bytes) << "\n";
    }
    const std::string ranks =
        result.cluster.multi_node()
            ? "the " + std::to_string(result.gpus_per_node) + " ranks of the fullest node"
            : "all " + std::to_string(gpus) + " ranks";
    out << "  " << padded(ranks, kWidth)
        << format_bytes(best.host_bytes) << " of " << format_bytes(result.usable_host_bytes)
        << " usable (" << format_bytes(result.host_memory_bytes) << " less 20% and 8 GiB)\n";
  }
  out << "\n";

  const StepCost& c = best.cost;
  out << "step: " << seconds_text(c.step_seconds) << " predicted, "
      << format_rate(c.tokens_per_second) << " tokens/s\n";
  out << "  " << breakdown_text(c) << "\n";
  out.precision(0);
  const GpuSpeed speed = gpu_speed(topology, plan.param_dtype);
  out << compute_rates_text(c.rates, plan);
  if (!speed.estimate_note.empty()) out << "  note: " << speed.estimate_note << "\n";
  const std::pair<const char*, const std::string*> routes[] = {{"tensor parallel", &c.tp_route},
                                                               {"expert parallel", &c.ep_route},
                                                               {"data parallel", &c.dp_route},
                                                               {"pipeline", &c.pp_route},
                                                               {"host", &c.host_route}};
  for (const auto& [name, route] : routes) {
    if (!route->empty()) out << "  slowest " << name << " link: " << *route << "\n";
  }
  if (!result.ep_choice.empty()) out << result.ep_choice << "\n";
  if (!result.offload_choice.empty()) out << result.offload_choice << "\n";

  if (!result.alternatives.empty()) {
    out << "\nalternatives (the best of each other shape):\n";
    for (const PlanCandidate& a : result.alternatives) {
      out << "  " << describe(a.plan) << "\n      " << a.verdict << "\n";
    }
  }
  if (!result.excluded.empty()) {
    out << "\nnot possible here:\n";
    for (const std::string& why : result.excluded) out << "  " << why << "\n";
  }
  return out.str();
}

nlohmann::json plan_result_to_json(const ModelConfig& config, const PlanResult& result) {
  auto candidate_json = [](const PlanCandidate& c) {
    nlohmann::json j = to_json(c.plan);
    j["fits"] = c.fits();
    j["memory_bytes_per_gpu"] = c.memory.device_total();
    j["host_memory_bytes"] = c.host_bytes;
    j["step_seconds"] = c.cost.step_seconds;
    j["tokens_per_second"] = c.cost.tokens_per_second;
    return j;
  };
  const PlanCandidate& best = result.best;
  nlohmann::json j = candidate_json(best);
  j["model"] = config.name;
  j["gpus"] = best.plan.world();
  j["global_batch_tokens"] = best.plan.tokens_per_step();
  j["usable_memory_bytes_per_gpu"] = result.usable_device_bytes;
  j["gpu_memory_bytes"] = result.gpu_memory_bytes;
  j["pipeline_stage"] = best.memory.stage;
  nlohmann::json device = nlohmann::json::object(), host = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c) {
    const char* name = mem_category_name(static_cast<MemCategory>(c));
    if (best.memory.device[static_cast<size_t>(c)])
      device[name] = best.memory.device[static_cast<size_t>(c)];
    if (best.memory.host[static_cast<size_t>(c)])
      host[name] = best.memory.host[static_cast<size_t>(c)];
  }
  j["memory_by_category"] = device;
  j["host_memory_by_category_per_rank"] = host;
  j["activations_bytes_without_recompute"] = best.memory.activations_without_recompute;
  const StepCost& c = best.cost;
  j["step_breakdown"] = {
      {"compute", c.compute_seconds},     {"gemm", c.gemm_seconds},
      {"attention", c.attention_seconds}, {"memory_bound", c.memory_bound_seconds},
      {"bubble", c.bubble_seconds},       {"tp_comm", c.tp_comm_seconds},
      {"ep_comm", c.ep_comm_seconds},     {"pp_comm", c.pp_comm_seconds},
      {"dp_comm", c.dp_comm_seconds},     {"offload", c.offload_seconds},
      {"optimizer", c.optimizer_seconds}, {"gemm_efficiency", c.efficiency}};
  j["alternatives"] = nlohmann::json::array();
  for (const PlanCandidate& a : result.alternatives) {
    nlohmann::json alternative = candidate_json(a);
    alternative["why"] = a.verdict;
    j["alternatives"].push_back(alternative);
  }
  j["excluded"] = result.excluded;
  if (!result.ep_choice.empty()) j["ep_choice"] = result.ep_choice;
  if (!result.offload_choice.empty()) j["offload_choice"] = result.offload_choice;
  j["candidates_evaluated"] = result.candidates;
  j["nnodes"] = result.cluster.nnodes;
  j["gpus_per_node"] = result.gpus_per_node;
  if (result.cluster.multi_node()) {
    j["inter_node"] = {{"bytes_per_s", result.cluster.inter_node_bytes_per_s},
                       {"kind", network_kind_name(result.cluster.inter_node_kind)},
                       {"source", result.cluster.inter_node_source},
                       {"tensor_parallel", "inside a node: tp divides the GPUs per node"}};
  }
  return j;
}

}  // namespace dstrain
