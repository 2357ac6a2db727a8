// The cost model: predicted time of one optimizer step of a Plan on a machine.
//
//   step = slowest pipeline stage's time per micro-batch x (grad_accum + pp - 1)     (1F1B)
//        + what the step adds once (gradient / parameter collectives that backward and forward
//          cannot hide, offload transfers, the optimizer on the device or the host)
//   time per micro-batch = compute + tensor-parallel collectives + pipeline sends + the
//        ZeRO-2/3 collectives of the micro-batch that compute cannot hide
//   compute (forward, backward, and what recompute repeats) = three terms, as the CUDA kernels
//        run them: the GEMMs' FLOPs (model_flops.h) at a fraction of the peak; the attention's
//        executed FLOPs (kernel_work.h: causal tiles skipped, the backward's recomputed
//        products) at a fraction of the tensor-core peak, or of the CUDA cores' fp32 rate for
//        the fp32 kernels; the memory-bound kernels' bytes (kernel_work.h) at the achievable
//        memory bandwidth
//
// Bytes move at topology/bandwidth.h's achievable rates; ring collectives over N ranks move
// 2(N-1)/N of the buffer per rank (all-reduce) or (N-1)/N (reduce-scatter, all-gather).
// Every constant and its source is in cost_model.cpp. The model ranks plans; it does not
// promise wall-clock seconds.
//
// Across nodes (topology/cluster.h): rank r runs on node r / G, GPU r % G of that node (G GPUs
// per node). A group whose ranks are on one node moves bytes as above. A group that spans nodes
// is a ring over its nodes, each node's members consecutive in it: every inter-node hop carries
// the whole ring's per-rank volume (2(N-1)/N of the buffer for an all-reduce), so the ring runs
// at the slower of its in-node hops and the node's inter-node link divided among the groups of
// the same kind that cross it at the same time (8 data-parallel rings leaving a node of 8 GPUs
// share its NICs 8 ways). Pipeline sends between stages on different nodes share the link the
// same way. The inter-node latency is not modelled (kCollectiveSeconds per call, as in a node).
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "parallel/kernel_work.h"
#include "parallel/memory_model.h"
#include "parallel/model_flops.h"
#include "parallel/plan.h"
#include "topology/cluster.h"
#include "topology/topology.h"

