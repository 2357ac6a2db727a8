#include "parallel/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include "core/check.h"
#include "parallel/pipeline_split.h"
#include "topology/gpu_table.h"

namespace dstrain {

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Device headroom. ASSUMPTION: 10% of the GPU's memory for what the model does not count:
// the caching allocator's fragmentation and rounding, cuBLAS and NCCL workspaces that grow
// with streams and channels, kernels' temporary buffers. Plus a fixed 1 GiB for the CUDA
// context (the driver reserves ~300-600 MiB per process on Ampere/Ada/Hopper, more with
// eager module loading), the cuBLAS handle and NCCL's communicator buffers (NCCL_BUFFSIZE
// 4 MiB per channel and peer). On a datasheet "24 GB" RTX 4090 this leaves 20.6 GiB.
constexpr double kDeviceHeadroomFraction = 0.10;
constexpr uint64_t kDeviceReserveBytes = 1 * kGiB;
// Host headroom. ASSUMPTION: pinned memory cannot be swapped or reclaimed, so keep 20% of RAM
// and 8 GiB for the OS, the page cache of the token files, the data loader and the process.
constexpr double kHostHeadroomFraction = 0.20;
constexpr uint64_t kHostReserveBytes = 8 * kGiB;
// A plan may overshoot the requested global batch by up to 1/16 (6.25%) when dp x micro-batch
// does not divide it (6 GPUs and 512 sequences: 516).
constexpr int64_t kOvershootDenominator = 16;
// Non-fitting shapes predicted faster than the chosen plan that the alternatives show.
constexpr int kMaxFasterNonFitting = 3;
// ASSUMPTION: plans predicted within 2% of the fastest are a tie the cost model cannot
// resolve (its efficiency curve and bandwidths are estimates): among them the planner takes
// the one with the fewest moving parts (simplicity() below).
constexpr double kTieMargin = 0.02;
// The expert capacity factor a dropless mixture-of-experts model that fits no plan is offered
// (GShard's and Switch Transformer's 1.25): the planner never drops tokens unasked.
constexpr double kHintCapacityFactor = 1.25;

uint64_t usable(uint64_t total, double fraction, uint64_t reserve) {
  const double left = static_cast<double>(total) * (1.0 - fraction) - static_cast<double>(reserve);
  return left > 0 ? static_cast<uint64_t>(left) : 0;
}

// The first `n` GPUs of a topology, with their links.
NodeTopology first_gpus(const NodeTopology& topology, int n) {
  NodeTopology sub = make_topology(n);
  for (int i = 0; i < n; ++i) sub.gpus[static_cast<size_t>(i)] = topology.gpus[static_cast<size_t>(i)];
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) sub.link(a, b) = topology.link(a, b);
  }
  sub.host_memory_bytes = topology.host_memory_bytes;
  sub.numa_nodes = topology.numa_nodes;
  sub.source = topology.source;
  sub.nics = topology.nics;
  sub.nics_known = topology.nics_known;
  return sub;
}

uint64_t smallest_gpu_memory(const NodeTopology& topology) {
  uint64_t smallest = 0;
  for (const GpuInfo& gpu : topology.gpus) {
    if (gpu.index == 0 || gpu.memory_bytes < smallest) smallest = gpu.memory_bytes;
  }
  return smallest;
}

// Why tensor-parallel groups of `tp` consecutive ranks would span two nodes of `topology`'s
// GPUs each, or "" when none does (tp divides the GPUs per node).
std::string tp_node_violation(const NodeTopology& topology, const ClusterShape& cluster, int tp) {
  const int per_node = topology.gpu_count();
  if (per_node % tp == 0) return "";
  const int world = per_node * cluster.nnodes;
  int base = 0;  // the first group that spans two nodes
  while (base + tp <= world && base / per_node == (base + tp - 1) / per_node) base += tp;
  std::ostringstream why;
  why << "tp " << tp << " would put ranks " << base << "-" << base + tp - 1 << " of node "
      << base / per_node << " and node " << (base + tp - 1) / per_node
      << " in one tensor-parallel group (tensor parallelism all-reduces activations in every "
         "layer, so it stays inside a node: tp must divide the "
      << per_node << " GPUs per node)";
  return why.str();
}

// Why tensor parallelism over `tp` GPUs breaks a rule, or "" when it does not.
std::string tp_rule_violation(const ModelConfig& config, const NodeTopology& topology, int tp,
                              const ClusterShape& cluster) {
  if (tp == 1) return "";
  std::ostringstream why;
  if (const std::string reason = tp_unsupported_reason(config, tp); !reason.empty()) {
    why << "tp " << tp << ": " << reason;
    return why.str();
  }
  if (std::string across = tp_node_violation(topology, cluster, tp); !across.empty()) {
    return across;
  }
  for (int base = 0; base < topology.gpu_count(); base += tp) {
    for (int a = base; a < base + tp; ++a) {
      for (int b = a + 1; b < base + tp; ++b) {
        if (topology.link(a, b).kind != LinkKind::NVLink) {
          why << "tp " << tp << " would put GPU " << a << " and GPU " << b
              << " in one tensor-parallel group, but they are joined by PCIe, not NVLink "
                 "(tensor parallelism all-reduces activations in every layer, so it stays "
                 "inside an NVLink island)";
          return why.str();
        }
      }
    }
  }
  return "";
}

