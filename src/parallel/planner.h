// The planner: the fastest plan whose memory fits, for a model on a machine.
//
// It enumerates dp x tp x pp (= the GPUs), ZeRO stage 0-3, optimizer offload on/off,
// parameter offload on/off, recompute none/selective/full and micro-batches (powers of two)
// with the accumulation that reaches the requested global batch; drops what does not fit (memory_model.h against the
// GPU's memory less a headroom, and the host's RAM for offload); ranks the rest by predicted
// time per token (cost_model.h) and says why each alternative lost.
//
// Rules: tensor parallelism only inside an NVLink island (its all-reduces are on the critical
// path of every layer) and only over a divisor of n_head; pipeline stages cut at block
// boundaries (pp <= n_layer); offload only when the host RAM holds every rank's share.
// Across nodes (a ClusterShape of nnodes identical nodes, topology/cluster.h): the world is
// nnodes x the GPUs per node, rank = node_rank x gpus_per_node + local_rank; tensor
// parallelism stays inside a node (tp divides the GPUs per node, so its groups of consecutive
// ranks never span two: its collectives are per layer and would run at network speed);
// pipeline stages and data parallelism may span nodes, their traffic costed at the inter-node
// link (cost_model.h). Host memory is per node.
// Precision: bf16 where the GPU has it (compute capability >= 8.0), else fp16.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "parallel/cost_model.h"
#include "parallel/memory_model.h"
#include "parallel/plan.h"
#include "topology/topology.h"

namespace dstrain {

// GPT-2's batch: 512 sequences of 1024 tokens (Radford et al. 2019).
constexpr int64_t kDefaultGlobalBatchTokens = 524288;

struct PlanRequest {
  int gpus = 0;                  // per node: GPUs 0..gpus-1 of the topology; 0: all of them
  int64_t global_batch_tokens = kDefaultGlobalBatchTokens;
  int64_t seq_len = 0;           // 0: min(1024, n_positions)
  std::optional<DType> precision;  // default: bf16 with compute capability >= 8.0, else fp16
  bool fp8 = false;  // --precision fp8 (Plan::fp8): precision BF16 and the layers' GEMMs in FP8
  // Parts of the plan the user fixed; the search keeps them.
  std::optional<int> dp, tp, pp, zero;
  std::optional<int> ep;  // expert parallelism (MoE models); default: the planner's choice
  double moe_capacity_factor = 0;  // MoE models: an expert capacity (Plan::moe_capacity_factor)
  std::optional<bool> offload;
  std::optional<bool> offload_params;  // default: only where nothing else fits
  // The Adam moments in bf16 (Plan::bf16_optimizer_states): asked for, never chosen (it changes
  // the numbers); it needs the optimizer offloaded.
  bool bf16_optimizer_states = false;
  std::optional<Recompute> recompute;
  std::optional<int64_t> micro_batch;
  std::optional<PipelineScheduleKind> pp_schedule;  // default 1F1B (GPipe only needs more memory)
  std::vector<int64_t> pp_split;  // layers per stage (fixes pp); empty: the balanced split
  std::optional<bool> sequence_parallel;  // with tp > 1; default on
  // Reach the global batch exactly (a resumed run keeps its sequences per step): micro-batches
  // that divide a rank's share instead of powers of two, and no overshoot.
  bool exact_global_batch = false;
  int max_alternatives = 8;      // fitting alternatives to keep (plus a few that do not fit)
};

struct PlanCandidate {
  Plan plan;
  MemoryPrediction memory;     // the rank that needs the most device memory
  uint64_t host_bytes = 0;     // host memory of all ranks of the fullest node (offload)
  StepCost cost;
  bool fits_device = false, fits_host = false;
  bool fits() const { return fits_device && fits_host; }
  double seconds_per_token() const;
  std::string verdict;         // why it lost to the chosen plan (alternatives only)
};

struct PlanResult {
  PlanCandidate best;
  // The best plan of each other shape (dp, tp, pp, ZeRO, offload, recompute), fastest first:
  // up to max_alternatives that fit, then up to three faster ones that do not.
  std::vector<PlanCandidate> alternatives;
  std::vector<std::string> excluded;  // shapes the rules forbid, with the rule
  // A mixture-of-experts model: why the best plan's ep, against the other ep values (one
  // sentence); "" for a dense model.
  std::string ep_choice;
  // Parameter offload chosen: why, against the best plan that keeps the parameters on the GPUs
  // (one sentence); "" otherwise.
  std::string offload_choice;
  uint64_t gpu_memory_bytes = 0;      // per GPU (the smallest)
  uint64_t usable_device_bytes = 0;   // after the headroom
  uint64_t host_memory_bytes = 0;     // 0: unknown
  uint64_t usable_host_bytes = 0;
  int64_t global_batch_sequences = 0;
  int candidates = 0;                 // plans evaluated
  std::string machine;                // "NVIDIA GeForce RTX 4090 (24.00 GiB)"
  std::string wiring;                 // how the planned GPUs of a node are joined, one sentence
  ClusterShape cluster;               // the nodes and their link (one node: nnodes 1)
  int gpus_per_node = 0;              // the GPUs planned on each node
};

// Memory a plan may use: the GPU's memory less 10% and 1 GiB; the host's less 20% and 8 GiB
// (the constants and why: planner.cpp).
uint64_t usable_device_memory(uint64_t gpu_memory_bytes);
uint64_t usable_host_memory(uint64_t host_memory_bytes);

// `topology`: one node; `cluster`: how many such nodes and their link (make_cluster_shape;
// the default is this one node).
// Throws UserError with one sentence when the request cannot be planned: no GPU, GPU memory
// unknown, a fixed part that breaks a rule, a fixed plan that does not fit (by how much), a
// model that fits no plan (what it would need).
PlanResult choose_plan(const ModelConfig& config, const NodeTopology& topology,
                       const PlanRequest& request, const ClusterShape& cluster = {});

// Memory and time of one given plan (no search, no rules checked beyond validity).
PlanCandidate evaluate_plan(const MemoryModel& memory, const NodeTopology& topology,
                            const Plan& plan, const ClusterShape& cluster = {});

}  // namespace dstrain
