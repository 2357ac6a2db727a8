// The cost model's pieces against their closed forms: FLOPs, ring bandwidths of real
// machines, collective volumes, the pipeline bubble, offload.
#include "parallel/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "parallel/model_flops.h"
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
  // GEMMs alone (attention and memory-bound kernels apart): 0.80 x 0.985 x 0.94.
  EXPECT_NEAR(gemm_efficiency(8192, 4096), 0.74, 0.01);
  EXPECT_LT(gemm_efficiency(1 << 30, 1 << 30), 0.801);
}

TEST(CostModel, PartsAddUpToTheStep) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const MemoryModel memory(load_model_config("6b"));
  for (int zero = 0; zero <= 3; ++zero) {
    for (const char* offload : {"none", "optimizer", "params", "all"}) {
      Plan p = bf16_plan(2, 2, 2, 2, 16);
      p.zero = zero;
      set_offload(p, offload);
      p.recompute = Recompute::Selective;
      const StepCost c = predict_step_cost(memory, h100, p);
      EXPECT_NEAR(c.step_seconds,
                  c.compute_seconds + c.bubble_seconds + c.tp_comm_seconds + c.pp_comm_seconds +
                      c.dp_comm_seconds + c.offload_seconds + c.optimizer_seconds,
                  1e-12 * c.step_seconds);
      EXPECT_NEAR(c.tokens_per_second * c.step_seconds, p.tokens_per_step(), 1e-6);
      EXPECT_EQ(c.offload_seconds > 0, p.offload || p.offload_params) << offload;
      EXPECT_EQ(c.optimizer_seconds > 0, !p.offload) << offload;
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

// Parameter offload on one RTX 4090 (PCIe 4.0 x16 to the host, 25.2 GB/s): every micro-batch
// brings the 7B's bf16 parameters up for the forward and its layers again for the backward (the
// untied head's block and the last layer are still in their buffers, the embedding's backward
// needs no weights), its gradient sums up (but in the first micro-batch) and down. Where a
// micro-batch computes for almost nothing the transfers are the step; at micro-batch 16 x 1024 they
// hide behind the compute.
TEST(CostModel, ParameterOffloadMovesEveryBlockTwiceAMicroBatch) {
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const MemoryModel memory(load_model_config("qwen2.5-7b"));
  Plan p = bf16_plan(1, 1, 1, 1, 4);
  set_offload(p, "all");
  p.recompute = Recompute::Full;
  p.seq_len = 8;  // almost no compute to hide behind
  const MemoryPrediction m = memory.predict(p);
  const double params = static_cast<double>(m.host[static_cast<size_t>(MemCategory::Parameters)]);
  const double grads = static_cast<double>(m.host[static_cast<size_t>(MemCategory::Gradients)]);
  const double rate = 25.2e9, micro_batches = 4;
  const std::vector<int64_t> numels = memory.stage_block_numels(p, 0);
  const double layers =  // all but the embedding, the final block and the last layer, bf16
      params - 2.0 * static_cast<double>(numels.front() + numels.back() + numels.end()[-2]);
  const StepCost tiny = predict_step_cost(memory, rtx4090, p);
  // Per micro-batch: every block up and those layers again, the sums up in 3 of 4, down in all;
  // per step the gradient check brings the gradients up once; the host's AdamW is the rest.
  const double transfers =
      (micro_batches * (params + layers + grads) + (micro_batches - 1) * grads + grads) / rate;
  // The host's AdamW: 28 bytes of traffic per parameter at 40 GB/s per NUMA node.
  const double host_step = params / 2 * 28 / (40e9 * rtx4090.numa_nodes);
  // Each window of compute hides as much of its transfers (all of it here: the windows are
  // shorter than the transfers).
  EXPECT_NEAR(tiny.offload_seconds, transfers + host_step - tiny.compute_seconds,
              0.01 * tiny.offload_seconds);
  EXPECT_GT(tiny.offload_seconds, 0.9 * tiny.step_seconds);
  // Long micro-batches hide them: what is left is the last block's share and the step's part.
  p.seq_len = 1024;
  p.micro_batch = 16;
  const StepCost big = predict_step_cost(memory, rtx4090, p);
  EXPECT_LT(big.offload_seconds, 0.1 * big.step_seconds);
  EXPECT_EQ(big.host_route.empty(), false);
}

TEST(CostModel, Fp32RunsAtHalfTheTensorPeak) {
  // MFU's peak: fp32 counts against the TF32 rate. The fp32 GEMMs themselves (no TF32) run on
  // the CUDA cores: the datasheet's 67 TFLOP/s.
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  EXPECT_DOUBLE_EQ(gpu_speed(h100, DType::BF16).peak_flops, 989.4e12);
  EXPECT_DOUBLE_EQ(gpu_speed(h100, DType::F32).peak_flops, 989.4e12 / 2);
  EXPECT_DOUBLE_EQ(gpu_speed(h100, DType::F32).fp32_flops, 67e12);
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
  // Its CUDA cores: 128 fp32 lanes per Hopper SM, 2 FLOPs each per clock, at the assumed
  // 1.7 GHz against its 1.98 GHz boost (datasheet: 67 TFLOP/s).
  EXPECT_NEAR(estimated.fp32_flops, 67e12, 0.15 * 67e12);
  // Nothing known about it at all: a stated assumption, still a plan.
  for (GpuInfo& gpu : machine_with_unknown.gpus) gpu.sm_count = 0;
  EXPECT_GT(gpu_speed(machine_with_unknown, DType::BF16).peak_flops, 0);
  EXPECT_NE(gpu_speed(machine_with_unknown, DType::BF16).estimate_note.find("assumed"),
            std::string::npos);
}

// ---- The compute terms: GEMMs, attention as the kernels run it, memory-bound kernels ----

// A GPT-2 block's shape written out: C 768, 12 heads of 64, vocabulary padded to 50304.
ModelConfig small_gpt2() { return load_model_config("gpt2-124m"); }

// A Llama block with grouped-query attention: 8 query heads of 64 sharing 2 key/value heads.
ModelConfig small_llama() {
  ModelConfig c = load_model_config("llama3.2-1b");
  c.n_embd = 512, c.n_head = 8, c.n_kv_head = 2, c.intermediate_size = 1536, c.n_layer = 4;
  c.qkv_bias = c.o_bias = c.mlp_bias = false;
  return c;
}

TEST(KernelWork, AttentionCountsTheTilesTheKernelsRun) {
  const ModelConfig gpt2 = small_gpt2();
  const double T = 1024, hd = 64, heads = 12, pair = 2 * hd * heads;  // one product, all heads
  // Tensor cores: the forward's warps own 16 query rows and run 16-key mma pairs up to the
  // diagonal: T (T + 16) / 2 pairs per head, (T + 16) / 2 per token; S and P V.
  const AttentionWork bf16 = attention_work(gpt2, 1024, DType::BF16);
  EXPECT_DOUBLE_EQ(bf16.forward, 2 * pair * (T + 16) / 2);
  // Backward at head dim 64: the dK/dV pass streams 64-query tiles (S, dP, dV, dK), the dQ pass
  // 16-row warps again (S, dP, dQ).
  EXPECT_DOUBLE_EQ(bf16.backward, 4 * pair * (T + 64) / 2 + 3 * pair * (T + 16) / 2);
  // The causal halving: against PaLM's 4 T q (the full T x T), a little over half.
  const double palm = model_flops(gpt2, 1024).attention_forward;
  EXPECT_DOUBLE_EQ(palm, 4 * T * hd * heads);
  EXPECT_DOUBLE_EQ(bf16.forward / palm, (T + 16) / (2 * T));
  // fp32 storage: the CUDA-core kernels' 32-row tiles, the same 2 + 7 products.
  const AttentionWork fp32 = attention_work(gpt2, 1024, DType::F32);
  EXPECT_DOUBLE_EQ(fp32.forward, 2 * pair * (T + 32) / 2);
  EXPECT_DOUBLE_EQ(fp32.backward, 7 * pair * (T + 32) / 2);
  EXPECT_EQ(attention_kernels(gpt2, DType::F32), AttentionKernels::CudaCore);
  EXPECT_EQ(attention_kernels(gpt2, DType::F16), AttentionKernels::TensorCore);
}

TEST(KernelWork, HeadDim256RunsTheScoresTwiceInTheDkDvPass) {
  // The 6b preset: 16 heads of 256. Two warps share 16 keys (each half of dK, dV's columns)
  // and both compute S^T and dP^T; 16-query tiles.
  const ModelConfig six_b = load_model_config("6b");
  const double T = 2048, pair = 2 * 256 * 16;
  const AttentionWork w = attention_work(six_b, 2048, DType::BF16);
  EXPECT_DOUBLE_EQ(w.forward, 2 * pair * (T + 16) / 2);
  EXPECT_DOUBLE_EQ(w.backward, (2 * 2 + 2) * pair * (T + 16) / 2 + 3 * pair * (T + 16) / 2);
  // A head dim the tensor-core kernels do not take: the CUDA-core kernels run it.
  ModelConfig odd = six_b;
  odd.n_head = 32, odd.n_embd = 32 * 96;
  EXPECT_EQ(attention_kernels(odd, DType::BF16), AttentionKernels::CudaCore);
}

TEST(KernelWork, LatentAttentionsHeadDim192RunsOnTensorCoresAsHeadDim256Does) {
  // DeepSeek-V2-Lite: 16 heads of qk dim 128 + 64 = 192 (v padded to it). The dK/dV pass splits
  // the columns over two warps as at 256 (S^T and dP^T twice), with 16-query tiles.
  const ModelConfig lite = load_model_config("deepseek-v2-lite");
  ASSERT_EQ(lite.attention_head_dim(), 192);
  EXPECT_EQ(attention_kernels(lite, DType::BF16), AttentionKernels::TensorCore);
  EXPECT_EQ(attention_kernels(lite, DType::F32), AttentionKernels::CudaCore);
  const double T = 1024, pair = 2 * 192 * 16;
  const AttentionWork w = attention_work(lite, 1024, DType::BF16);
  EXPECT_DOUBLE_EQ(w.forward, 2 * pair * (T + 16) / 2);
  EXPECT_DOUBLE_EQ(w.backward, (2 * 2 + 2) * pair * (T + 16) / 2 + 3 * pair * (T + 16) / 2);
}

// Latent attention under --precision fp8: its o projection (heads x v_dim -> C) runs in FP8, as
// the decoder runs it, its latent path in bf16; the dense first layer's MLP (a 27th of each
// layer's mean) in FP8, the experts not. The FP8 FLOPs and the casts' bytes count exactly that.
TEST(KernelWork, LatentAttentionsOProjectionRunsInFp8) {
  const ModelConfig lite = load_model_config("deepseek-v2-lite");
  const DecoderParts parts = decoder_parts(lite);
  const MlpPart& dense = parts.layer_mlp(0);
  ASSERT_EQ(dense.kind, MlpKind::SwiGLU);
  ASSERT_EQ(parts.layer_mlp(1).kind, MlpKind::MoE);
  const double C = 2048, out = 16 * 128, I = static_cast<double>(dense.width), L = 27, N = 1024;
  ASSERT_EQ(parts.attention.out_width(), out);
  EXPECT_DOUBLE_EQ(model_flops(lite, 1024).layer_fp8_gemm_forward,
                   2 * out * C + (2 * C * 2 * I + 2 * I * C) / L);
  const Fp8CastBytes b = fp8_cast_bytes(lite, 1, DType::BF16, N, false);
  // o: input 5 (forward) and 3 (backward), dout 6, weight 5 and 5; up: dout found (4); down:
  // input found (3 forward).
  EXPECT_DOUBLE_EQ(b.forward, 5 * N * out + 5 * out * C +
                                  (5 * N * C + 5 * C * 2 * I + 3 * N * I + 5 * I * C) / L);
  EXPECT_DOUBLE_EQ(
      b.backward,
      6 * N * C + 3 * N * out + 5 * out * C +
          (4 * N * 2 * I + 3 * N * C + 5 * C * 2 * I + 6 * N * C + 3 * N * I + 5 * I * C) / L);
}

TEST(KernelWork, GroupedQueryAttentionCostsItsQueryHeads) {
  // Key/value heads shared by 4 query heads: the same pairs per query head as full multi-head.
  ModelConfig gqa = small_llama();
  ModelConfig mha = gqa;
  mha.n_kv_head = mha.n_head;
  EXPECT_DOUBLE_EQ(attention_work(gqa, 512, DType::BF16).forward,
                   attention_work(mha, 512, DType::BF16).forward);
  EXPECT_DOUBLE_EQ(attention_work(gqa, 512, DType::BF16).backward,
                   attention_work(mha, 512, DType::BF16).backward);
}

TEST(KernelWork, MemoryTrafficOfAGpt2Block) {
  // Per token, in elements, C = 768, MLP 4C: forward the first layernorm (read + write C), the
  // second with the residual add before it fused (a, b read, residual and norm written: 4C; C
  // <= 8192), the last residual add (2 read + 1 written) and the GELU (4C read, 4C written);
  // backward two layernorm backwards (dout, inp, dinp read, dinp written, then dout and inp
  // again for dweight/dbias: 6C), the attention's delta (O read by the dQ kernel, which holds
  // dO already: C), GELU backward (3 x 4C, the fc bias's 4C column sums in its pass) and the
  // other bias gradients (qkv 3C, attention projection C, fc projection C, one read each).
  const ModelConfig gpt2 = small_gpt2();
  const double C = 768, Vp = 50304;
  const MemoryTraffic t = memory_traffic(gpt2, 1, false);
  EXPECT_DOUBLE_EQ(t.layer_forward, 2 * C + 4 * C + 3 * C + 2 * 4 * C);
  EXPECT_DOUBLE_EQ(t.layer_backward, 2 * 6 * C + C + 3 * 4 * C + (3 + 1 + 1) * C);
  EXPECT_DOUBLE_EQ(t.layer_selective, 2 * 2 * C + 2 * 4 * C);
  EXPECT_DOUBLE_EQ(t.embed_forward, 3 * C);  // wte and wpe rows read, the sum written
  // The final layernorm, and the softmax + cross-entropy reading the logits twice and writing
  // their gradient; backward the layernorm's 6C and zeroing its input gradient.
  EXPECT_DOUBLE_EQ(t.head_forward, 2 * C + 3 * Vp);
  EXPECT_DOUBLE_EQ(t.head_backward, 7 * C);
  // tp 2 with sequence parallelism: the MLP, the heads and the vocabulary split; the norm and
  // residual rows split too; the two row-parallel biases are added after the reduction.
  const MemoryTraffic sp = memory_traffic(gpt2, 2, true);
  EXPECT_DOUBLE_EQ(sp.layer_forward, (2 + 4 + 3) * C / 2 + 2 * 4 * C / 2 + 2 * 2 * C / 2);
  EXPECT_DOUBLE_EQ(sp.layer_backward, 2 * 6 * C / 2 + C / 2 + 3 * 4 * C / 2 + 3 * C / 2 + 2 * C);
  EXPECT_DOUBLE_EQ(sp.head_forward, 2 * C / 2 + 3 * Vp / 2);
  // Without sequence parallelism the norm and residual rows are whole on every tp rank.
  const MemoryTraffic no_sp = memory_traffic(gpt2, 2, false);
  EXPECT_DOUBLE_EQ(no_sp.layer_forward, (2 + 4 + 3) * C + 2 * 4 * C / 2 + 2 * 2 * C);
  // 6b's rows (4096) fit the registers (a block of 8 warps per row): the residual add fused.
  const ModelConfig six_b = load_model_config("6b");
  EXPECT_DOUBLE_EQ(memory_traffic(six_b, 1, false).layer_forward,
                   (2 + 4 + 3) * 4096.0 + 2 * 4 * 4096.0);
  // Rows above 8192 do not: the residual add and the norm run apart.
  ModelConfig wide = six_b;
  wide.n_embd = 12288;
  EXPECT_DOUBLE_EQ(memory_traffic(wide, 1, false).layer_forward,
                   (2 * 2 + 2 * 3) * 12288.0 + 2 * 4 * 12288.0);
}

TEST(KernelWork, MemoryTrafficOfALlamaBlock) {
  // C 512, q 512, kv 128, I 1536, no biases: RMSNorms and residuals as GPT-2's; rope in place
  // on q and k (read + write); SwiGLU reads gate and up and writes I, backward reads dout, gate,
  // up and writes dgate, dup; no wpe in the embedding.
  const ModelConfig llama = small_llama();
  const double C = 512, q = 512, kv = 128, I = 1536;
  const MemoryTraffic t = memory_traffic(llama, 1, false);
  EXPECT_DOUBLE_EQ(t.layer_forward, 2 * C + 4 * C + 3 * C + 2 * (q + kv) + 3 * I);
  EXPECT_DOUBLE_EQ(t.layer_backward, 2 * 6 * C + q + 2 * (q + kv) + 5 * I);
  EXPECT_DOUBLE_EQ(t.layer_selective, 2 * 2 * C + 3 * I);
  EXPECT_DOUBLE_EQ(t.embed_forward, 2 * C);
}

// --precision fp8's casts in a LLaMA block (bf16 storage), per micro-batch of N tokens: qkv
// (C -> q + 2 kv) and o (q -> C) as GPT-2's; the SwiGLU MLP's casts read once what SwiGLU found
// the amax of: down's input forward (2 + 1 bytes) and up's dout (2 + 2 written). The weights
// cached: 6 bytes an element once a step; else 5 forward and 5 backward.
TEST(KernelWork, Fp8CastBytesOfALlamaBlock) {
  const ModelConfig llama = small_llama();
  const double C = 512, q = 512, kv = 128, I = 1536, N = 4096;
  const double ins[] = {C, q, C, I}, outs[] = {q + 2 * kv, C, 2 * I, C};
  for (bool cached : {false, true}) {
    const Fp8CastBytes b = fp8_cast_bytes(llama, 1, DType::BF16, N, cached);
    double forward = 0, backward = 0, step = 0;
    for (int i = 0; i < 4; ++i) {
      const bool down = i == 3, up = i == 2;
      forward += (down ? 3 : 5) * N * ins[i];
      backward += (up ? 4 : 6) * N * outs[i] + 3 * N * ins[i];
      if (cached) {
        step += 6 * ins[i] * outs[i];
      } else {
        forward += 5 * ins[i] * outs[i];
        backward += 5 * ins[i] * outs[i];
      }
    }
    EXPECT_DOUBLE_EQ(b.forward, forward) << cached;
    EXPECT_DOUBLE_EQ(b.backward, backward) << cached;
    EXPECT_DOUBLE_EQ(b.weights_per_step, step) << cached;
  }
}

// The compute of a micro-batch on one RTX 4090 (165.2 TFLOP/s bf16, 1008 GB/s), by hand.
TEST(CostModel, ComputeIsGemmsPlusAttentionPlusMemoryBound) {
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const ModelConfig gpt2 = small_gpt2();
  const MemoryModel memory(gpt2);
  Plan p = bf16_plan(1, 1, 1, 4, 2);  // 4 x 1024 tokens, 2 micro-batches
  const StepCost c = predict_step_cost(memory, rtx4090, p);
  const double L = 12, C = 768, Vp = 50304, T = 1024, tokens = 4 * T, m = 2, peak = 165.2e12;
  const double gemm_rate = peak * 0.80 * tokens / (tokens + 128) * C / (C + 256);
  const double gemm_flops = 3 * tokens * (L * 24 * C * C + 2 * C * Vp);  // forward + 2x backward
  EXPECT_NEAR(c.gemm_seconds, m * gemm_flops / gemm_rate, 1e-9 * c.gemm_seconds);
  const double pair = 2 * 64 * 12;
  const double attention_forward = tokens * L * 2 * pair * (T + 16) / 2;
  const double attention_backward =
      tokens * L * (4 * pair * (T + 64) / 2 + 3 * pair * (T + 16) / 2);
  EXPECT_NEAR(c.attention_seconds,
              m * (attention_forward / (peak * 0.377) + attention_backward / (peak * 0.384)),
              1e-9 * c.attention_seconds);
  // Per token: a layer's forward 17C and backward 30C (MemoryTrafficOfAGpt2Block), the
  // embedding, the head.
  const double elements = L * (17 * C + 30 * C) + 3 * C + 3 * C + 2 * C + 3 * Vp + 7 * C;
  EXPECT_NEAR(c.memory_bound_seconds, m * tokens * 2 * elements / (1008e9 * 0.8),
              1e-9 * c.memory_bound_seconds);
  EXPECT_NEAR(c.compute_seconds, c.gemm_seconds + c.attention_seconds + c.memory_bound_seconds,
              1e-12 * c.compute_seconds);
  // Recompute: full runs the layers' forward again (GEMMs, attention forward, memory-bound
  // forward); selective only the norms and the GELU.
  p.recompute = Recompute::Selective;
  const StepCost selective = predict_step_cost(memory, rtx4090, p);
  EXPECT_DOUBLE_EQ(selective.gemm_seconds, c.gemm_seconds);
  EXPECT_NEAR(selective.memory_bound_seconds - c.memory_bound_seconds,
              m * tokens * 2 * L * 12 * C / (1008e9 * 0.8), 1e-9 * c.memory_bound_seconds);
  p.recompute = Recompute::Full;
  const StepCost full = predict_step_cost(memory, rtx4090, p);
  EXPECT_NEAR(full.attention_seconds - c.attention_seconds, m * attention_forward / (peak * 0.377),
              1e-9 * c.attention_seconds);
  EXPECT_NEAR(full.gemm_seconds - c.gemm_seconds, m * tokens * L * 24 * C * C / gemm_rate,
              1e-9 * c.gemm_seconds);
}

// --precision fp8 on an RTX 4090 (FP8 330.3 TFLOP/s with fp32 accumulation against 165.2):
// the layers' GEMMs (GPT-2: all of a layer's 24 C^2) at the FP8 peak x the efficiency x 0.87
// (cuBLASLt's FP8 against cuBLAS's bf16 on an H100), the head's in bf16; the casts' bytes added
// to the memory-bound kernels: a cast reads 2 + 2 bytes and writes 1 an element (each linear's
// input forward; backward again, reading 2 only: forward's amax kept), dout's reads 2 + 2 bytes
// and writes 2 (both its layouts at once). The weights: under ZeRO-3 cast like the inputs at each
// use (5 bytes an element, forward and backward, every micro-batch); at ZeRO-0 kept, cast once a
// step into both layouts (6 bytes an element).
TEST(CostModel, Fp8RunsTheLayersGemmsAtTheFp8RateAndPaysForTheCasts) {
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const ModelConfig gpt2 = small_gpt2();
  const MemoryModel memory(gpt2);
  EXPECT_DOUBLE_EQ(gpu_speed(rtx4090, DType::BF16).fp8_flops, 330.3e12);
  const double L = 12, C = 768, Vp = 50304, T = 1024, tokens = 4 * T, m = 2;
  const double efficiency = 0.80 * tokens / (tokens + 128) * C / (C + 256);
  const double bf16_rate = 165.2e12 * efficiency, fp8_rate = 330.3e12 * efficiency * 0.87;
  // (in, out) of qkv, o, fc, proj: (C, 3C), (C, C), (C, 4C), (4C, C).
  const double ins[] = {C, C, C, 4 * C}, outs[] = {3 * C, C, 4 * C, C};
  for (int zero : {0, 3}) {
    Plan p = bf16_plan(1, 1, 1, 4, 2);
    p.zero = zero;
    const StepCost bf16 = predict_step_cost(memory, rtx4090, p);
    p.fp8 = true;
    const StepCost fp8 = predict_step_cost(memory, rtx4090, p);
    EXPECT_NEAR(fp8.gemm_seconds,
                m * 3 * tokens * (L * 24 * C * C / fp8_rate + 2 * C * Vp / bf16_rate),
                1e-9 * fp8.gemm_seconds);
    double micro_batch_bytes = 0, step_bytes = 0;
    for (int i = 0; i < 4; ++i) {
      micro_batch_bytes += (5 + 3) * tokens * ins[i] + 6 * tokens * outs[i];
      if (zero == 3) {
        micro_batch_bytes += 2 * 5 * ins[i] * outs[i];
      } else {
        step_bytes += 6 * ins[i] * outs[i];
      }
    }
    EXPECT_NEAR(fp8.memory_bound_seconds - bf16.memory_bound_seconds,
                L * (m * micro_batch_bytes + step_bytes) / (1008e9 * 0.8),
                1e-9 * bf16.memory_bound_seconds)
        << "ZeRO-" << zero;
    EXPECT_DOUBLE_EQ(fp8.attention_seconds, bf16.attention_seconds);
    EXPECT_LT(fp8.step_seconds, bf16.step_seconds);
  }
}

TEST(CostModel, ComputePartsAddUpAcrossPlans) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  for (const char* model : {"6b", "deepseek-7b"}) {
    const MemoryModel memory(load_model_config(model));
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      Plan p = bf16_plan(2, 2, 2, 2, 8);
      p.recompute = r;
      const StepCost c = predict_step_cost(memory, h100, p);
      EXPECT_GT(c.gemm_seconds, 0);
      EXPECT_GT(c.attention_seconds, 0);
      EXPECT_GT(c.memory_bound_seconds, 0);
      EXPECT_NEAR(c.compute_seconds, c.gemm_seconds + c.attention_seconds + c.memory_bound_seconds,
                  1e-12 * c.compute_seconds)
          << model;
    }
  }
}