std::string pp_rule_violation(const ModelConfig& config, int pp) {
  if (pp <= config.n_layer) return "";
  return "pp " + std::to_string(pp) + " is more pipeline stages than the model's " +
         std::to_string(config.n_layer) + " layers (stages cut at block boundaries)";
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

// The expert-parallel degrees to try with dp data-parallel ranks: those that divide dp and the
// experts (a dense model: 1), or the one asked for.
std::vector<int> expert_degrees(const ModelConfig& config, int dp, const PlanRequest& request) {
  std::vector<int> eps;
  for (int ep : divisors(dp)) {
    if (request.ep ? ep == *request.ep : ep_unsupported_reason(config, ep).empty()) {
      eps.push_back(ep);
    }
  }
  return eps;
}

// Fewer moving parts first: no parameter offload (every block through PCIe), no optimizer
// offload (host step and transfers), no recompute, no pipeline, a lower ZeRO stage, no tensor
// parallelism, then fewer micro-batches.
auto simplicity(const Plan& p) {
  return std::make_tuple(p.offload_params, p.offload, static_cast<int>(p.recompute), p.pp, p.zero,
                         p.tp, p.ep, -p.micro_batch);
}

bool faster(const PlanCandidate& a, const PlanCandidate& b) {
  const double ta = a.seconds_per_token(), tb = b.seconds_per_token();
  if (std::abs(ta - tb) > 1e-9 * std::max(ta, tb)) return ta < tb;
  return simplicity(a.plan) < simplicity(b.plan);
}

auto shape(const Plan& p) {
  return std::make_tuple(p.dp, p.tp, p.pp, p.ep, p.zero, p.offload, p.offload_params,
                         static_cast<int>(p.recompute), fp8_options(p).cache_weights);
}

// How far a candidate is from fitting: device bytes over, then host bytes over.
std::pair<uint64_t, uint64_t> overflow(const PlanCandidate& c, const PlanResult& r) {
  const uint64_t device = c.memory.device_total();
  return {device > r.usable_device_bytes ? device - r.usable_device_bytes : 0,
          c.host_bytes > r.usable_host_bytes ? c.host_bytes - r.usable_host_bytes : 0};
}

std::string does_not_fit(const PlanCandidate& c, const PlanResult& r) {
  std::ostringstream text;
  if (!c.fits_device) {
    text << "needs " << format_bytes(c.memory.device_total()) << " per GPU, "
         << format_bytes(c.memory.device_total() - r.usable_device_bytes) << " more than the "
         << format_bytes(r.usable_device_bytes) << " usable of " << format_bytes(r.gpu_memory_bytes);
  } else if (r.host_memory_bytes == 0) {
    text << "needs " << format_bytes(c.host_bytes)
         << " of host memory for the offloaded " << offloaded_parts(c.plan)
         << ", and the host memory is unknown (give it with --host-memory)";
  } else {
    text << "needs " << format_bytes(c.host_bytes)
         << " of host memory for the offloaded " << offloaded_parts(c.plan) << " of all ranks, "
         << format_bytes(c.host_bytes - r.usable_host_bytes) << " more than the "
         << format_bytes(r.usable_host_bytes) << " usable of " << format_bytes(r.host_memory_bytes);
  }
  return text.str();
}

std::string verdict(const PlanCandidate& c, const PlanCandidate& best, const PlanResult& r) {
  std::ostringstream text;
  const double ratio = c.seconds_per_token() / best.seconds_per_token();
  if (!c.fits()) {
    text << "does not fit: " << does_not_fit(c, r);
    if (ratio < 1) {
      text.precision(1);
      text << std::fixed << " (it would be " << (1 / ratio - 1) * 100 << "% faster)";
    }
    return text.str();
  }
  if (ratio < 1) {
    text.precision(1);
    text << std::fixed << "predicted " << (1 / ratio - 1) * 100
         << "% faster, within the " << kTieMargin * 100
         << "% the model cannot tell apart; the chosen plan has fewer moving parts";
    return text.str();
  }
  if (ratio - 1 < 5e-4) return "as fast as predicted; the chosen plan has fewer moving parts";
  text.precision(1);
  text << std::fixed << "slower by " << (ratio - 1) * 100 << "%";
  return text.str();
}

std::string fixed_parts(const PlanRequest& q) {
  std::ostringstream text;
  if (q.dp) text << " --dp " << *q.dp;
  if (q.tp) text << " --tp " << *q.tp;
  if (q.ep) text << " --ep " << *q.ep;
  if (q.pp) text << " --pp " << *q.pp;
  if (q.zero) text << " --zero " << *q.zero;
  if (q.offload || q.offload_params) {
    Plan offload;
    offload.offload = q.offload.value_or(false);
    offload.offload_params = q.offload_params.value_or(false);
    text << " --offload " << offload_name(offload);
  }
  if (q.recompute) text << " --recompute " << recompute_name(*q.recompute);
  if (q.micro_batch) text << " --micro-batch " << *q.micro_batch;
  if (q.pp_schedule) text << " --pp-schedule " << pipeline_schedule_name(*q.pp_schedule);
  if (!q.pp_split.empty()) text << " --pp-split " << pipeline_split_text(q.pp_split);
  return text.str();
}

std::string features(const Plan& p) {
  std::ostringstream text;
  text << "ZeRO-" << p.zero;
  if (p.offload) text << " + optimizer offload";
  if (p.offload_params) text << " + parameter offload";
  if (p.recompute != Recompute::None) text << " + " << recompute_name(p.recompute) << " recompute";
  if (p.pp > 1) text << " + " << p.pp << " pipeline stages";
  if (p.tp > 1) text << " + tensor parallelism over " << p.tp;
  if (p.ep > 1) text << " + expert parallelism over " << p.ep;
  text << " at micro-batch " << p.micro_batch;
  return text.str();
}

// Why the plan splits a mixture-of-experts model's experts the way it does: what each GPU holds
// and what the all-to-alls cost, against the best plan of every other ep ("" for a dense model).
std::string explain_ep_choice(const ModelConfig& config, const std::vector<PlanCandidate>& all,
                              const PlanCandidate& best, const PlanResult& r) {
  if (!config.moe.enabled()) return "";
  std::ostringstream text;
  const Plan& p = best.plan;
  const int64_t experts = config.moe.experts;
  text << "expert parallelism: ";
  if (p.ep == 1) {
    text << "none, every GPU holds all " << experts << " experts of each MoE layer";
  } else {
    text.precision(3);
    text << "ep " << p.ep << ", each GPU holds " << experts / p.ep << " of the " << experts
         << " experts of each MoE layer; its all-to-alls take " << best.cost.ep_comm_seconds
         << " s of the " << best.cost.step_seconds << " s step";
    if (!best.cost.ep_route.empty()) text << " (over " << best.cost.ep_route << ")";
  }
  std::map<int, const PlanCandidate*> others;  // the best of every other ep
  for (const PlanCandidate& c : all) {
    if (c.plan.ep == p.ep) continue;
    const PlanCandidate*& o = others[c.plan.ep];
    if (!o || (c.fits() && (!o->fits() || faster(c, *o)))) o = &c;
  }
  for (const auto& [ep, c] : others) {
    text << "; ep " << ep << ": ";
    if (!c->fits()) {
      text << "does not fit (" << does_not_fit(*c, r) << ")";
    } else {
      const double ratio = c->seconds_per_token() / best.seconds_per_token();
      if (ratio >= 1) {
        char percent[32];
        std::snprintf(percent, sizeof percent, "%.1f%%", (ratio - 1) * 100);
        text << "slower by " << percent;
      } else {
        text << "as fast within the model's margin, with more moving parts";
      }
    }
  }
  return text.str();
}

// Why the plan offloads the parameters: what crosses the link to the host and what that costs,
// against the best plan that keeps them on the GPUs ("" when the plan keeps them).
std::string explain_offload_choice(const std::vector<PlanCandidate>& all,
                                   const PlanCandidate& best, const PlanResult& r) {
  if (!best.plan.offload_params) return "";
  std::ostringstream text;
  text.precision(3);
  text << "parameter offload: the 16-bit parameters and gradients of every block live in host "
          "memory and come to the GPU block by block, ahead of use";
  if (!best.cost.host_route.empty()) text << " (over " << best.cost.host_route << ")";
  text << "; the transfers" << (best.plan.offload ? " and the host's optimizer step" : "")
       << " take " << best.cost.offload_seconds << " s of the " << best.cost.step_seconds
       << " s step that compute does not hide";
  const PlanCandidate* resident = nullptr;  // the best plan without parameter offload
  for (const PlanCandidate& c : all) {
    if (c.plan.offload_params) continue;
    if (!resident || (c.fits() && (!resident->fits() || faster(c, *resident))) ||
        (!c.fits() && !resident->fits() && overflow(c, r) < overflow(*resident, r))) {
      resident = &c;
    }
  }
  if (resident == nullptr) return text.str();
  text << "; without it, the best plan (" << features(resident->plan) << ") ";
  if (!resident->fits()) {
    text << "does not fit: " << does_not_fit(*resident, r);
  } else {
    text.precision(1);
    text << std::fixed << "is slower by "
         << (resident->seconds_per_token() / best.seconds_per_token() - 1) * 100 << "%";
  }
  return text.str();
}

// Where host memory is what is short and the Adam moments are fp32: what the same plan would
// need with them in bf16 ("" otherwise).
std::string bf16_states_hint(const ModelConfig& config, const PlanCandidate& c,
                             const PlanResult& r) {
  if (c.plan.bf16_optimizer_states || !c.plan.offload || r.host_memory_bytes == 0) return "";
  Plan plan = c.plan;
  plan.bf16_optimizer_states = true;
  const MemoryModel memory(config);
  // The fullest node's bytes (c.host_bytes) scale as all ranks' do.
  const double ratio = static_cast<double>(memory.host_bytes_all_ranks(plan)) /
                       static_cast<double>(memory.host_bytes_all_ranks(c.plan));
  const auto bf16 = static_cast<uint64_t>(static_cast<double>(c.host_bytes) * ratio);
  std::ostringstream text;
  text << "; with --bf16-optimizer-states (the Adam moments in bf16) it would need "
       << format_bytes(bf16) << (bf16 <= r.usable_host_bytes ? ", which fits" : "");
  return text.str();
}

// How many nodes like these the model's states alone need, where that is more than the
// request's `nodes`: bf16 weights and gradients, fp32 master weights and Adam moments (16 bytes a
// parameter) over each node's usable GPU and host memory; "" otherwise.
std::string nodes_needed(const ModelConfig& config, const PlanResult& r, int gpus_per_node,
                         int nodes) {
  const double states = 16.0 * static_cast<double>(config.num_parameters());
  const double per_node = static_cast<double>(gpus_per_node) *
                              static_cast<double>(r.usable_device_bytes) +
                          static_cast<double>(r.usable_host_bytes);
  const auto needed = static_cast<int64_t>(std::ceil(states / per_node));
  if (per_node <= 0 || needed <= nodes) return "";
  return "; its weights, gradients and Adam states alone (16 bytes a parameter, " +
         format_bytes(static_cast<uint64_t>(states)) + ") need at least " +
         std::to_string(needed) + " such nodes of " + std::to_string(gpus_per_node) + " GPUs (" +
         format_bytes(static_cast<uint64_t>(per_node)) + " of GPU and host memory usable each)";
}

// The one sentence for a request no plan satisfies (`gpus` over `nodes` nodes), `hint` (the
// flags with which one would fit, or "") at its end.
[[noreturn]] void explain_no_fit(const ModelConfig& config, const PlanRequest& request,
                                 const std::vector<PlanCandidate>& all, const PlanResult& r,
                                 int gpus, int nodes, const std::string& hint) {
  DSTRAIN_CHECK(!all.empty());
  const PlanCandidate* least_device = &all[0];
  const PlanCandidate* least_host = nullptr;  // among those that fit the GPUs
  for (const PlanCandidate& c : all) {
    if (overflow(c, r).first < overflow(*least_device, r).first) least_device = &c;
    if (c.fits_device && (!least_host || c.host_bytes < least_host->host_bytes)) least_host = &c;
  }
  const std::string fixed = fixed_parts(request);
  if (!fixed.empty()) {
    const PlanCandidate& closest = least_host ? *least_host : *least_device;
    DSTRAIN_USER_ERROR() << "the plan fixed by" << fixed << " does not fit " << gpus << " x "
                         << r.machine << ": the closest, " << describe(closest.plan) << ", "
                         << does_not_fit(closest, r);
  }
  if (least_host) {
    DSTRAIN_USER_ERROR() << config.name << " fits " << gpus << " x " << r.machine
                         << " only with state offloaded to host memory, and even the "
                         << "plan that needs the least (" << features(least_host->plan) << ") "
                         << does_not_fit(*least_host, r) << bf16_states_hint(config, *least_host, r)
                         << (hint.empty() ? "" : "; " + hint);
  }
  DSTRAIN_USER_ERROR() << config.name << " needs at least "
                       << format_bytes(least_device->memory.device_total())
                       << " per GPU on " << gpus << (gpus == 1 ? " GPU" : " GPUs")
                       << " even with "
                       << features(least_device->plan) << "; these GPUs have "
                       << format_bytes(r.gpu_memory_bytes) << " ("
                       << format_bytes(r.usable_device_bytes) << " usable)"
                       << ((least_device->plan.offload || least_device->plan.offload_params) &&
                                   !least_device->fits_host
                               ? " and that plan would also need " +
                                     format_bytes(least_device->host_bytes) +
                                     " of host memory (the host has " +
                                     (r.host_memory_bytes ? format_bytes(r.host_memory_bytes)
                                                          : std::string("an unknown amount")) +
                                     ")"
                               : std::string())
                       << nodes_needed(config, r, gpus / nodes, nodes)
                       << ": use more or larger GPUs, or a smaller model"
                       << (hint.empty() ? "" : "; " + hint);
}

// The fixed parts of a request, checked against the rules with the rule as the message.
// `world`: the ranks over all nodes; `world_text`: "8 GPUs", "32 GPUs of 4 nodes x 8".
void check_fixed_parts(const ModelConfig& config, const NodeTopology& topology,
                       const ClusterShape& cluster, const PlanRequest& request, int world,
                       const std::string& world_text) {
  DSTRAIN_USER_CHECK(!request.bf16_optimizer_states || request.offload.value_or(true))
      << kBf16StatesNeedOffload;
  for (const auto& [flag, value] : {std::pair{"--dp", request.dp}, std::pair{"--tp", request.tp},
                                    std::pair{"--pp", request.pp}}) {
    DSTRAIN_USER_CHECK(!value || (*value >= 1 && world % *value == 0))
        << flag << " " << *value << " must be at least 1 and divide the " << world_text;
  }
  if (request.ep) {
    const std::string why = ep_unsupported_reason(config, *request.ep);
    DSTRAIN_USER_CHECK(why.empty()) << "--ep " << *request.ep << ": " << why;
  }
  DSTRAIN_USER_CHECK(!request.zero || (*request.zero >= 0 && *request.zero <= 3))
      << "--zero must be 0, 1, 2 or 3, not " << *request.zero;
  DSTRAIN_USER_CHECK(!request.micro_batch || *request.micro_batch >= 1)
      << "--micro-batch must be at least 1";
  if (request.dp && request.tp && request.pp) {
    DSTRAIN_USER_CHECK(*request.dp * *request.tp * *request.pp == world)
        << "--dp " << *request.dp << " x --tp " << *request.tp << " x --pp " << *request.pp
        << " = " << *request.dp * *request.tp * *request.pp << " ranks, but the plan is for "
        << world_text;
  }
  if (!request.pp_split.empty()) {
    DSTRAIN_USER_CHECK(!request.pp || *request.pp == static_cast<int>(request.pp_split.size()))
        << "--pp-split " << pipeline_split_text(request.pp_split) << " gives "
        << request.pp_split.size() << " stages, but --pp is " << *request.pp;
    check_pipeline_split(config, static_cast<int>(request.pp_split.size()), request.pp_split);
  }
  if (request.tp) {
    const std::string why = tp_rule_violation(config, topology, *request.tp, cluster);
    DSTRAIN_USER_CHECK(why.empty()) << "--tp " << *request.tp << " is not possible here: " << why;
  }
  if (request.pp) {
    const std::string why = pp_rule_violation(config, *request.pp);
    DSTRAIN_USER_CHECK(why.empty()) << "--pp " << *request.pp << " is not possible: " << why;
  }
}

}  // namespace

