// The cost model's pieces against their closed forms: FLOPs, ring bandwidths of real
// machines, collective volumes, the pipeline bubble, offload.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "parallel/cost_model.h"
#include "test_machines.h"
#include "topology/bandwidth.h"

namespace dstrain {
namespace {

NodeTopology machine(const std::string& fixture, const std::string& gpu,
                     const std::string& host_memory = "256G") {
  return testing::fixture_machine(fixture, gpu, host_memory);
}

std::vector<int> range(int n) {
  std::vector<int> r;
  for (int i = 0; i < n; ++i) r.push_back(i);
  return r;
}

using testing::bf16_plan;

TEST(CostModel, FlopsFollowPalmsFormula) {
  // PaLM appendix B: 6N + 12 L T C per token for forward + backward, N the matmul weights
  // (12 L C^2 for the layers, C Vp for the tied head).
  const ModelConfig config = load_model_config("gpt2-124m");
  const ModelFlops f = model_flops(config, 1024);
  const double L = 12, C = 768, T = 1024, Vp = 50304;
  const double per_token = 3 * (L * f.layer_forward + f.head_forward);
  EXPECT_DOUBLE_EQ(per_token, 6 * (12 * L * C * C + C * Vp) + 12 * L * T * C);
  // What MFU counts (the trainer's step records on a GPU).
  EXPECT_DOUBLE_EQ(training_flops_per_token(config, 1024), per_token);
}

TEST(CostModel, RingBandwidthOfRealMachines) {
  const double gen4 = pcie_achievable_bytes_per_s(4, 16);
  // 8 x RTX 4090: no peer access, so each hop goes through host memory, and the four GPUs
  // under one PCIe switch (PIX) share its uplink while all of them run the ring.
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  std::string route;
  EXPECT_DOUBLE_EQ(ring_bandwidth(rtx4090, range(8), range(8), &route), gen4 / 4);
  EXPECT_NE(route.find("shared by 4 GPUs"), std::string::npos) << route;
  // Two of them alone: staged through host at half the PCIe rate (bandwidth.h).
  EXPECT_DOUBLE_EQ(ring_bandwidth(rtx4090, {0, 1}, {0, 1}), gen4 / 2);
  // 8 x H100 on NVSwitch: 18 NVLinks x 25 GB/s x 0.8.
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  EXPECT_DOUBLE_EQ(ring_bandwidth(h100, range(8), range(8)), 18 * 25e9 * 0.8);
  // 4 x RTX 3090 in NVLink pairs: inside a pair NV4 (4 x 14.0625 GB/s x 0.8); the ring over
  // all four crosses PHB without peer access (half of gen4), no switch to share.
  const NodeTopology rtx3090 = machine("rtx3090-4gpu-nvlink-pairs.txt", "rtx3090");
  EXPECT_DOUBLE_EQ(ring_bandwidth(rtx3090, {0, 1}, range(4)), 4 * 14.0625e9 * 0.8);
  EXPECT_DOUBLE_EQ(ring_bandwidth(rtx3090, range(4), range(4)), gen4 / 2);
}

TEST(CostModel, EfficiencyGrowsWithGemmSizeAndStaysBelowPeak) {
  EXPECT_LT(gemm_efficiency(1024, 768), gemm_efficiency(8192, 768));
  EXPECT_LT(gemm_efficiency(8192, 512), gemm_efficiency(8192, 4096));
  EXPECT_NEAR(gemm_efficiency(8192, 4096), 0.5, 0.02);  // "0.5 of peak for large steps"
  EXPECT_LT(gemm_efficiency(1 << 30, 1 << 30), 0.56);
}

TEST(CostModel, PartsAddUpToTheStep) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const MemoryModel memory(load_model_config("6b"));
  for (int zero = 0; zero <= 3; ++zero) {
    for (bool offload : {false, true}) {
      Plan p = bf16_plan(2, 2, 2, 2, 16);
      p.zero = zero;
      p.offload = offload;
      p.recompute = Recompute::Selective;
      const StepCost c = predict_step_cost(memory, h100, p);
      EXPECT_NEAR(c.step_seconds,
                  c.compute_seconds + c.bubble_seconds + c.tp_comm_seconds + c.pp_comm_seconds +
                      c.dp_comm_seconds + c.offload_seconds + c.optimizer_seconds,
                  1e-12 * c.step_seconds);
      EXPECT_NEAR(c.tokens_per_second * c.step_seconds, p.tokens_per_step(), 1e-6);
      EXPECT_EQ(c.offload_seconds > 0, offload);
      EXPECT_EQ(c.optimizer_seconds > 0, !offload);
    }
  }
}

TEST(CostModel, PipelineBubbleIsPpMinusOneOverMPlusPpMinusOne) {
  // One data-parallel rank, no tensor parallelism: the micro-batch time is compute plus the
  // pipeline sends, and the bubble is (pp - 1) of (m + pp - 1) of those slots.
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const MemoryModel memory(load_model_config("6b"));
  for (int pp : {2, 4, 8}) {
    for (int64_t m : {1, 8, 64}) {
      const StepCost c = predict_step_cost(memory, h100, bf16_plan(1, 1, pp, 1, m));
      const double slots = c.compute_seconds + c.pp_comm_seconds + c.bubble_seconds;
      EXPECT_NEAR(c.bubble_seconds / slots, double(pp - 1) / double(m + pp - 1), 1e-12)
          << "pp " << pp << " m " << m;
    }
  }
}

TEST(CostModel, TensorParallelAllReducesFourTimesPerLayer) {
  // tp 2 inside each NVLink pair of the 3090 machine, without sequence parallelism: 4
  // all-reduces of (B, T, C) bf16 per layer per micro-batch (2 forward, 2 backward) and one
  // each for the embedding and the head, a 2-rank ring moving 2(2-1)/2 = 1 buffer, plus 20 us
  // per collective and one more latency for the loss's statistics; full recompute adds the
  // forward's two again. Sequence parallelism turns each all-reduce into a reduce-scatter and
  // an all-gather (the same volume, twice the latencies) and gathers the two column-parallel
  // inputs again in backward (one more volume).
  const NodeTopology rtx3090 = machine("rtx3090-4gpu-nvlink-pairs.txt", "rtx3090");
  const ModelConfig config = load_model_config("6b");
  const MemoryModel memory(config);
  Plan p = bf16_plan(2, 2, 1, 1, 8);
  p.sequence_parallel = false;
  const double bytes = 1024.0 * 4096 * 2, rate = 4 * 14.0625e9 * 0.8;
  const double volume = bytes / rate, latency = 20e-6;
  EXPECT_NEAR(predict_step_cost(memory, rtx3090, p).tp_comm_seconds,
              8 * ((28 * 4 + 2) * (volume + latency) + latency), 1e-9);
  p.recompute = Recompute::Full;
  EXPECT_NEAR(predict_step_cost(memory, rtx3090, p).tp_comm_seconds,
              8 * ((28 * 6 + 2) * (volume + latency) + latency), 1e-9);
  p.recompute = Recompute::None;
  p.sequence_parallel = true;
  EXPECT_NEAR(predict_step_cost(memory, rtx3090, p).tp_comm_seconds,
              8 * ((28 * 5 + 2) * volume + (28 * 10 + 5) * latency), 1e-9);
}

TEST(CostModel, Zero3OnPcieExposesMoreCommunicationThanZero1) {
  // ZeRO-3 gathers every block twice per micro-batch (forward, backward) and reduce-scatters
  // once; ZeRO-1 reduces once per step. On the 4090 machine's ~6 GB/s ring, small
  // micro-batches cannot hide ZeRO-3's traffic.
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const MemoryModel memory(load_model_config("gpt2-1.5b"));
  Plan p = bf16_plan(8, 1, 1, 1, 64);
  p.zero = 1;
  const StepCost zero1 = predict_step_cost(memory, rtx4090, p);
  p.zero = 3;
  const StepCost zero3 = predict_step_cost(memory, rtx4090, p);
  EXPECT_GT(zero3.dp_comm_seconds, 10 * zero1.dp_comm_seconds);
  EXPECT_DOUBLE_EQ(zero3.compute_seconds, zero1.compute_seconds);
}

TEST(CostModel, HostOptimizerScalesWithNumaNodes) {
  NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const MemoryModel memory(load_model_config("6b"));
  Plan p = bf16_plan(8, 1, 1, 1, 64);
  p.zero = 3;
  p.offload = true;
  const double two_sockets = predict_step_cost(memory, rtx4090, p).offload_seconds;
  rtx4090.numa_nodes = 1;
  const double one_socket = predict_step_cost(memory, rtx4090, p).offload_seconds;
  EXPECT_GT(one_socket, two_sockets);
  // The host step: 28 bytes of AdamW traffic per parameter (fp32 master, m, v read and
  // written; bf16 grad read, param written) over 40 GB/s per NUMA node.
  const double psi = static_cast<double>(ParamLayout(load_model_config("6b")).total_numel());
  EXPECT_NEAR(one_socket - two_sockets, psi * 28 / 40e9 - psi * 28 / 80e9, 0.02 * psi * 28 / 80e9);
}

TEST(CostModel, Fp32RunsAtHalfTheTensorPeak) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  EXPECT_DOUBLE_EQ(gpu_speed(h100, DType::BF16).peak_flops, 989.4e12);
  EXPECT_DOUBLE_EQ(gpu_speed(h100, DType::F32).peak_flops, 989.4e12 / 2);
  EXPECT_TRUE(gpu_speed(h100, DType::BF16).estimate_note.empty());
}