TEST(CostModel, AttentionGrowsAsTSquaredAndGemmsAsT) {
  // One sequence per micro-batch, 4x longer: the GEMMs' work grows 4x (their efficiency a
  // little too, with more rows), the attention's about 16x.
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const MemoryModel memory(load_model_config("gpt2-1.5b"));
  Plan p = bf16_plan(1, 1, 1, 1, 1);
  p.seq_len = 256;
  const StepCost short_seq = predict_step_cost(memory, rtx4090, p);
  p.seq_len = 1024;
  const StepCost long_seq = predict_step_cost(memory, rtx4090, p);
  const double gemm_growth = long_seq.gemm_seconds / short_seq.gemm_seconds;
  const double attention_growth = long_seq.attention_seconds / short_seq.attention_seconds;
  const double efficiency_gain = gemm_efficiency(1024, 1600) / gemm_efficiency(256, 1600);
  EXPECT_NEAR(gemm_growth, 4 / efficiency_gain, 1e-9);
  // 4 x (1024 + g) / (256 + g) with the tiles' g of 16 and 64: between 13.6 and 15.3.
  EXPECT_GT(attention_growth, 13.6);
  EXPECT_LT(attention_growth, 15.3);
  EXPECT_NEAR(long_seq.memory_bound_seconds / short_seq.memory_bound_seconds, 4, 1e-9);
}