uint64_t usable_device_memory(uint64_t gpu_memory_bytes) {
  return usable(gpu_memory_bytes, kDeviceHeadroomFraction, kDeviceReserveBytes);
}

uint64_t usable_host_memory(uint64_t host_memory_bytes) {
  return usable(host_memory_bytes, kHostHeadroomFraction, kHostReserveBytes);
}

double PlanCandidate::seconds_per_token() const {
  return cost.step_seconds / static_cast<double>(plan.tokens_per_step());
}

namespace {

// Host memory of the ranks of the fullest node (all ranks with one node).
uint64_t host_bytes_per_node(const MemoryModel& memory, const Plan& plan, int gpus_per_node,
                             const ClusterShape& cluster) {
  if (!cluster.multi_node()) return memory.host_bytes_all_ranks(plan);
  std::vector<double> per_stage;
  for (int s = 0; s < plan.pp; ++s) {
    per_stage.push_back(static_cast<double>(memory.predict_stage(plan, s).host_total()));
  }
  return static_cast<uint64_t>(fullest_node_total(plan, gpus_per_node, per_stage));
}

}  // namespace

PlanCandidate evaluate_plan(const MemoryModel& memory, const NodeTopology& topology,
                            const Plan& plan, const ClusterShape& cluster) {
  PlanCandidate c;
  c.plan = plan;
  c.memory = memory.predict(plan);
  const bool uses_host = plan.offload || plan.offload_params;
  c.host_bytes = uses_host ? host_bytes_per_node(memory, plan, topology.gpu_count(), cluster) : 0;
  c.cost = predict_step_cost(memory, topology, plan, cluster);
  c.fits_device = c.memory.device_total() <= usable_device_memory(smallest_gpu_memory(topology));
  c.fits_host = !uses_host || (topology.host_memory_bytes > 0 &&
                                  c.host_bytes <= usable_host_memory(topology.host_memory_bytes));
  return c;
}