TEST(CostModel, UnknownGpuIsEstimatedFromItsSmsAndComputeCapability) {
  // A GPU newer than the table trains with no flags: its peak comes from its architecture's
  // tensor FLOPs per SM per clock. Checked against a known GPU: an H100 SXM described only by
  // its SMs and compute capability lands within 10% of its table peak (989.4 TFLOP/s).
  NodeTopology machine_with_unknown = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  for (GpuInfo& gpu : machine_with_unknown.gpus) {
    gpu.name = "NVIDIA H100 Next";
    gpu.sm_count = 132;
    gpu.cc_major = 9;
    gpu.cc_minor = 0;
  }
  const GpuSpeed estimated = gpu_speed(machine_with_unknown, DType::BF16);
  EXPECT_NEAR(estimated.peak_flops, 989.4e12, 0.1 * 989.4e12);
  EXPECT_NE(estimated.estimate_note.find("NVIDIA H100 Next"), std::string::npos);
  EXPECT_NE(estimated.estimate_note.find("--gpu"), std::string::npos);
  EXPECT_DOUBLE_EQ(gpu_speed(machine_with_unknown, DType::F32).peak_flops,
                   estimated.peak_flops / 2);
  // Nothing known about it at all: a stated assumption, still a plan.
  for (GpuInfo& gpu : machine_with_unknown.gpus) gpu.sm_count = 0;
  EXPECT_GT(gpu_speed(machine_with_unknown, DType::BF16).peak_flops, 0);
  EXPECT_NE(gpu_speed(machine_with_unknown, DType::BF16).estimate_note.find("assumed"),
            std::string::npos);
}

}  // namespace
}  // namespace dstrain