TEST(CostModel, Fp32AttentionRunsOnCudaCoresSlowerThanBf16) {
  // fp32 storage: the CUDA-core kernels at 10% of the 4090's 82.6 TFLOP/s fp32, against the
  // tensor-core kernels' measured 29% / 27% of 165.2 (head dim 64).
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  const MemoryModel memory(load_model_config("gpt2-124m"));
  Plan p = bf16_plan(1, 1, 1, 4, 1);
  const StepCost bf16 = predict_step_cost(memory, rtx4090, p);
  p.param_dtype = DType::F32;
  const StepCost fp32 = predict_step_cost(memory, rtx4090, p);
  EXPECT_EQ(bf16.rates.attention, AttentionKernels::TensorCore);
  EXPECT_EQ(fp32.rates.attention, AttentionKernels::CudaCore);
  EXPECT_DOUBLE_EQ(fp32.rates.attention_forward_flops, 82.6e12 * 0.10);
  EXPECT_GT(fp32.attention_seconds, 5 * bf16.attention_seconds);
  // fp32 GEMMs: exact fp32 on the CUDA cores, not TF32.
  EXPECT_DOUBLE_EQ(fp32.rates.gemm_peak_flops, 82.6e12);
  // Twice the bytes for the memory-bound kernels.
  EXPECT_NEAR(fp32.memory_bound_seconds, 2 * bf16.memory_bound_seconds,
              1e-12 * fp32.memory_bound_seconds);
}