namespace {

// The micro-batches to try with dp ranks: the one asked for, or powers of two up to a rank's
// share of the step (with exact_global_batch, every divisor of that share).
std::vector<int64_t> micro_batch_choices(const PlanRequest& request, int64_t sequences, int dp) {
  if (request.micro_batch) return {*request.micro_batch};
  std::vector<int64_t> micro_batches;
  const int64_t most = (sequences + dp - 1) / dp;
  if (request.exact_global_batch && sequences % dp == 0) {
    for (int64_t mb = 1; mb <= most; ++mb) {
      if ((sequences / dp) % mb == 0) micro_batches.push_back(mb);
    }
    return micro_batches;
  }
  for (int64_t mb = 1; mb <= most; mb *= 2) micro_batches.push_back(mb);
  return micro_batches;
}

// Every pair of optimizer offload and parameter offload the request leaves open.
std::vector<std::pair<bool, bool>> offload_choices(const std::vector<bool>& optimizer,
                                                   const std::vector<bool>& params) {
  std::vector<std::pair<bool, bool>> pairs;
  for (bool p : params) {
    for (bool o : optimizer) pairs.emplace_back(o, p);
  }
  return pairs;
}

// The candidates of one (dp, tp, pp) shape: every ep, ZeRO stage, offload, recompute and
// micro-batch the request leaves open that reaches the global batch of `sequences`; for each
// setting the micro-batches grow until one does not fit.
struct Shape {
  int dp, tp, pp;
};
// fp8 with resident parameters: the FP8 weights cached (faster) or cast at each use (2 bytes a
// parameter of the layers' linears less). Else the one choice, which changes nothing.
std::vector<bool> fp8_weight_cache_choices(const Plan& plan) {
  Plan cached = plan;
  cached.fp8_weight_cache = true;
  return fp8_options(cached).cache_weights ? std::vector<bool>{true, false}
                                           : std::vector<bool>{true};
}

void add_shape_candidates(const MemoryModel& memory, const NodeTopology& topology,
                          const ClusterShape& cluster, const PlanRequest& request,
                          const Shape& shape, int64_t sequences, int64_t seq_len, DType precision,
                          std::vector<PlanCandidate>& all) {
  const int dp = shape.dp;
  std::vector<int> zeros = {0};
  if (dp > 1) zeros = {0, 1, 2, 3};
  if (request.zero) zeros = {*request.zero};
  std::vector<bool> offloads = {false, true};
  if (request.offload) offloads = {*request.offload};
  if (request.bf16_optimizer_states) offloads = {true};  // checked: not fixed to false
  std::vector<bool> param_offloads = {false, true};
  if (request.offload_params) param_offloads = {*request.offload_params};
  std::vector<Recompute> recomputes = {Recompute::None, Recompute::Selective, Recompute::Full};
  if (request.recompute) recomputes = {*request.recompute};
  const std::vector<int64_t> micro_batches = micro_batch_choices(request, sequences, dp);
  for (int ep : expert_degrees(memory.config(), dp, request)) {
    for (int zero : zeros) {
      for (const auto& [offload, offload_params] : offload_choices(offloads, param_offloads)) {
        for (Recompute recompute : recomputes) {
          for (int64_t mb : micro_batches) {
            Plan plan;
            plan.dp = dp;
            plan.tp = shape.tp;
            plan.ep = ep;
            plan.moe_capacity_factor = request.moe_capacity_factor;
            plan.pp = shape.pp;
            plan.zero = zero;
            plan.offload = offload;
            plan.offload_params = offload_params;
            plan.bf16_optimizer_states = request.bf16_optimizer_states;
            plan.recompute = recompute;
            plan.micro_batch = mb;
            plan.grad_accum = (sequences + dp * mb - 1) / (dp * mb);
            plan.seq_len = seq_len;
            plan.param_dtype = precision;
            plan.fp8 = request.fp8;
            plan.pp_schedule = request.pp_schedule.value_or(PipelineScheduleKind::OneFOneB);
            plan.sequence_parallel = request.sequence_parallel.value_or(true);
            // Sequence parallelism splits a micro-batch's tokens over the tp ranks.
            if (plan.uses_sequence_parallel() && mb * seq_len % shape.tp != 0) continue;
            plan.pp_split = request.pp_split.empty() ? memory.split(plan) : request.pp_split;
            const int64_t reached = dp * mb * plan.grad_accum;
            if ((reached - sequences) * kOvershootDenominator > sequences) continue;
            if (request.exact_global_batch && reached != sequences) continue;
            bool fits = false;  // larger micro-batches only need more
            for (bool cache : fp8_weight_cache_choices(plan)) {
              plan.fp8_weight_cache = cache;
              PlanCandidate c = evaluate_plan(memory, topology, plan, cluster);
              fits = fits || c.fits();
              all.push_back(std::move(c));
            }
            if (!fits) break;
          }
        }
      }
    }
  }
}


// A dropless mixture-of-experts model that fits no plan: the flags with which one would fit -- an
// expert capacity (the receive buffers then hold a bounded share of the tokens, not every
// token's k copies), and bf16 Adam moments if host memory is still short -- and that plan; ""
// when neither helps or the request already caps the experts.
std::string capacity_factor_hint(const ModelConfig& config, const NodeTopology& whole,
                                 const PlanRequest& request, const ClusterShape& cluster) {
  if (!config.moe.enabled() || request.moe_capacity_factor > 0) return "";
  for (bool bf16_states : {false, true}) {
    if (bf16_states && (request.bf16_optimizer_states || request.offload == false)) continue;
    PlanRequest capped = request;
    capped.moe_capacity_factor = kHintCapacityFactor;
    capped.bf16_optimizer_states = request.bf16_optimizer_states || bf16_states;
    try {
      const PlanResult fits = choose_plan(config, whole, capped, cluster);
      std::ostringstream text;
      text << "it fits with --moe-expert-capacity-factor " << kHintCapacityFactor
           << (bf16_states ? " --bf16-optimizer-states" : "") << " (each expert takes at most "
           << kHintCapacityFactor << " times its even share of a micro-batch's tokens and drops "
           << "the rest): " << features(fits.best.plan);
      return text.str();
    } catch (const UserError&) {
    }
  }
  return "";
}

}  // namespace

