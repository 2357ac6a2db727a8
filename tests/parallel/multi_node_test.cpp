// Plans across nodes: nnodes identical machines joined by an inter-node link
// (topology/cluster.h). Rank r runs on node r / G, GPU r % G. Tensor parallelism stays inside a
// node; pipeline stages and data parallelism may span nodes, their traffic costed at the link
// (cost_model.h: a ring crossing nodes runs at the node's link shared by the rings of its kind
// that cross it at the same time).
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <set>
#include <tuple>

#include "comm/communicator.h"
#include "comm/gather_values.h"
#include "core/check.h"
#include "parallel/groups.h"
#include "parallel/planner.h"
#include "test_machines.h"

namespace dstrain {
namespace {

NodeTopology h100_node() {
  return testing::fixture_machine("h100-8gpu-nvswitch-4nic.txt", "h100-sxm", "2T");
}
NodeTopology rtx4090_node() {
  return testing::fixture_machine("rtx4090-8gpu-pcie.txt", "rtx4090", "256G");
}

Plan bf16_plan(int dp, int tp, int pp, int zero, int64_t micro_batch, int64_t grad_accum) {
  Plan p = testing::bf16_plan(dp, tp, pp, micro_batch, grad_accum);
  p.zero = zero;
  return p;
}

using testing::user_error;

// Every tensor-parallel group of `plan` on one node of `per_node` GPUs.
void expect_tp_inside_nodes(const Plan& plan, int per_node) {
  for (int s = 0; s < plan.pp; ++s) {
    for (int d = 0; d < plan.dp; ++d) {
      const int node = world_rank_of(plan, s, d, 0) / per_node;
      for (int t = 1; t < plan.tp; ++t) {
        EXPECT_EQ(world_rank_of(plan, s, d, t) / per_node, node)
            << describe(plan) << ": stage " << s << ", data index " << d << ", tp index " << t
            << " with " << per_node << " GPUs per node";
      }
    }
  }
}

TEST(MultiNode, TensorParallelGroupsNeverSpanNodes) {
  // gpt2-124m has 12 heads: tp 1, 2, 3, 4, 6 or 12 split it. With G GPUs per node, tp must
  // divide G; the others that divide the world are excluded with the node rule.
  const NodeTopology h100 = h100_node();
  const ModelConfig config = load_model_config("gpt2-124m");
  for (int nnodes : {1, 2, 3, 4}) {
    for (int per_node : {2, 4, 6, 8}) {
      SCOPED_TRACE(std::to_string(nnodes) + " nodes x " + std::to_string(per_node));
      PlanRequest request;
      request.gpus = per_node;
      request.max_alternatives = 1000;
      const ClusterShape cluster = make_cluster_shape(nnodes, "", h100);
      const PlanResult r = choose_plan(config, h100, request, cluster);
      EXPECT_EQ(r.best.plan.world(), nnodes * per_node);
      EXPECT_EQ(r.gpus_per_node, per_node);
      expect_tp_inside_nodes(r.best.plan, per_node);
      for (const PlanCandidate& a : r.alternatives) expect_tp_inside_nodes(a.plan, per_node);
      for (int tp : {2, 3, 4, 6, 12}) {
        const bool spans = (nnodes * per_node) % tp == 0 && per_node % tp != 0;
        bool excluded = false;
        for (const std::string& why : r.excluded) {
          excluded |= why.rfind("tp " + std::to_string(tp) + " would put ranks", 0) == 0 &&
                      why.find("so it stays inside a node") != std::string::npos;
        }
        EXPECT_EQ(excluded, spans) << "tp " << tp;
      }
    }
  }
}

TEST(MultiNode, AFixedTpAcrossNodesIsOneSentence) {
  // 2 nodes x 6 GPUs, tp 4: ranks 4-7 would be GPUs 4, 5 of node 0 and 0, 1 of node 1.
  const NodeTopology h100 = h100_node();
  PlanRequest request;
  request.gpus = 6;
  request.tp = 4;
  const std::string message = user_error([&] {
    choose_plan(load_model_config("gpt2-124m"), h100, request, make_cluster_shape(2, "", h100));
  });
  EXPECT_NE(message.find("--tp 4 is not possible here: tp 4 would put ranks 4-7 of node 0 and "
                         "node 1 in one tensor-parallel group"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(MultiNode, RankGroupsPutEachTensorGroupOnOneNode) {
  // The communicators the trainer makes (parallel/groups.h), with the launcher's ranks
  // rank = node x G + local GPU: every member of a rank's tensor group is on its node.
  constexpr int kPerNode = 4;
  for (const Plan& plan : {bf16_plan(2, 2, 2, 0, 1, 1), bf16_plan(2, 4, 1, 0, 1, 1),
                           bf16_plan(1, 4, 2, 0, 1, 1), bf16_plan(4, 2, 1, 0, 1, 1)}) {
    SCOPED_TRACE(describe(plan));
    std::mutex mutex;
    std::set<int> checked;
    run_local_ranks(plan.world(), 60.0, [&](Communicator& world) {
      const RankGroups groups = make_rank_groups(world, plan);
      const std::vector<int32_t> members = all_gather_values(*groups.tensor, std::vector<int32_t>{world.rank()});
      std::lock_guard<std::mutex> lock(mutex);
      EXPECT_EQ(static_cast<int>(members.size()), plan.tp);
      for (int32_t member : members) {
        EXPECT_EQ(member / kPerNode, world.rank() / kPerNode) << "rank " << world.rank();
      }
      checked.insert(world.rank());
    });
    EXPECT_EQ(static_cast<int>(checked.size()), plan.world());
  }
}

TEST(MultiNode, CrossNodeRingRunsAtTheLinkSharedByItsKind) {
  // 2 nodes x 8 H100 at 400 Gbit/s = 50 GB/s per node. dp 16 is one data-parallel ring that
  // crosses each node's link once each way: 50 GB/s (the NVSwitch hops inside, 360, are
  // faster). tp 8 x dp 2 makes 8 rings of 2, all crossing: 50 / 8 = 6.25 GB/s each.
  const NodeTopology h100 = h100_node();
  const ClusterShape cluster = make_cluster_shape(2, "400Gbit/s", h100);
  const MemoryModel memory(load_model_config("6b"));
  const StepCost one_ring = predict_step_cost(memory, h100, bf16_plan(16, 1, 1, 0, 1, 32), cluster);
  EXPECT_NE(one_ring.dp_route.find("a ring over nodes 0-1: the inter-node link (InfiniBand/RoCE), "
                                   "50 GB/s per node (50 GB/s)"),
            std::string::npos)
      << one_ring.dp_route;
  const StepCost eight_rings = predict_step_cost(memory, h100, bf16_plan(2, 8, 1, 0, 1, 256), cluster);
  EXPECT_NE(eight_rings.dp_route.find("shared by 8 transfers (6.25 GB/s)"), std::string::npos)
      << eight_rings.dp_route;
  EXPECT_NE(eight_rings.tp_route.find("NVLinks"), std::string::npos) << eight_rings.tp_route;

  // On 8 x RTX 4090 nodes (no peer access, 4 GPUs per PCIe switch) the ring's in-node hops,
  // staged through host memory, are slower than 50 GB/s: they bound it.
  const NodeTopology rtx4090 = rtx4090_node();
  const StepCost pcie = predict_step_cost(memory, rtx4090, bf16_plan(16, 1, 1, 0, 1, 32),
                                          make_cluster_shape(2, "400Gbit/s", rtx4090));
  EXPECT_NE(pcie.dp_route.find("shared by 4 GPUs"), std::string::npos) << pcie.dp_route;
}

TEST(MultiNode, ZeroAllReduceAcrossNodesFollowsTheRingFormula) {
  // ZeRO-0 over dp 16 on a 1 Gbit/s link: one all-reduce of the bf16 gradients per step,
  // 2(16-1)/16 of them through each node's link, plus 20 us per block; the last micro-batch's
  // backward hides part of it (cost_model.cpp: exposed()): a little over 2/3 of its compute
  // (the GEMMs' backward is twice their forward; the attention's and the memory-bound
  // kernels' backward a bit more than that).
  const NodeTopology h100 = h100_node();
  const ClusterShape cluster = make_cluster_shape(2, "1Gbit/s", h100);
  const MemoryModel memory(load_model_config("6b"));
  const Plan plan = bf16_plan(16, 1, 1, 0, 1, 32);
  double padded = 0;
  const std::vector<int64_t> numels = memory.stage_block_numels(plan, 0);
  for (int64_t n : numels) {
    padded += static_cast<double>(block_state_sizes(n, {0, 16, false, DType::BF16}).padded);
  }
  ASSERT_GT(padded, 5e9);
  const double all_reduce =
      2.0 * 15 / 16 * padded * 2 / 0.125e9 + static_cast<double>(numels.size()) * 20e-6;
  const StepCost c = predict_step_cost(memory, h100, plan, cluster);
  const double micro_batch = c.compute_seconds / 32, hidden = all_reduce - c.dp_comm_seconds;
  EXPECT_GT(hidden, micro_batch * 2 / 3);
  EXPECT_LT(hidden, micro_batch * 0.7);
}

TEST(MultiNode, PipelineSendsAcrossNodesShareTheLink) {
  // pp 2 with 8 ranks per stage: stage 0 is node 0, stage 1 node 1. The 8 lanes (dp 8) send at
  // once over the 10 Gbit/s link: each micro-batch's (1, 1024, 4096) bf16 activation forward
  // (stage 0) or its gradient backward (stage 1) at 1.25 GB/s / 8.
  const NodeTopology h100 = h100_node();
  const MemoryModel memory(load_model_config("6b"));
  const StepCost c = predict_step_cost(memory, h100, bf16_plan(8, 1, 2, 1, 1, 64),
                                       make_cluster_shape(2, "10Gbit/s", h100));
  EXPECT_NEAR(c.pp_comm_seconds, 64 * 1024.0 * 4096 * 2 / (1.25e9 / 8), 1e-9);
  EXPECT_NE(c.pp_route.find("node 0 to node 1: the inter-node link (InfiniBand/RoCE), 1.25 GB/s "
                            "per node shared by 8 transfers (0.156 GB/s)"),
            std::string::npos)
      << c.pp_route;
}

TEST(MultiNode, ASlowLinkMovesDataParallelismOffIt) {
  // 6b (5.85B parameters, 11.7 GB of bf16 gradients) on 2 nodes x 8 H100, GPT-2's batch of
  // 512 sequences of 1024 tokens. The cost model's formulas give, per step:
  //   data parallelism across the nodes (pp 1): each node's link carries at least one ring's
  //     2(n-1)/n of the gradients (ZeRO's reduce-scatter + all-gather or the all-reduce):
  //     2 x 15/16 x 11.7 GB = 22 GB; with tp 8 the 8 rings of 2 move 8 x 1/8 x 11.7 GB each way;
  //   pipeline stages on separate nodes (dp x tp = 8 per stage): only activations cross, each
  //     of the 512 sequences' (1024, 4096) bf16 activation once each way: 4.3 GB per direction.
  // At 400 Gbit/s (50 GB/s) 22 GB take 0.44 s and hide under ~2.4 s of compute, while stages
  // add a pipeline bubble: data parallelism spans the nodes. At 10 Gbit/s (1.25 GB/s) the
  // gradients need >= 9.4 s against 3.4 s for the activations: the stages split at the node
  // boundary and data parallelism stays inside each node.
  const NodeTopology h100 = h100_node();
  const ModelConfig config = load_model_config("6b");
  const double gradients = 2.0 * static_cast<double>(config.num_parameters());
  const double activations = 512 * 1024.0 * 4096 * 2;
  const double fast = parse_network_bandwidth("400Gbit/s"), slow = parse_network_bandwidth("10Gbit/s");
  ASSERT_LT(2 * 15.0 / 16 * gradients / fast, 1.0);        // hides under the compute
  ASSERT_GT(gradients / slow, 2 * (activations / 2) / slow);  // > 2 x the pipeline's sends

  const PlanResult on_fast = choose_plan(config, h100, {}, make_cluster_shape(2, "400Gbit/s", h100));
  SCOPED_TRACE("400 Gbit/s: " + describe(on_fast.best.plan));
  EXPECT_EQ(on_fast.best.plan.pp, 1);
  EXPECT_GT(on_fast.best.plan.dp * on_fast.best.plan.tp, 8);  // data-parallel groups cross
  EXPECT_NE(on_fast.best.cost.dp_route.find("inter-node link"), std::string::npos);

  const PlanResult on_slow = choose_plan(config, h100, {}, make_cluster_shape(2, "10Gbit/s", h100));
  const Plan& p = on_slow.best.plan;
  SCOPED_TRACE("10 Gbit/s: " + describe(p));
  EXPECT_GE(p.pp, 2);
  EXPECT_EQ(8 % (p.dp * p.tp), 0);  // a stage's ranks inside one node
  EXPECT_EQ(on_slow.best.cost.dp_route.find("inter-node link"), std::string::npos);
  // With two stages, one per node: every lane's activations at 1.25 GB/s shared by the 8 lanes.
  if (p.pp == 2) {
    const int64_t sequences_per_lane = p.micro_batch * p.grad_accum;
    EXPECT_NEAR(on_slow.best.cost.pp_comm_seconds,
                static_cast<double>(sequences_per_lane) * 1024 * 4096 * 2 / (slow / 8), 1e-6);
  }
}

TEST(MultiNode, HostMemoryIsCountedPerNode) {
  // Offload on 2 nodes: each node's host holds the optimizer state of its own 8 ranks, half of
  // all 16 with data parallelism only.
  const NodeTopology rtx4090 = rtx4090_node();
  const MemoryModel memory(load_model_config("13b"));
  Plan plan = bf16_plan(16, 1, 1, 1, 1, 32);
  plan.offload = true;
  const PlanCandidate two_nodes =
      evaluate_plan(memory, rtx4090, plan, make_cluster_shape(2, "100G", rtx4090));
  EXPECT_GT(two_nodes.host_bytes, 0u);
  EXPECT_EQ(two_nodes.host_bytes, memory.host_bytes_all_ranks(plan) / 2);
  // pp 2 across the nodes: node 0 is stage 0, node 1 stage 1: the fuller of the two.
  Plan staged = bf16_plan(8, 1, 2, 1, 1, 64);
  staged.offload = true;
  const uint64_t stage0 = memory.predict_stage(staged, 0).host_total() * 8;
  const uint64_t stage1 = memory.predict_stage(staged, 1).host_total() * 8;
  EXPECT_EQ(evaluate_plan(memory, rtx4090, staged, make_cluster_shape(2, "100G", rtx4090)).host_bytes,
            std::max(stage0, stage1));
}

TEST(MultiNode, OneNodeIsTheSingleMachinePlan) {
  // nnodes 1 uses no link (a given rate is ignored): the plans, their costs, the alternatives
  // and the exclusions are those of the single machine (planner_test.cpp's expectations).
  for (const auto& [fixture, gpu, model] :
       {std::tuple{"rtx4090-8gpu-pcie.txt", "rtx4090", "6b"},
        std::tuple{"h100-8gpu-nvswitch.txt", "h100-sxm", "13b"},
        std::tuple{"rtx3090-4gpu-nvlink-pairs.txt", "rtx3090", "6b"}}) {
    SCOPED_TRACE(fixture);
    const NodeTopology machine = testing::fixture_machine(fixture, gpu, "256G");
    const ModelConfig config = load_model_config(model);
    const PlanResult single = choose_plan(config, machine, {});
    const PlanResult one_node = choose_plan(config, machine, {}, make_cluster_shape(1, "1G", machine));
    EXPECT_EQ(describe(one_node.best.plan), describe(single.best.plan));
    EXPECT_EQ(one_node.best.cost.step_seconds, single.best.cost.step_seconds);
    ASSERT_EQ(one_node.alternatives.size(), single.alternatives.size());
    for (size_t i = 0; i < single.alternatives.size(); ++i) {
      EXPECT_EQ(describe(one_node.alternatives[i].plan), describe(single.alternatives[i].plan));
      EXPECT_EQ(one_node.alternatives[i].verdict, single.alternatives[i].verdict);
    }
    EXPECT_EQ(one_node.excluded, single.excluded);
    EXPECT_FALSE(one_node.cluster.multi_node());
  }
}

}  // namespace
}  // namespace dstrain