TEST(CostModel, TensorParallelismSplitsHeadsAndSequenceParallelismTheNorms) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const MemoryModel memory(load_model_config("6b"));
  const StepCost tp1 = predict_step_cost(memory, h100, bf16_plan(1, 1, 1, 2, 4));
  Plan p = bf16_plan(1, 2, 1, 2, 4);
  p.sequence_parallel = false;
  const StepCost tp2 = predict_step_cost(memory, h100, p);
  p.sequence_parallel = true;
  const StepCost tp2_sp = predict_step_cost(memory, h100, p);
  // Heads split: half the attention per rank, at the same rates.
  EXPECT_NEAR(tp2.attention_seconds, tp1.attention_seconds / 2, 1e-12 * tp1.attention_seconds);
  // The norm and residual rows split only with sequence parallelism.
  EXPECT_LT(tp2_sp.memory_bound_seconds, tp2.memory_bound_seconds);
  EXPECT_LT(tp2.memory_bound_seconds, tp1.memory_bound_seconds);
  EXPECT_DOUBLE_EQ(tp2_sp.attention_seconds, tp2.attention_seconds);
}

// Latent attention under tp: the heads' projections split, the latent path (q_a, kv_a) runs
// whole on every rank: per rank half of tp 1's GEMMs plus half of that path's again.
TEST(CostModel, TensorParallelLatentAttentionRepeatsTheLatentPath) {
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const ModelConfig config = model_config_from_json(R"({"model_type": "deepseek_v3",
    "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
    "q_lora_rank": 768, "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128})",
                                                    "mla");
  const MemoryModel memory(config);
  const StepCost tp1 = predict_step_cost(memory, h100, bf16_plan(1, 1, 1, 2, 4));
  const StepCost tp2 = predict_step_cost(memory, h100, bf16_plan(1, 2, 1, 2, 4));
  // tp 1's GEMM rate from its FLOPs (forward + 2x backward, 4 micro-batches of 2 x 1024); tp
  // 2's, at half the width, by gemm_efficiency's width factor w / (w + 256).
  const double C = 2048, tokens = 2 * 1024, m = 4, L = 8;
  const ModelFlops f = model_flops(config, 1024);
  const double flops1 = m * 3 * tokens * (L * f.layer_gemm_forward + f.head_forward);
  const double rate1 = flops1 / tp1.gemm_seconds;
  const double rate2 = rate1 * (C / 2 / (C / 2 + 256)) / (C / (C + 256));
  const double latent = 2 * C * (768 + 256 + 64);  // q_a, kv_a per token
  EXPECT_NEAR(tp2.gemm_seconds, (flops1 / 2 + m * 3 * (tokens / 2) * L * latent) / rate2,
              1e-9 * tp1.gemm_seconds);
}