namespace dstrain {

// model_flops (parallel/model_flops.h): the work the step is made of.

// What the GPUs of a topology compute and move, from the known-GPU table by name.
struct GpuSpeed {
  double peak_flops = 0;  // dense tensor FLOP/s at the plan's precision (MFU's peak)
  double fp8_flops = 0;   // dense FP8 tensor FLOP/s with fp32 accumulation (0: no FP8 cores)
  double fp32_flops = 0;  // the CUDA cores' fp32 FLOP/s (no tensor cores)
  // What mma.sync reaches of peak_flops: 1 up to Ampere and Ada; below 1 on Hopper and
  // datacenter Blackwell, whose peak needs their asynchronous warpgroup MMA.
  double mma_sync_fraction = 1;
  double memory_bytes_per_s = 0;  // achievable device memory bandwidth
  // Empty for a GPU of the known-GPU table. For any other GPU: how the numbers above were
  // estimated (from its SM count and compute capability), a sentence for the plan report.
  std::string estimate_note;
};
// GPU 0's speed: from the known-GPU table, or for an unknown GPU estimated from its SM count and
// compute capability (tensor FLOPs per SM per clock of its architecture at an assumed clock), so
// that a GPU newer than the table still trains with no flags.
GpuSpeed gpu_speed(const NodeTopology& topology, DType precision);

// Fraction of peak the GEMMs of a micro-batch reach: rows = tokens of the micro-batch,
// width = the GEMMs' narrow side (n_embd / tp).
double gemm_efficiency(int64_t rows, int64_t width);

// What the compute of a plan runs at on a GPU.
struct ComputeRates {
  double gemm_flops = 0;       // FLOP/s of the GEMMs, gemm_efficiency included
  double gemm_efficiency = 0;  // of gemm_peak_flops
  double gemm_peak_flops = 0;  // tensor peak; fp32: the CUDA cores' (no TF32)
  // --precision fp8: the FP8 GEMMs' FLOP/s (the FP8 peak, gemm_efficiency and
  // kFp8GemmFraction); 0 otherwise.
  double fp8_gemm_flops = 0;
  AttentionKernels attention = AttentionKernels::TensorCore;
  double attention_forward_flops = 0;  // FLOP/s of the attention kernels' executed FLOPs
  double attention_backward_flops = 0;
  double memory_bytes_per_s = 0;  // the memory-bound kernels'
};
ComputeRates compute_rates(const GpuSpeed& speed, const ModelConfig& config, const Plan& plan);

// Ring collective bandwidth (one direction, bytes/s) of a group of GPUs running at the same
// time as the other `busy` GPUs: the slowest hop of the ring group[0] -> group[1] -> ... ->
// group[0]. A hop without peer access is staged through host memory, so it also shares the
// upstream PCIe link of its switch with the busy GPUs under the same switch (PIX/PXB).
// `route` (optional) receives the slowest hop's description.
double ring_bandwidth(const NodeTopology& topology, const std::vector<int>& group,
                      const std::vector<int>& busy, std::string* route = nullptr);

// Tensor-parallel traffic of one micro-batch on one stage: the volume, in all-reduces of the
// (B*T, C) activations, and the number of collectives (each pays a latency).
struct TensorParallelTraffic {
  double all_reduces = 0;
  double collectives = 0;
};
// moe_layers: the range's mixture-of-experts layers, whose experts run whole on every tp rank:
// their MLP has no reduction (forward) and no summed input gradient (backward).
TensorParallelTraffic tensor_parallel_traffic(const Plan& plan, const StageRange& range,
                                              int64_t moe_layers = 0);
// The mixture-of-experts layers of `range` (0 for a dense model).
int64_t moe_layers_in(const ModelConfig& config, const StageRange& range);

// Expert parallelism's all-to-alls of one micro-batch on one stage: the bytes one rank sends
// (and receives) and the number of exchanges. Each MoE layer exchanges its tokens' k copies
// (k N rows of C) twice forward (to the experts and back) and twice backward (their gradients),
// and twice more under full recompute; with the routing balanced, (ep - 1) / ep of the rows
// leave the rank. Each exchange is preceded by one of the counts (latency only).
struct ExpertParallelTraffic {
  double bytes = 0;
  double exchanges = 0;
};
ExpertParallelTraffic expert_parallel_traffic(const ModelConfig& config, const Plan& plan,
                                              const StageRange& range);

struct StepCost {
  double step_seconds = 0;
  double tokens_per_second = 0;
  // Parts of step_seconds (they add up to it), on the slowest pipeline stage.
  double compute_seconds = 0;       // forward + backward + recompute of all micro-batches,
  double gemm_seconds = 0;          //   of which in the GEMMs,
  double attention_seconds = 0;     //   in the attention kernels,
  double memory_bound_seconds = 0;  //   in the memory-bound kernels (the three add up to it)
  double bubble_seconds = 0;        // pipeline fill and drain
  double tp_comm_seconds = 0;       // tensor-parallel collectives (never hidden)
  double ep_comm_seconds = 0;       // expert parallelism's all-to-alls (never hidden)
  double pp_comm_seconds = 0;       // pipeline sends (counted as not hidden)
  double dp_comm_seconds = 0;       // data-parallel / ZeRO collectives not hidden by compute
  double offload_seconds = 0;       // host transfers and the host optimizer step
  double optimizer_seconds = 0;     // the optimizer step on the device
  double efficiency = 0;            // the fraction of peak the GEMMs were given
  ComputeRates rates;               // what compute ran at
  std::string dp_route, tp_route, pp_route, host_route;  // slowest links, for people
  std::string ep_route;
};

// The most any one node holds of an amount every rank of a stage has (`per_stage`, one value
// per pipeline stage): rank r is on node r / gpus_per_node and in stage r / (dp x tp).
double fullest_node_total(const Plan& plan, int gpus_per_node,
                          const std::vector<double>& per_stage);

// `topology`: one node. REQUIRES: plan.world() <= topology.gpu_count() x cluster.nnodes (rank
// r is GPU r % G of node r / G), the plan is valid for the model (tp divides n_head, pp <=
// n_layer), GPU 0 is a known GPU. With one node (the default) rank r is GPU r.
StepCost predict_step_cost(const MemoryModel& memory, const NodeTopology& topology,
                           const Plan& plan, const ClusterShape& cluster = {});

}  // namespace dstrain
