#include "parallel/cost_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "core/check.h"
#include "model/parts.h"
#include "topology/bandwidth.h"
#include "topology/gpu_table.h"

namespace dstrain {

namespace {

// ---- Constants ------------------------------------------------------------------------------

// ASSUMPTION: the best fraction of peak FLOP/s the GEMMs (cuBLAS, cuBLASLt) reach, before the
// shape penalties of gemm_efficiency: 0.80, the low end of the "80-90% of the theoretical
// maximum device throughput" of optimized GEMMs (Dao, "FlashAttention-2", 2023, section 1).
// With 8192-token micro-batches and n_embd 4096 the model gives 0.80 x 0.985 x 0.94 = 0.74.
// The attention and the memory-bound kernels are timed apart (below); launch gaps are not
// modelled.
constexpr double kMaxPeakFraction = 0.80;
// ASSUMPTION: GEMM utilization halves at 128 rows (tokens per micro-batch) and at a narrow side
// of 256 (n_embd / tp): small GEMMs cannot fill the SMs' tiles (a 128x256 tile grid of a
// 128 x 256 output is one tile for 100+ SMs). Shape of the curve: x / (x + half). With
// seq_len 1024 a micro-batch has at least 1024 rows (0.89); 8192 rows give 0.985: past a few
// thousand rows a bigger micro-batch buys little, as cuBLAS throughput curves show.
constexpr double kHalfEfficiencyRows = 128;
constexpr double kHalfEfficiencyWidth = 256;

// ASSUMPTION: MFU's peak for fp32 is the TF32 tensor rate, half the dense fp16/bf16 rate (A100
// datasheet: TF32 156 vs BF16 312 TFLOPS; H100 SXM: 494.7 vs 989.4 dense). dstrain's fp32 GEMMs
// do not use it (cuda_matmul.cu: exact fp32, no TF32): the cost model times them on the CUDA
// cores (GpuSpeed::fp32_flops).
constexpr double kFp32PeakFraction = 0.5;

// MEASURED: what the FP8 GEMMs reach of the FP8 peak, as a fraction of what the bf16 GEMMs
// reach of theirs. bench_cuda_ops on an H100 SXM (2026-11-27, benchmarks/RESULTS.md), 8192
// tokens x 2048 -> 8192: cuBLASLt's e4m3 GEMM 1272.0 TFLOP/s (64.3% of 1978.9), cuBLAS's bf16
// 729.6 (73.7% of 989.4): 0.87.
constexpr double kFp8GemmFraction = 0.87;

// MEASURED: the tensor-core attention kernels' rate, per head dim, as a fraction of the
// dense tensor peak times mma_sync_fraction, on the FLOPs they execute (kernel_work.h). From
// bench_cuda_ops in bf16 on an H200 (2026-11-26, commit ba5f4b5: the unmasked path for whole
// tiles, ex2.approx.ftz, the unrolled tile loads; benchmarks/RESULTS.md), over 989.4 TFLOP/s x
// kHopperMmaSyncFraction: head dim 64 (B=16, C=1600) 173.2 / 176.3 TFLOP/s forward /
// backward, 128 (B=8, C=2048) 181.1 / 133.8, 256 (B=4, C=4096) 139.8 / 130.8 (at 29d5dcc:
// 131.4 / 121.7, 106.2 / 108.9, 92.2 / 118.0). Other architectures get the same fractions of
// their mma.sync rate (an assumption: only Hopper was measured). Before any measurement the
// model assumed FlashAttention-2's 50% / 43%, which put gpt2-1.5b's attention at 59 ms a step
// on one H200 where the kernels took 97 ms.
struct AttentionFractions {
  int64_t head_dim;
  double forward, backward;
};
// ASSUMPTION: head dim 192 (latent attention's, added 2026-11-27 without a GPU to time it) runs
// at the mean of 128's and 256's fractions: its tiles are 256's (32-key forward tiles, the
// dK/dV column split) with 3/4 of the columns.
constexpr AttentionFractions kMeasuredAttention[] = {
    {64, 0.377, 0.384}, {128, 0.395, 0.292}, {192, 0.350, 0.2885}, {256, 0.305, 0.285}};

AttentionFractions attention_fractions(int64_t head_dim) {
  for (const AttentionFractions& f : kMeasuredAttention) {
    if (f.head_dim == head_dim) return f;
  }
  DSTRAIN_CHECK(false) << "no tensor-core attention kernel for head dim " << head_dim;
  return {};
}
// ASSUMPTION: on Hopper and datacenter Blackwell mma.sync reaches 46% of what it reaches on an
// A100, relative to the peak: the same FlashAttention-2 code reaches "up to 335 TFLOPs/s" on an
// H100 (Dao 2023, section 4.1), 34% of its 989.4, against 73% on the A100. (FlashAttention-3,
// Shah et al. 2024, abstract: FlashAttention-2 achieves "only 35% utilization on the H100".)
// Their peak needs warpgroup MMA (wgmma, tcgen05), which cuBLAS uses and these kernels do not.
constexpr double kHopperMmaSyncFraction = 335.0 / 989.4 / 0.73;
// ASSUMPTION: the fp32 attention kernels (cuda_attention_forward.cu / _backward.cu) reach 10% of
// the CUDA cores' fp32 rate. Derived: each multiply-add of their dot products reads two fp32
// operands from shared memory (dot_rows; a broadcast and one word per lane), and an SM serves
// one warp-wide shared load per clock, so at most 16 multiply-adds per SM per clock, 1/8 of the
// 128 fp32 lanes of an SM since Ampere GA10x (1/4 of an A100's 64); the exps, shuffles and
// barriers between them take the rest.
constexpr double kCudaCoreAttentionFraction = 0.10;

// Device memory bandwidth, datasheet values (bytes/s): GA102 whitepaper (RTX 3090 936 GB/s),
// Ada whitepaper (RTX 4090 1008 GB/s), RTX Blackwell whitepaper (RTX 5090 1792 GB/s), A100
// datasheet (40GB 1555 GB/s, 80GB SXM 2039 GB/s), H100 datasheet (SXM 3.35 TB/s, PCIe
// 2 TB/s), H200 datasheet (4.8 TB/s), L40S datasheet (864 GB/s). They belong in the known-GPU
// table (topology/gpu_table.h); until they are there, this list keyed by its keys.
struct MemoryBandwidth {
  const char* key;
  double bytes_per_s;
};
constexpr MemoryBandwidth kMemoryBandwidth[] = {
    {"rtx3090", 936e9},    {"rtx4090", 1008e9},   {"rtx5090", 1792e9},
    {"a100-40gb", 1555e9}, {"a100-80gb", 2039e9}, {"h100-sxm", 3350e9},
    {"h100-pcie", 2000e9}, {"h200", 4800e9},      {"l40s", 864e9},
};
// ASSUMPTION: streaming kernels (AdamW, layernorm, GELU) reach 80% of the datasheet
// bandwidth (STREAM-like copies on GDDR6X and HBM measure 80-90%).
constexpr double kMemoryEfficiency = 0.80;
// An unknown GPU: the lowest of the table.
constexpr double kDefaultMemoryBytesPerS = 864e9;

// ASSUMPTION: the host AdamW (vectorized, multi-threaded) streams 40 GB/s per NUMA node: a
// fifth of one socket's 8-channel DDR4-3200 (204.8 GB/s theoretical), leaving room for its
// square roots and divisions, for the pinned transfers that share the memory, and for
// slower hosts.
constexpr double kHostOptimizerBytesPerSPerNuma = 40e9;

// ASSUMPTION: fixed cost of one collective call (NCCL launch and ring latency on one node:
// nccl-tests all_reduce of small messages takes 10-30 us on PCIe and NVLink machines).
constexpr double kCollectiveSeconds = 20e-6;

// Bytes AdamW reads and writes per element of its range: master, m and v read and written
// (24; 16 with bf16 moments) plus the gradient read and the working parameter written (2 x P).
// In fp32 without offload the parameter is the master: 7 x 4 = 28.
double adam_bytes_per_element(const Plan& plan) {
  const double p = static_cast<double>(dtype_size(plan.param_dtype));
  if (!plan.offload && plan.param_dtype == DType::F32) return 28;
  const double moments = 4.0 * static_cast<double>(dtype_size(plan.moment_dtype()));
  return 8 + moments + 2 * p;
}

// Ring collectives (Patarasuk and Yuan 2009; NCCL's "bus bandwidth" convention): bytes each
// rank sends (and receives) for a buffer of `bytes`.
double all_reduce_volume(double bytes, int n) { return n <= 1 ? 0 : 2.0 * (n - 1) / n * bytes; }
double gather_volume(double bytes, int n) {
  return n <= 1 ? 0 : static_cast<double>(n - 1) / n * bytes;
}

// Collectives that run alongside `window` seconds of compute, block by block: the last
// block's share cannot hide (nothing is left to compute), the rest hides up to the window.
double exposed(double seconds, double window, int blocks) {
  if (seconds <= 0) return 0;
  return std::max(seconds - window, seconds / std::max(blocks, 1));
}

bool shares_switch(const Link& link) {
  return link.kind == LinkKind::PCIe && link.path_known &&
         (link.path == PciePath::PIX || link.path == PciePath::PXB);
}

// GPUs among `busy` (other than `gpu`) under the same PCIe switch as `gpu`, plus itself.
int switch_sharers(const NodeTopology& topology, int gpu, const std::vector<int>& busy) {
  int count = 1;
  for (int other : busy) {
    if (other != gpu && shares_switch(topology.link(gpu, other))) ++count;
  }
  return count;
}

std::string rate_text(double bytes_per_s) {
  std::ostringstream text;
  text.precision(3);
  text << bytes_per_s / 1e9 << " GB/s";
  return text.str();
}

// Dense fp16/bf16 tensor FLOPs per SM per clock with fp32 accumulation, by compute capability
// (peak / (SMs x boost clock) of the known GPUs: A100 312 TFLOP/s = 108 x 1.41 GHz x 2048; RTX 3090
// and 4090 = SMs x clock x 512; H100 SXM 989 TFLOP/s = 132 x 1.83 GHz x 4096; B200 ~8192).
double tensor_flops_per_sm_clock(int cc_major, int cc_minor) {
  if (cc_major == 7) return 1024;                        // Volta / Turing
  if (cc_major == 8) return cc_minor == 0 ? 2048 : 512;  // A100 / GA10x, AD10x
  if (cc_major == 9) return 4096;                        // Hopper
  if (cc_major == 10) return 8192;                       // Blackwell datacenter
  if (cc_major >= 11) return 512;                        // Blackwell consumer (sm_120)
  return 256;
}
// FP32 FLOPs per SM per clock on the CUDA cores: 2 x the fp32 lanes of an SM (64 on Volta, Turing
// and A100; 128 from GA10x on, as in the Ampere GA102, Ada and Hopper whitepapers: RTX 4090 82.6
// TFLOP/s = 128 SMs x 2.52 GHz x 256; H100 SXM 67 = 132 x 1.98 GHz x 256).
double cuda_core_flops_per_sm_clock(int cc_major, int cc_minor) {
  if (cc_major < 8 || (cc_major == 8 && cc_minor == 0)) return 128;
  return 256;
}

// mma.sync's share of the tensor peak by architecture (kHopperMmaSyncFraction).
double mma_sync_fraction(int cc_major) {
  return cc_major == 9 || cc_major == 10 ? kHopperMmaSyncFraction : 1.0;
}

constexpr double kAssumedClockHz = 1.7e9;        // a typical boost clock
constexpr double kUnknownGpuPeakFlops = 100e12;  // when not even the SM count is known
constexpr double kUnknownGpuFp32Fraction = 0.5;  // of it on the CUDA cores: a GeForce's ratio

GpuSpeed estimated_gpu_speed(const GpuInfo& gpu, DType precision) {
  GpuSpeed speed;
  std::ostringstream note;
  const std::string name = gpu.name.empty() ? "?" : gpu.name;
  if (gpu.sm_count > 0 && gpu.cc_major > 0) {
    speed.peak_flops =
        gpu.sm_count * tensor_flops_per_sm_clock(gpu.cc_major, gpu.cc_minor) * kAssumedClockHz;
    speed.fp32_flops =
        gpu.sm_count * cuda_core_flops_per_sm_clock(gpu.cc_major, gpu.cc_minor) * kAssumedClockHz;
    speed.mma_sync_fraction = mma_sync_fraction(gpu.cc_major);
    note << "GPU '" << name << "' is not in dstrain's GPU table: its peak is estimated from "
         << gpu.sm_count << " SMs of compute capability " << gpu.cc_major << "." << gpu.cc_minor
         << " at an assumed " << kAssumedClockHz / 1e9 << " GHz";
  } else {
    speed.peak_flops = kUnknownGpuPeakFlops;
    speed.fp32_flops = kUnknownGpuPeakFlops * kUnknownGpuFp32Fraction;
    note << "GPU '" << name << "' is not in dstrain's GPU table and its SM count is unknown: "
         << "its peak is assumed to be " << kUnknownGpuPeakFlops / 1e12 << " TFLOP/s";
  }
  note << "; name the closest known GPU with --gpu (" << known_gpu_names()
       << ") for better time estimates";
  // FP8 tensor cores from compute capability 8.9, at twice the 16-bit rate.
  if (gpu.cc_major * 10 + gpu.cc_minor >= 89) speed.fp8_flops = 2 * speed.peak_flops;
  if (precision == DType::F32) speed.peak_flops *= kFp32PeakFraction;
  speed.memory_bytes_per_s = kDefaultMemoryBytesPerS * kMemoryEfficiency;
  speed.estimate_note = note.str();
  return speed;
}

}  // namespace

GpuSpeed gpu_speed(const NodeTopology& topology, DType precision) {
  DSTRAIN_CHECK(topology.gpu_count() > 0);
  const std::string& name = topology.gpus[0].name;
  const KnownGpu* known = find_known_gpu(name);
  if (known == nullptr) return estimated_gpu_speed(topology.gpus[0], precision);
  GpuSpeed speed;
  const double tflops = precision == DType::F16 ? known->fp16_tflops : known->bf16_tflops;
  speed.peak_flops = tflops * 1e12 * (precision == DType::F32 ? kFp32PeakFraction : 1.0);
  speed.fp32_flops = known->fp32_tflops * 1e12;
  speed.fp8_flops = known->fp8_tflops * 1e12;
  speed.mma_sync_fraction = mma_sync_fraction(known->cc_major);
  speed.memory_bytes_per_s = kDefaultMemoryBytesPerS * kMemoryEfficiency;
  for (const MemoryBandwidth& m : kMemoryBandwidth) {
    if (known->key == m.key) speed.memory_bytes_per_s = m.bytes_per_s * kMemoryEfficiency;
  }
  return speed;
}

double gemm_efficiency(int64_t rows, int64_t width) {
  const double r = static_cast<double>(rows), w = static_cast<double>(width);
  return kMaxPeakFraction * r / (r + kHalfEfficiencyRows) * w / (w + kHalfEfficiencyWidth);
}

ComputeRates compute_rates(const GpuSpeed& speed, const ModelConfig& config, const Plan& plan) {
  ComputeRates r;
  r.gemm_peak_flops = plan.param_dtype == DType::F32 ? speed.fp32_flops : speed.peak_flops;
  r.gemm_efficiency = gemm_efficiency(plan.micro_batch * plan.seq_len, config.n_embd / plan.tp);
  r.gemm_flops = r.gemm_peak_flops * r.gemm_efficiency;
  if (plan.fp8) {
    // Without FP8 tensor cores (an estimate for an unknown GPU) the bf16 rate.
    r.fp8_gemm_flops =
        speed.fp8_flops > 0 ? speed.fp8_flops * r.gemm_efficiency * kFp8GemmFraction : r.gemm_flops;
  }
  r.attention = attention_kernels(config, plan.param_dtype);
  if (r.attention == AttentionKernels::TensorCore) {
    const double mma_sync_peak = speed.peak_flops * speed.mma_sync_fraction;
    const AttentionFractions f = attention_fractions(config.attention_head_dim());
    r.attention_forward_flops = mma_sync_peak * f.forward;
    r.attention_backward_flops = mma_sync_peak * f.backward;
  } else {
    r.attention_forward_flops = speed.fp32_flops * kCudaCoreAttentionFraction;
    r.attention_backward_flops = r.attention_forward_flops;
  }
  r.memory_bytes_per_s = speed.memory_bytes_per_s;
  return r;
}

double ring_bandwidth(const NodeTopology& topology, const std::vector<int>& group,
                      const std::vector<int>& busy, std::string* route) {
  DSTRAIN_CHECK(group.size() >= 2) << group.size();
  double slowest = 0;
  for (size_t i = 0; i < group.size(); ++i) {
    const int a = group[i], b = group[(i + 1) % group.size()];
    const PathBandwidth path = gpu_to_gpu_bandwidth(topology, a, b);
    double rate = path.bytes_per_s;
    std::string text = path.route;
    const Link& link = topology.link(a, b);
    const bool staged =
        link.kind == LinkKind::PCIe && !(link.peer_access_known && link.peer_access);
    if (staged) {
      const int sharers = switch_sharers(topology, a, busy);
      const double uplink = gpu_to_host_bandwidth(topology, a).bytes_per_s / sharers;
      if (uplink < rate) {
        rate = uplink;
        text += ", its switch's uplink shared by " + std::to_string(sharers) + " GPUs";
      }
    }
    if (i == 0 || rate < slowest) {
      slowest = rate;
      if (route)
        *route = "GPU" + std::to_string(a) + "-GPU" + std::to_string(b) + ": " + text + " (" +
                 rate_text(rate) + ")";
    }
  }
  return slowest;
}

namespace {

int rank_of(const Plan& plan, int t, int d, int s) { return t + plan.tp * (d + plan.dp * s); }

// Where ranks run: rank r on GPU r % G of node r / G (G = the node's GPUs; the launcher's
// order). With one node rank r is GPU r.
struct Placement {
  const NodeTopology& node;
  const ClusterShape& cluster;
  int node_of(int rank) const { return rank / node.gpu_count(); }
  int local(int rank) const { return rank % node.gpu_count(); }
  bool spans_nodes(const std::vector<int>& group) const {
    for (int r : group) {
      if (node_of(r) != node_of(group[0])) return true;
    }
    return false;
  }
};

// The GPUs of a node that run ranks of the plan (every node alike).
std::vector<int> busy_gpus(const Placement& where, const Plan& plan) {
  std::vector<int> gpus;
  for (int r = 0; r < std::min(plan.world(), where.node.gpu_count()); ++r) gpus.push_back(r);
  return gpus;
}

// Rings of one kind that enter and leave the busiest node: they share its inter-node link.
int ring_link_sharers(const Placement& where, const std::vector<std::vector<int>>& groups) {
  std::vector<int> per_node(static_cast<size_t>(where.cluster.nnodes), 0);
  for (const std::vector<int>& group : groups) {
    if (group.size() < 2 || !where.spans_nodes(group)) continue;
    std::set<int> nodes;
    for (int r : group) nodes.insert(where.node_of(r));
    for (int n : nodes) ++per_node[static_cast<size_t>(n)];
  }
  return std::max(1, *std::max_element(per_node.begin(), per_node.end()));
}

// Point-to-point sends {from, to} at one time that cross nodes: the most leaving one node or
// arriving at one node.
int send_link_sharers(const Placement& where, const std::vector<std::vector<int>>& sends) {
  std::vector<int> out(static_cast<size_t>(where.cluster.nnodes), 0), in = out;
  for (const std::vector<int>& send : sends) {
    if (!where.spans_nodes(send)) continue;
    ++out[static_cast<size_t>(where.node_of(send[0]))];
    ++in[static_cast<size_t>(where.node_of(send[1]))];
  }
  return std::max({1, *std::max_element(out.begin(), out.end()),
                   *std::max_element(in.begin(), in.end())});
}

std::string node_link_text(const Placement& where, const std::vector<int>& group, int sharers,
                           double rate) {
  std::set<int> nodes;
  for (int r : group) nodes.insert(where.node_of(r));
  std::ostringstream text;
  if (group.size() == 2) {
    text << "node " << where.node_of(group[0]) << " to node " << where.node_of(group[1]);
  } else {
    text << "a ring over nodes " << *nodes.begin() << "-" << *nodes.rbegin();
  }
  text << ": the inter-node link";
  if (where.cluster.inter_node_kind != NetworkKind::Unknown) {
    text << " (" << network_kind_name(where.cluster.inter_node_kind) << ")";
  }
  text << ", " << rate_text(where.cluster.inter_node_bytes_per_s) << " per node";
  if (sharers > 1) text << " shared by " << sharers << " transfers";
  text << " (" << rate_text(rate) << ")";
  return text.str();
}

// The rate of a ring over `group` (world ranks), `sharers` of its kind crossing each node's
// link at the same time (cost_model.h).
double group_rate(const Placement& where, const std::vector<int>& group,
                  const std::vector<int>& busy, int sharers, std::string* route) {
  std::map<int, std::vector<int>> members;  // node -> its GPUs in the ring, in ring order
  for (int r : group) members[where.node_of(r)].push_back(where.local(r));
  if (members.size() == 1) return ring_bandwidth(where.node, members.begin()->second, busy, route);
  double rate = where.cluster.inter_node_bytes_per_s / sharers;
  std::string text = node_link_text(where, group, sharers, rate);
  for (const auto& [node, gpus] : members) {
    if (gpus.size() < 2) continue;
    std::string in_node;
    const double in_node_rate = ring_bandwidth(where.node, gpus, busy, &in_node);
    if (in_node_rate < rate) {
      rate = in_node_rate;
      text = in_node;
    }
  }
  if (route) *route = text;
  return rate;
}

// The slowest of the concurrent groups of one kind.
double slowest_groups(const Placement& where, const std::vector<std::vector<int>>& groups,
                      const std::vector<int>& busy, std::string* route) {
  const int sharers = ring_link_sharers(where, groups);
  double slowest = 0;
  bool first = true;
  for (const std::vector<int>& group : groups) {
    if (group.size() < 2) continue;
    std::string text;
    const double rate = group_rate(where, group, busy, sharers, &text);
    if (first || rate < slowest) {
      slowest = rate;
      *route = text;
      first = false;
    }
  }
  return slowest;
}

// Pipeline neighbours: per boundary (stage s, s + 1), the slowest pair of ranks with the
// same t and d; `route` gets the slowest of all.
std::vector<double> pipeline_rates(const Placement& where, const Plan& plan,
                                   const std::vector<int>& busy, std::string* route) {
  std::vector<double> rates;
  double slowest_pp = 0;
  for (int s = 0; s + 1 < plan.pp; ++s) {
    std::vector<std::vector<int>> sends;
    for (int d = 0; d < plan.dp; ++d) {
      for (int t = 0; t < plan.tp; ++t) {
        sends.push_back({rank_of(plan, t, d, s), rank_of(plan, t, d, s + 1)});
      }
    }
    const int sharers = send_link_sharers(where, sends);
    double slowest = 0;
    for (size_t i = 0; i < sends.size(); ++i) {
      std::string text;
      const double rate = group_rate(where, sends[i], busy, sharers, &text);
      if (i == 0 || rate < slowest) slowest = rate;
      if ((s == 0 && i == 0) || rate < slowest_pp) {
        slowest_pp = rate;
        *route = text;
      }
    }
    rates.push_back(slowest);
  }
  return rates;
}

// GPU <-> host: the slowest busy GPU, its switch's uplink shared by the busy GPUs under it.
double host_rate(const NodeTopology& node, const std::vector<int>& busy, std::string* route) {
  double slowest = 0;
  for (int r : busy) {
    const PathBandwidth path = gpu_to_host_bandwidth(node, r);
    const int sharers = switch_sharers(node, r, busy);
    const double rate = path.bytes_per_s / sharers;
    if (r == 0 || rate < slowest) {
      slowest = rate;
      *route = "GPU" + std::to_string(r) + ": " + path.route +
               (sharers > 1 ? ", its switch's uplink shared by " + std::to_string(sharers) + " GPUs"
                            : "") +
               " (" + rate_text(rate) + ")";
    }
  }
  return slowest;
}

// Link rates of each kind of group, bytes/s: the slowest group of each kind. The slowest
// links' descriptions go to `cost`.
struct LinkRates {
  double tp = 0, dp = 0, host = 0;
  double ep = 0, expert_dp = 0;  // expert parallelism: its groups', and the expert-data groups'
  std::vector<double> pp;  // per boundary (stage s, s + 1)
};

LinkRates link_rates(const Placement& where, const Plan& plan, StepCost& cost) {
  const std::vector<int> busy = busy_gpus(where, plan);
  std::vector<std::vector<int>> tp_groups, dp_groups;
  for (int s = 0; s < plan.pp; ++s) {
    for (int d = 0; d < plan.dp; ++d) {
      std::vector<int> g;
      for (int t = 0; t < plan.tp; ++t) g.push_back(rank_of(plan, t, d, s));
      tp_groups.push_back(g);
    }
    for (int t = 0; t < plan.tp; ++t) {
      std::vector<int> g;
      for (int d = 0; d < plan.dp; ++d) g.push_back(rank_of(plan, t, d, s));
      dp_groups.push_back(g);
    }
  }
  LinkRates rates;
  rates.tp = slowest_groups(where, tp_groups, busy, &cost.tp_route);
  rates.dp = slowest_groups(where, dp_groups, busy, &cost.dp_route);
  rates.pp = pipeline_rates(where, plan, busy, &cost.pp_route);
  rates.host = host_rate(where.node, busy, &cost.host_route);
  if (plan.ep > 1) {
    // Consecutive data-parallel indices exchange tokens; every ep-th one holds the same experts
    // (parallel/groups.h).
    std::vector<std::vector<int>> ep_groups, expert_dp_groups;
    for (const std::vector<int>& dp_group : dp_groups) {
      for (int first = 0; first < plan.dp; first += plan.ep) {
        ep_groups.emplace_back(dp_group.begin() + first, dp_group.begin() + first + plan.ep);
      }
      for (int e = 0; e < plan.ep; ++e) {
        std::vector<int> g;
        for (int d = e; d < plan.dp; d += plan.ep) g.push_back(dp_group[static_cast<size_t>(d)]);
        expert_dp_groups.push_back(g);
      }
    }
    rates.ep = slowest_groups(where, ep_groups, busy, &cost.ep_route);
    std::string route;
    rates.expert_dp = slowest_groups(where, expert_dp_groups, busy, &route);
  }
  return rates;
}

}  // namespace

double fullest_node_total(const Plan& plan, int gpus_per_node,
                          const std::vector<double>& per_stage) {
  DSTRAIN_CHECK(gpus_per_node > 0 && per_stage.size() == static_cast<size_t>(plan.pp));
  const int stage_ranks = plan.dp * plan.tp;
  double fullest = 0;
  for (int first = 0; first < plan.world(); first += gpus_per_node) {
    double total = 0;
    for (int r = first; r < std::min(plan.world(), first + gpus_per_node); ++r) {
      total += per_stage[static_cast<size_t>(r / stage_ranks)];
    }
    fullest = std::max(fullest, total);
  }
  return fullest;
}

// The tensor-parallel collectives of one micro-batch on a stage (model/gpt2.cpp). Per layer,
// forward: two row-parallel outputs reduced (all-reduce, or with sequence parallelism a
// reduce-scatter each, plus an all-gather before each column-parallel layer); backward: the
// conjugates, and under sequence parallelism the two column-parallel inputs gathered again. A
// reduce-scatter plus an all-gather move what one all-reduce moves. Full recompute runs the
// forward's again. The first stage's embedding and the last stage's head add one all-reduce
// each (with sequence parallelism a reduce-scatter and an all-gather); the head's
// vocabulary-parallel loss adds an all-gather of (B*T, 3) statistics, a latency (its volume,
// 3 / (2 C) of an all-reduce at tp 2, is left out). The trainer logs what ran
// (model/tensor_parallel.h, TensorParallelStats): the same counts.
TensorParallelTraffic tensor_parallel_traffic(const Plan& plan, const StageRange& range,
                                              int64_t moe_layers) {
  const bool sp = plan.uses_sequence_parallel();
  const bool full = plan.recompute == Recompute::Full;
  const double layers = static_cast<double>(range.layers());
  const double ends = (range.first ? 1 : 0) + (range.last ? 1 : 0);
  TensorParallelTraffic t;
  t.all_reduces = layers * (4 + (sp ? 1 : 0) + (full ? 2 : 0)) + ends;
  t.collectives = layers * (sp ? 10 + (full ? 4 : 0) : 4 + (full ? 2 : 0)) + ends * (sp ? 2 : 1) +
                  (range.last ? 1 : 0);
  // A MoE layer's MLP: no output reduction forward (again under full recompute), no input
  // gradient reduction backward. Each is an all-reduce, or under sequence parallelism a
  // reduce-scatter (half an all-reduce's volume).
  const double skipped = static_cast<double>(moe_layers) * (full ? 3 : 2);
  t.collectives -= skipped;
  t.all_reduces -= skipped * (sp ? 0.5 : 1.0);
  return t;
}

int64_t moe_layers_in(const ModelConfig& config, const StageRange& range) {
  if (!config.moe.enabled()) return 0;
  int64_t count = 0;
  for (int64_t layer = range.first_layer; layer < range.end_layer; ++layer) {
    count += config.moe.moe_layer(layer) ? 1 : 0;
  }
  return count;
}

ExpertParallelTraffic expert_parallel_traffic(const ModelConfig& config, const Plan& plan,
                                              const StageRange& range) {
  ExpertParallelTraffic traffic;
  if (plan.ep == 1) return traffic;
  const DecoderParts parts = decoder_parts(config);
  const double exchanges_per_layer = plan.recompute == Recompute::Full ? 6 : 4;
  const double rows = static_cast<double>(plan.micro_batch * plan.seq_len * parts.mlp.top_k);
  const double row_bytes =
      static_cast<double>(config.n_embd * static_cast<int64_t>(dtype_size(plan.param_dtype)));
  const double leaving = static_cast<double>(plan.ep - 1) / plan.ep;
  for (int64_t layer = range.first_layer; layer < range.end_layer; ++layer) {
    if (parts.layer_mlp(layer).kind != MlpKind::MoE) continue;
    traffic.exchanges += exchanges_per_layer;
    traffic.bytes += exchanges_per_layer * rows * row_bytes * leaving;
  }
  return traffic;
}

namespace {

// One micro-batch's compute on a stage, seconds: by kind, and as forward and backward (the
// windows that hide data-parallel traffic; backward includes what recompute repeats).
struct ComputeTime {
  double gemm = 0, attention = 0, memory_bound = 0;
  double forward = 0, backward = 0;
};

// The work of a pass over a stage: GEMM FLOPs (in the plan's dtype, and in FP8), attention
// FLOPs, bytes of the memory-bound kernels.
struct PassWork {
  double gemm = 0, fp8_gemm = 0, attention = 0, bytes = 0;
};

// The stage's layers' GEMMs and attention heads, and the vocabulary-parallel head, split over
// the tp ranks (kernel_work.h's traffic is already per tp rank).
ComputeTime stage_compute(const ModelConfig& config, const Plan& plan, const StageRange& range,
                          const ComputeRates& rates) {
  const ModelFlops flops = model_flops(config, plan.seq_len);
  const AttentionWork attention = attention_work(config, plan.seq_len, plan.param_dtype);
  const MemoryTraffic traffic = memory_traffic(config, plan.tp, plan.uses_sequence_parallel());
  const double tokens = static_cast<double>(plan.micro_batch * plan.seq_len);
  const double per_rank = tokens / plan.tp, layers = static_cast<double>(range.layers());
  const double bytes = tokens * static_cast<double>(dtype_size(plan.param_dtype));
  PassWork forward, backward;
  forward.gemm =
      per_rank * (layers * flops.layer_gemm_forward + (range.last ? flops.head_forward : 0));
  forward.attention = per_rank * layers * attention.forward;
  forward.bytes =
      bytes * (layers * traffic.layer_forward + (range.first ? traffic.embed_forward : 0) +
               (range.last ? traffic.head_forward : 0));
  // Under tp the experts, and latent attention's latent path, run whole on every rank, on all of
  // the micro-batch's rows.
  const DecoderParts parts = decoder_parts(config);
  const double C = static_cast<double>(config.n_embd);
  const double moe_repeated = (tokens - per_rank) *
                                  static_cast<double>(moe_layers_in(config, range)) *
                                  mlp_gemm_forward(parts.mlp, C) +
                              (tokens - per_rank) * layers *
                                  attention_replicated_gemm_forward(parts.attention, C);
  forward.gemm += moe_repeated;
  const Fp8CastBytes casts = plan.fp8 ? fp8_cast_bytes(config, plan.tp, plan.param_dtype, tokens,
                                                       fp8_options(plan).cache_weights)
                                      : Fp8CastBytes{};
  if (plan.fp8) {  // the layers' FP8 GEMMs at their own rate
    forward.fp8_gemm = per_rank * layers * flops.layer_fp8_gemm_forward;
    forward.gemm -= forward.fp8_gemm;
  }
  // (Cached FP8 weights: cast once a step, here a micro-batch's share of it.)
  forward.bytes +=
      layers * (casts.forward + casts.weights_per_step / static_cast<double>(plan.grad_accum));
  backward.bytes += layers * casts.backward;
  backward.gemm = 2 * forward.gemm;  // dX and dW
  backward.fp8_gemm = 2 * forward.fp8_gemm;
  backward.attention = per_rank * layers * attention.backward;
  backward.bytes +=
      bytes * (layers * traffic.layer_backward + (range.first ? traffic.embed_backward : 0) +
               (range.last ? traffic.head_backward : 0));
  double recomputed_attention = 0;  // runs at the forward's rate
  if (plan.recompute == Recompute::Full) {
    // The layers' forward again (not the head's): its FP8 part at the FP8 rate.
    backward.gemm += per_rank * layers * flops.layer_gemm_forward + moe_repeated - forward.fp8_gemm;
    backward.fp8_gemm += forward.fp8_gemm;
    recomputed_attention = forward.attention;
    backward.bytes += layers * (bytes * traffic.layer_forward + casts.forward);
  } else if (plan.recompute == Recompute::Selective) {
    backward.bytes += bytes * layers * traffic.layer_selective;
  }
  ComputeTime t;
  const double forward_attention = forward.attention / rates.attention_forward_flops;
  const double backward_attention = backward.attention / rates.attention_backward_flops +
                                    recomputed_attention / rates.attention_forward_flops;
  auto gemm_seconds = [&](const PassWork& pass) {
    return pass.gemm / rates.gemm_flops +
           (pass.fp8_gemm > 0 ? pass.fp8_gemm / rates.fp8_gemm_flops : 0.0);
  };
  t.forward = gemm_seconds(forward) + forward_attention + forward.bytes / rates.memory_bytes_per_s;
  t.backward =
      gemm_seconds(backward) + backward_attention + backward.bytes / rates.memory_bytes_per_s;
  t.gemm = gemm_seconds(forward) + gemm_seconds(backward);
  t.attention = forward_attention + backward_attention;
  t.memory_bound = (forward.bytes + backward.bytes) / rates.memory_bytes_per_s;
  return t;
}

}  // namespace

namespace {

// Parameter offload: how often a micro-batch brings a block of the stage up, forward and
// backward, as the stage acquires them (model/stage.h) with two buffers: a layer (and its
// experts) once each way, but the stage's last dense layer only forward where its buffer still
// holds it when the backward begins (the stage is not the last, or its head is untied: only the
// final block came after it); the embedding for the embedding's forward on the first stage, and
// for the tied head on the last, whose backward reuses the forward's copy; the final block (norm
// and an untied head) once, its backward reusing it too. (Where a buffer still holds a block
// from the micro-batch before, it is not brought again: a small model's first layer; not
// counted.)
std::pair<double, double> offloaded_params_uses(const ParamLayout& layout, int block,
                                                const StageRange& range) {
  if (block == ParamLayout::embedding_block()) {
    return {(range.first ? 1.0 : 0.0) + (range.last && layout.tied_embedding() ? 1.0 : 0.0), 0.0};
  }
  if (block == layout.final_block()) return {1.0, 0.0};
  const int last_layer = static_cast<int>(range.end_layer) - 1;
  const bool still_held = block == ParamLayout::layer_block(last_layer) &&
                          layout.expert_block(last_layer) < 0 &&
                          (!range.last || !layout.tied_embedding());
  return {1.0, still_held ? 0.0 : 1.0};
}

// Parameter offload, one micro-batch: what the communication stream carries in forward (the
// blocks brought up, after the data-parallel traffic `dp` of that window) and in backward (the
// blocks brought up again, the step's gradient sums so far up -- all but in the first
// micro-batch -- and the new sums down), each hidden behind its window of compute but for the
// last block's share. The result includes the data-parallel traffic's exposed time.
double offloaded_params_micro(std::pair<double, double> param_bytes, double grad_bytes,
                              double micro_batches, double host_bytes_per_s,
                              std::pair<double, double> dp, std::pair<double, double> windows,
                              int blocks) {
  const double grads = grad_bytes / host_bytes_per_s;
  const double forward = dp.first + param_bytes.first / host_bytes_per_s;
  const double backward = dp.second + param_bytes.second / host_bytes_per_s +
                          grads * (micro_batches - 1) / micro_batches + grads;
  return exposed(forward, windows.first, blocks) + exposed(backward, windows.second, blocks);
}

// Parameter offload, bytes each step moves between the host and the device outside the
// micro-batches: the gradient check brings every optimizer range up; an optimizer on the device
// brings each range's parameters and gradients up and the parameters down; at stages 1-2 each
// rank's updated range goes up and the gathered block comes down.
double offloaded_params_step(const Plan& plan, double optimizer_bytes, double param_bytes) {
  double bytes = optimizer_bytes;
  if (!plan.offload) bytes += 3 * optimizer_bytes;
  if (plan.zero == 1 || plan.zero == 2) bytes += optimizer_bytes + param_bytes;
  return bytes;
}

}  // namespace

StepCost predict_step_cost(const MemoryModel& memory, const NodeTopology& topology,
                           const Plan& plan, const ClusterShape& cluster) {
  const ModelConfig& config = memory.config();
  DSTRAIN_CHECK(cluster.nnodes >= 1 &&
                plan.world() <= topology.gpu_count() * cluster.nnodes &&
                (!cluster.multi_node() || cluster.inter_node_bytes_per_s > 0))
      << plan.world() << " ranks on " << cluster.nnodes << " x " << topology.gpu_count()
      << " GPUs";
  const GpuSpeed speed = gpu_speed(topology, plan.param_dtype);
  const double P = static_cast<double>(dtype_size(plan.param_dtype));
  const double tokens = static_cast<double>(plan.micro_batch * plan.seq_len);
  const double m = static_cast<double>(plan.grad_accum);

  StepCost cost;
  cost.rates = compute_rates(speed, config, plan);
  cost.efficiency = cost.rates.gemm_efficiency;

  const Placement where{topology, cluster};
  const LinkRates rates = link_rates(where, plan, cost);
  const double host_optimizer_rate =
      kHostOptimizerBytesPerSPerNuma * std::max(1, topology.numa_nodes);

  // Per stage: time per micro-batch, and what the step adds once.
  struct StageTime {
    ComputeTime compute;  // per micro-batch, as are the next
    double micro = 0, tp = 0, ep = 0, pp = 0, dp_micro = 0, offload_micro = 0;
    double dp_step = 0, offload = 0, optimizer = 0;  // per step
  };
  std::vector<StageTime> stages(static_cast<size_t>(plan.pp));
  const ShardingSpec spec{plan.zero,           plan.dp, plan.offload, plan.param_dtype,
                          plan.offload_params, plan.moment_dtype()};
  double host_optimizer_bytes = 0;  // all ranks together: they share the host's memory
  std::vector<double> host_optimizer_bytes_per_rank(static_cast<size_t>(plan.pp), 0.0);
  for (int s = 0; s < plan.pp; ++s) {
    StageTime& st = stages[static_cast<size_t>(s)];
    const StageRange ps = memory.stage_range(plan, s);
    st.compute = stage_compute(config, plan, ps, cost.rates);
    const double fwd_seconds = st.compute.forward, bwd_seconds = st.compute.backward;
    const double activation_bytes = tokens * static_cast<double>(config.n_embd) * P;
    if (plan.tp > 1) {
      const TensorParallelTraffic traffic =
          tensor_parallel_traffic(plan, ps, moe_layers_in(config, ps));
      st.tp = traffic.all_reduces * all_reduce_volume(activation_bytes, plan.tp) / rates.tp +
              traffic.collectives * kCollectiveSeconds;
    }
    if (!ps.last) st.pp += activation_bytes / rates.pp[static_cast<size_t>(s)];       // forward
    if (!ps.first) st.pp += activation_bytes / rates.pp[static_cast<size_t>(s - 1)];  // backward

    if (plan.ep > 1) {
      const ExpertParallelTraffic traffic = expert_parallel_traffic(config, plan, ps);
      st.ep = traffic.bytes / rates.ep + 2 * traffic.exchanges * kCollectiveSeconds;
    }

    // Data parallelism over this stage's blocks: the routed experts' over the ranks holding
    // the same experts (dp / ep), the rest over all dp.
    const std::vector<int64_t> numels = memory.stage_block_numels(plan, s);
    const std::vector<int> worlds = memory.stage_block_worlds(plan, s);
    const int blocks = static_cast<int>(numels.size());
    double padded = 0, expert_padded = 0, optimizer_elements = 0;
    double param_elements = 0, grad_elements = 0;  // as the rank stores them
    std::pair<double, double> brought = {0, 0};     // elements brought up forward, backward
    const std::vector<int> block_ids = pipeline_stage_blocks(memory.layout(), ps);
    for (size_t i = 0; i < numels.size(); ++i) {
      ShardingSpec block_spec = spec;
      block_spec.world = worlds[i];
      const BlockStateSizes b = block_state_sizes(numels[i], block_spec);
      (worlds[i] == plan.dp ? padded : expert_padded) += static_cast<double>(b.padded);
      optimizer_elements += static_cast<double>(b.optimizer_numel);
      param_elements += static_cast<double>(b.params.numel);
      grad_elements += static_cast<double>(b.grads.numel);
      const auto [forward_uses, backward_uses] =
          offloaded_params_uses(memory.layout(), block_ids[i], ps);
      brought.first += forward_uses * static_cast<double>(b.params.numel);
      brought.second += backward_uses * static_cast<double>(b.params.numel);
    }
    const double state_bytes = padded * P, expert_bytes = expert_padded * P;
    const int expert_dp = plan.dp / plan.ep;
    double dp_forward = 0, dp_backward = 0;  // per micro-batch, on the communication stream
    if (plan.dp > 1) {
      const double latency = blocks * kCollectiveSeconds;
      double all_reduce = all_reduce_volume(state_bytes, plan.dp) / rates.dp + latency;
      double gather = gather_volume(state_bytes, plan.dp) / rates.dp + latency;
      if (expert_dp > 1 && expert_bytes > 0) {
        all_reduce += all_reduce_volume(expert_bytes, expert_dp) / rates.expert_dp;
        gather += gather_volume(expert_bytes, expert_dp) / rates.expert_dp;
      }
      switch (plan.zero) {
        case 0:  // all-reduce once, under the last micro-batch's backward
          st.dp_step = exposed(all_reduce, bwd_seconds, blocks);
          break;
        case 1:  // reduce-scatter once, then the updated shards all-gathered
          st.dp_step = exposed(gather, bwd_seconds, blocks) + exposed(gather, fwd_seconds, blocks);
          break;
        case 2:  // reduce-scatter every micro-batch; all-gather after the step
          dp_backward = gather;
          st.dp_step = exposed(gather, fwd_seconds, blocks);
          break;
        default:  // 3: gather for forward, gather again + reduce-scatter in backward
          dp_forward = gather;
          dp_backward = 2 * gather;
          break;
      }
      st.dp_micro =
          exposed(dp_forward, fwd_seconds, blocks) + exposed(dp_backward, bwd_seconds, blocks);
    }
    if (plan.offload_params) {
      st.offload_micro = offloaded_params_micro({brought.first * P, brought.second * P},
                                                grad_elements * P, m,
                                                rates.host, {dp_forward, dp_backward},
                                                {fwd_seconds, bwd_seconds}, blocks) -
                         st.dp_micro;
      st.offload = offloaded_params_step(plan, optimizer_elements * P, param_elements * P) /
                   rates.host;
    }
    const double adam_bytes = optimizer_elements * adam_bytes_per_element(plan);
    if (plan.offload) {
      // Gradients of the optimizer range down (hidden by the last backward where possible),
      // the host step, and the updated weights up, block by block behind the host step (with
      // the parameters offloaded too, both are on the host already).
      const double down = optimizer_elements * P / rates.host;
      const double up = optimizer_elements * P / rates.host;
      if (!plan.offload_params) {
        st.offload = exposed(down, bwd_seconds, blocks) + up / std::max(blocks, 1);
      }
      host_optimizer_bytes += adam_bytes * plan.dp * plan.tp;
      host_optimizer_bytes_per_rank[static_cast<size_t>(s)] = adam_bytes;
      st.optimizer = 0;
    } else {
      st.optimizer = adam_bytes / speed.memory_bytes_per_s;
    }
    st.micro = st.compute.forward + st.compute.backward + st.tp + st.ep + st.pp + st.dp_micro +
               st.offload_micro;
  }
  // The host step: all ranks of a node at once over its host's memory (the uploads run behind
  // it); across nodes, the fullest node's.
  if (cluster.multi_node()) {
    host_optimizer_bytes =
        fullest_node_total(plan, topology.gpu_count(), host_optimizer_bytes_per_rank);
  }
  const double host_step = host_optimizer_bytes / host_optimizer_rate;

  size_t slowest = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (stages[s].micro > stages[slowest].micro) slowest = s;
  }
  const StageTime& st = stages[slowest];
  cost.gemm_seconds = st.compute.gemm * m;
  cost.attention_seconds = st.compute.attention * m;
  cost.memory_bound_seconds = st.compute.memory_bound * m;
  cost.compute_seconds = (st.compute.forward + st.compute.backward) * m;
  cost.tp_comm_seconds = st.tp * m;
  cost.ep_comm_seconds = st.ep * m;
  cost.pp_comm_seconds = st.pp * m;
  cost.bubble_seconds = st.micro * (plan.pp - 1);
  // The per-step parts of the stage that takes longest over them.
  double dp_step = 0, offload = 0, optimizer = 0;
  for (const StageTime& stage : stages) {
    if (stage.dp_step + stage.offload + stage.optimizer >= dp_step + offload + optimizer) {
      dp_step = stage.dp_step;
      offload = stage.offload;
      optimizer = stage.optimizer;
    }
  }
  cost.dp_comm_seconds = st.dp_micro * m + dp_step;
  cost.offload_seconds = st.offload_micro * m + offload + host_step;
  cost.optimizer_seconds = optimizer;
  cost.step_seconds = cost.compute_seconds + cost.tp_comm_seconds + cost.ep_comm_seconds +
                      cost.pp_comm_seconds + cost.bubble_seconds + cost.dp_comm_seconds +
                      cost.offload_seconds + cost.optimizer_seconds;
  cost.tokens_per_second = static_cast<double>(plan.tokens_per_step()) / cost.step_seconds;
  if (plan.dp == 1) cost.dp_route.clear();
  if (plan.tp == 1) cost.tp_route.clear();
  if (plan.ep == 1) cost.ep_route.clear();
  if (plan.pp == 1) cost.pp_route.clear();
  if (!plan.offload && !plan.offload_params) cost.host_route.clear();
  return cost;
}

}  // namespace dstrain