TEST(CostModel, HopperRunsMmaSyncAttentionBelowItsPeak) {
  // FlashAttention-2's 335 TFLOP/s on an H100 (34% of 989.4) against 73% on an A100.
  const NodeTopology h100 = machine("h100-8gpu-nvswitch.txt", "h100-sxm");
  const GpuSpeed speed = gpu_speed(h100, DType::BF16);
  EXPECT_NEAR(speed.mma_sync_fraction, 335 / 989.4 / 0.73, 1e-12);
  const NodeTopology rtx4090 = machine("rtx4090-8gpu-pcie.txt", "rtx4090");
  EXPECT_DOUBLE_EQ(gpu_speed(rtx4090, DType::BF16).mma_sync_fraction, 1.0);
}

TEST(CostModel, AttentionRatesAreTheOnesMeasuredOnAnH200) {
  // bench_cuda_ops on an H200 (the H100 SXM's tensor rate), 2026-11-26 at commit ba5f4b5:
  // forward / backward TFLOP/s on the FLOPs the kernels execute, per head dim
  // (benchmarks/RESULTS.md).
  const GpuSpeed speed = gpu_speed(machine("h100-8gpu-nvswitch.txt", "h100-sxm"), DType::BF16);
  struct Measured {
    const char* model;
    int64_t head_dim;
    double forward, backward;
  };
  const Measured measured[] = {{"gpt2-1.5b", 64, 173.2e12, 176.3e12},
                               {"6b", 256, 139.8e12, 130.8e12}};
  for (const Measured& m : measured) {
    const ModelConfig config = load_model_config(m.model);
    ASSERT_EQ(config.head_dim(), m.head_dim) << m.model;
    const ComputeRates r = compute_rates(speed, config, bf16_plan(1, 1, 1, 1, 1));
    EXPECT_NEAR(r.attention_forward_flops / m.forward, 1, 0.005) << m.model;
    EXPECT_NEAR(r.attention_backward_flops / m.backward, 1, 0.005) << m.model;
  }
}

}  // namespace
}  // namespace dstrain