PlanResult choose_plan(const ModelConfig& config, const NodeTopology& whole,
                       const PlanRequest& request, const ClusterShape& cluster) {
  DSTRAIN_USER_CHECK(whole.gpu_count() > 0)
      << "the topology has no GPU; plan for a machine with --topology FILE or "
         "--from-nvidia-smi FILE --gpu NAME";
  const int gpus = request.gpus > 0 ? request.gpus : whole.gpu_count();
  DSTRAIN_USER_CHECK(request.gpus >= 0) << "--gpus must be at least 1, not " << request.gpus;
  DSTRAIN_USER_CHECK(gpus <= whole.gpu_count())
      << "--gpus " << gpus << " is more GPUs than the machine's " << whole.gpu_count();
  DSTRAIN_USER_CHECK(cluster.nnodes >= 1 && cluster.nnodes <= kMaxNodes)
      << "--nnodes must be between 1 and " << kMaxNodes << ", not " << cluster.nnodes;
  const NodeTopology topology = first_gpus(whole, gpus);
  // Ranks over all nodes, and how to say it: "8 GPUs", "32 GPUs of 4 nodes x 8".
  const int world = gpus * cluster.nnodes;
  const std::string world_text =
      std::to_string(world) + " GPUs" +
      (cluster.multi_node()
           ? " of " + std::to_string(cluster.nnodes) + " nodes x " + std::to_string(gpus)
           : std::string());
  for (const GpuInfo& gpu : topology.gpus) {
    DSTRAIN_USER_CHECK(gpu.memory_bytes > 0)
        << "the topology does not say how much memory GPU " << gpu.index
        << " has; name the GPU model with --gpu (" << known_gpu_names() << ")";
  }
  const GpuInfo& gpu0 = topology.gpus[0];

  PlanResult result;
  result.gpu_memory_bytes = smallest_gpu_memory(topology);
  result.usable_device_bytes = usable_device_memory(result.gpu_memory_bytes);
  result.host_memory_bytes = topology.host_memory_bytes;
  result.usable_host_bytes = usable_host_memory(topology.host_memory_bytes);
  {
    std::ostringstream text;
    text << (gpu0.name.empty() ? "GPU" : gpu0.name) << " (" << format_bytes(result.gpu_memory_bytes)
         << ")";
    result.machine = text.str();
    result.wiring = topology.classify().sentence();
  }
  result.cluster = cluster;
  result.gpus_per_node = gpus;

  const int64_t seq_len =
      request.seq_len > 0 ? request.seq_len : std::min<int64_t>(1024, config.n_positions);
  DSTRAIN_USER_CHECK(request.seq_len >= 0 && seq_len <= config.n_positions)
      << "--seq-len " << request.seq_len << " is outside 1.." << config.n_positions
      << " (the model's n_positions)";
  DSTRAIN_USER_CHECK(request.global_batch_tokens >= seq_len &&
                     request.global_batch_tokens % seq_len == 0)
      << "--global-batch-tokens " << request.global_batch_tokens
      << " must be a positive multiple of the sequence length " << seq_len;
  const int64_t sequences = request.global_batch_tokens / seq_len;
  result.global_batch_sequences = sequences;
  const DType precision = request.precision.value_or(
      gpu0.cc_major >= 8 ? DType::BF16 : DType::F16);
  DSTRAIN_USER_CHECK(precision == DType::F32 || precision == DType::F16 ||
                     precision == DType::BF16)
      << "the precision must be fp32, fp16 or bf16";
  DSTRAIN_USER_CHECK(precision != DType::BF16 || gpu0.cc_major == 0 || gpu0.cc_major >= 8)
      << "bf16 needs compute capability 8.0 or newer; " << gpu0.name << " has "
      << gpu0.cc_major << "." << gpu0.cc_minor << ": use fp16";
  DSTRAIN_USER_CHECK(!request.fp8 || precision == DType::BF16)
      << "fp8 keeps its parameters and activations in bf16";
  DSTRAIN_USER_CHECK(!request.fp8 || gpu0.cc_major == 0 || gpu0.cc_major * 10 + gpu0.cc_minor >= 89)
      << "fp8 needs FP8 tensor cores (compute capability 8.9 or newer: RTX 40xx, L4, L40, H100, "
         "H200); "
      << gpu0.name << " has " << gpu0.cc_major << "." << gpu0.cc_minor << ": use bf16";

  check_fixed_parts(config, topology, cluster, request, world, world_text);

  const MemoryModel memory(config);
  std::vector<PlanCandidate> all;
  for (int tp : divisors(world)) {
    if (request.tp && tp != *request.tp) continue;
    if (const std::string why = tp_rule_violation(config, topology, tp, cluster); !why.empty()) {
      result.excluded.push_back(why);
      continue;
    }
    for (int pp : divisors(world / tp)) {
      const int dp = world / tp / pp;
      if ((request.pp && pp != *request.pp) || (request.dp && dp != *request.dp)) continue;
      if (!request.pp_split.empty() && pp != static_cast<int>(request.pp_split.size())) continue;
      if (const std::string why = pp_rule_violation(config, pp); !why.empty()) {
        if (tp == 1) result.excluded.push_back(why);
        continue;
      }
      add_shape_candidates(memory, topology, cluster, request, {dp, tp, pp}, sequences, seq_len,
                           precision, all);
    }
  }
  result.candidates = static_cast<int>(all.size());
  DSTRAIN_USER_CHECK(!all.empty())
      << "no plan of " << world_text << fixed_parts(request) << " reaches the global batch of "
      << sequences << " sequences of " << seq_len
      << " tokens; choose --global-batch-tokens as a multiple of dp x micro-batch x seq-len";

  const PlanCandidate* fastest = nullptr;
  for (const PlanCandidate& c : all) {
    if (c.fits() && (!fastest || faster(c, *fastest))) fastest = &c;
  }
  if (!fastest) {
    explain_no_fit(config, request, all, result, world, cluster.nnodes,
                   capacity_factor_hint(config, whole, request, cluster));
  }
  const PlanCandidate* best = fastest;
  for (const PlanCandidate& c : all) {
    if (c.fits() && c.seconds_per_token() <= fastest->seconds_per_token() * (1 + kTieMargin) &&
        simplicity(c.plan) < simplicity(best->plan)) {
      best = &c;
    }
  }
  result.best = *best;
  result.ep_choice = explain_ep_choice(config, all, *best, result);
  result.offload_choice = explain_offload_choice(all, *best, result);

  // One representative per shape: its fastest fitting plan, else the one closest to fitting.
  std::map<decltype(shape(Plan{})), const PlanCandidate*> representative;
  for (const PlanCandidate& c : all) {
    const auto key = shape(c.plan);
    if (key == shape(best->plan)) continue;
    const PlanCandidate*& r = representative[key];
    if (!r) {
      r = &c;
    } else if (c.fits() != r->fits()) {
      if (c.fits()) r = &c;
    } else if (c.fits() ? faster(c, *r) : overflow(c, result) < overflow(*r, result)) {
      r = &c;
    }
  }
  std::vector<const PlanCandidate*> fitting, faster_but_too_big;
  for (const auto& [key, c] : representative) {
    if (c->fits()) {
      fitting.push_back(c);
    } else if (c->seconds_per_token() < best->seconds_per_token()) {
      faster_but_too_big.push_back(c);
    }
  }
  auto by_speed = [](const PlanCandidate* a, const PlanCandidate* b) { return faster(*a, *b); };
  std::sort(fitting.begin(), fitting.end(), by_speed);
  std::sort(faster_but_too_big.begin(), faster_but_too_big.end(), by_speed);
  fitting.resize(std::min<size_t>(fitting.size(), static_cast<size_t>(request.max_alternatives)));
  faster_but_too_big.resize(
      std::min<size_t>(faster_but_too_big.size(), static_cast<size_t>(kMaxFasterNonFitting)));
  std::vector<const PlanCandidate*> shown = faster_but_too_big;
  shown.insert(shown.end(), fitting.begin(), fitting.end());
  std::sort(shown.begin(), shown.end(), by_speed);
  for (const PlanCandidate* c : shown) {
    PlanCandidate alternative = *c;
    alternative.verdict = verdict(alternative, result.best, result);
    result.alternatives.push_back(std::move(alternative));
  }
  return result;
}

}  // namespace dstrain
