// `dstrain topo` and `dstrain plan` through the command-line entry point, in process: a
// user's mistake is exit code 2 and one sentence; a plan prints as text and as JSON.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/common/cli_run.h"

namespace dstrain {
namespace {

using testing::CliResult;
constexpr auto run = testing::run_cli_args;

std::string fixture(const std::string& name) {
  return std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/" + name;
}

std::vector<std::string> rtx4090_x8(std::vector<std::string> more) {
  std::vector<std::string> args = {"plan", "--from-nvidia-smi", fixture("rtx4090-8gpu-pcie.txt"),
                                   "--gpu", "rtx4090", "--host-memory", "256G"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// Exit 2 and exactly one line "dstrain: error: ..." holding `fragment`.
constexpr auto expect_user_error = testing::expect_cli_user_error;

TEST(PlanCli, PrintsThePlanMemoryTimeAndAlternatives) {
  const CliResult r = run(rtx4090_x8({"--model", "6b"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* part : {"plan: dp ", "memory per GPU", "total", "step: ", "tokens/s",
                           "alternatives", "slower by", "not possible here", "not NVLink"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
}

TEST(PlanCli, PlanJsonHasTheFieldsToolsRead) {
  const CliResult r = run(rtx4090_x8({"--model", "gpt2-124m", "--plan-json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const char* key : {"dp", "tp", "pp", "zero", "offload", "recompute", "micro_batch",
                          "grad_accum", "memory_bytes_per_gpu", "step_seconds", "alternatives"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["dp"].get<int>() * j["tp"].get<int>() * j["pp"].get<int>(), 8);
  EXPECT_EQ(j["global_batch_tokens"], 524288);
  EXPECT_GT(j["memory_bytes_per_gpu"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["alternatives"][0].contains("why"));
}

TEST(PlanCli, FixedPartsAndDefaults) {
  const CliResult r = run(rtx4090_x8({"--model", "gpt2-124m", "--plan-json", "--zero", "2",
                                      "--micro-batch", "8", "--seq-len", "512", "--gpus", "4"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["zero"], 2);
  EXPECT_EQ(j["micro_batch"], 8);
  EXPECT_EQ(j["seq_len"], 512);
  EXPECT_EQ(j["gpus"], 4);
}

TEST(PlanCli, MistakesAreOneSentenceAndExitTwo) {
  expect_user_error(rtx4090_x8({"--model", "6b", "--gpus", "0"}), "--gpus must be at least 1");
  expect_user_error(rtx4090_x8({"--model", "6b", "--gpus", "9"}), "more GPUs than the machine's 8");
  expect_user_error({"plan", "--from-nvidia-smi", fixture("rtx4090-8gpu-pcie.txt"), "--gpu",
                     "rtx9999", "--model", "6b"},
                    "unknown GPU 'rtx9999'");
  expect_user_error(rtx4090_x8({"--model", "6b", "--zero", "0", "--offload", "off", "--pp", "1"}),
                    "does not fit");
  expect_user_error(rtx4090_x8({"--model", "6b", "--tp", "2"}), "not NVLink");
  expect_user_error(rtx4090_x8({"--model", "6b", "--recompute", "some"}), "none, selective or full");
  expect_user_error(rtx4090_x8({"--model", "6b", "--offload", "maybe"}),
                    "--offload takes optimizer, params, all or none");
  expect_user_error(rtx4090_x8({}), "needs --model");
  expect_user_error(rtx4090_x8({"--model", "6b", "--bogus"}), "unknown flag --bogus");
  expect_user_error({"plan", "--from-nvidia-smi", fixture("rtx4090-8gpu-pcie.txt"), "--model", "6b"},
                    "--gpu");
  expect_user_error({"plan", "--topology", fixture("nope.json"), "--model", "6b"}, "nope.json");
}

// --gpu-memory plans as if every GPU had only that much: Llama 3.2 1B on one H200 takes
// micro-batches of 16 (42 GiB); as if it had an RTX 4090's 24 GB, micro-batches of 1 under
// the 20.6 GiB usable. Qwen2.5-7B does not fit 24 GB without parameter offload (issue 31): one
// sentence naming the 24 GiB.
TEST(PlanCli, GpuMemoryPlansAsIfTheGpuHadOnlyThat) {
  auto h200 = [](const std::string& model, std::vector<std::string> more) {
    std::vector<std::string> args = {"plan", "--model", model, "--from-nvidia-smi",
                                     fixture("single-gpu.txt"), "--gpu", "h200", "--host-memory",
                                     "256G", "--global-batch-tokens", "16384"};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  const CliResult whole = run(h200("llama3.2-1b", {"--plan-json"}));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const nlohmann::json w = nlohmann::json::parse(whole.out);
  EXPECT_EQ(w["micro_batch"], 16);
  EXPECT_GT(w["memory_bytes_per_gpu"].get<uint64_t>(), uint64_t{24} << 30);
  const CliResult small = run(h200("llama3.2-1b", {"--plan-json", "--gpu-memory", "24G"}));
  ASSERT_EQ(small.exit_code, 0) << small.err;
  const nlohmann::json j = nlohmann::json::parse(small.out);
  EXPECT_EQ(j["gpu_memory_bytes"].get<uint64_t>(), uint64_t{24} << 30);
  EXPECT_LT(j["micro_batch"].get<int>(), 16);
  EXPECT_LE(j["memory_bytes_per_gpu"].get<uint64_t>(), j["usable_memory_bytes_per_gpu"]);
  // A 7B in 24 GiB: only with its parameters on the host (issue 31), and the plan says why;
  // resident it does not fit, in one sentence.
  const CliResult offloaded = run(h200("qwen2.5-7b", {"--plan-json", "--gpu-memory", "24G"}));
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  const nlohmann::json o = nlohmann::json::parse(offloaded.out);
  EXPECT_EQ(o["offload_params"], true);
  EXPECT_NE(o["offload_choice"].get<std::string>().find("does not fit"), std::string::npos);
  expect_user_error(h200("qwen2.5-7b", {"--gpu-memory", "24G", "--offload", "optimizer"}),
                    "the plan fixed by --offload optimizer does not fit");
  expect_user_error(h200("llama3.2-1b", {"--gpu-memory", "0"}),
                    "--gpu-memory 0: give a size above 0");
  expect_user_error(h200("llama3.2-1b", {"--gpu-memory", "lots"}), "lots");
}

// A mixture-of-experts model on the 8 x RTX 4090 box: the planner chooses ep and says why, --ep
// fixes it, an expert capacity makes the experts' buffers smaller, and what cannot split is one
// sentence.
TEST(PlanCli, MixtureOfExpertsPlansSayWhyTheirEpAndTakeItFixed) {
  const CliResult chosen = run(rtx4090_x8({"--model", "deepseek-moe-16b"}));
  ASSERT_EQ(chosen.exit_code, 0) << chosen.err;
  EXPECT_NE(chosen.out.find("expert parallelism: ep "), std::string::npos) << chosen.out;
  EXPECT_NE(chosen.out.find("expert parallel link"), std::string::npos) << chosen.out;
  const CliResult json = run(rtx4090_x8({"--model", "deepseek-moe-16b", "--plan-json"}));
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_GT(j["ep"].get<int>(), 1);
  EXPECT_TRUE(j.contains("ep_choice"));
  const CliResult fixed =
      run(rtx4090_x8({"--model", "deepseek-moe-16b", "--plan-json", "--ep", "8"}));
  ASSERT_EQ(fixed.exit_code, 0) << fixed.err;
  EXPECT_EQ(nlohmann::json::parse(fixed.out)["ep"], 8);
  auto activations = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = {"--model",
                                     "deepseek-moe-16b",
                                     "--plan-json",
                                     "--ep",
                                     "4",
                                     "--pp",
                                     "2",
                                     "--zero",
                                     "1",
                                     "--recompute",
                                     "selective",
                                     "--offload",
                                     "on",
                                     "--micro-batch",
                                     "1"};
    args.insert(args.end(), more.begin(), more.end());
    const CliResult r = run(rtx4090_x8(args));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["memory_by_category"]["activations"].get<uint64_t>();
  };
  EXPECT_LT(activations({"--moe-expert-capacity-factor", "1.25"}), activations({}));
  expect_user_error(rtx4090_x8({"--model", "deepseek-moe-16b", "--ep", "3"}),
                    "needs the experts (64) divisible by 3");
  expect_user_error(rtx4090_x8({"--model", "6b", "--ep", "2"}), "needs a mixture-of-experts model");
}

// DeepSeek-V2-Lite (15.7B, latent attention, 64 experts) fits 8 RTX 4090s and says how; V3
// (671B) is one sentence with what it would need: more memory per GPU, and how many such nodes
// its states alone take (9999 GiB over 361.6 GiB a node: 28).
TEST(PlanCli, DeepSeekV2LiteFitsEightRtx4090sAndV3SaysWhatItNeeds) {
  const CliResult lite = run(rtx4090_x8({"--model", "deepseek-v2-lite"}));
  ASSERT_EQ(lite.exit_code, 0) << lite.err;
  for (const char* part : {"deepseek_v2, 15.71B parameters", "plan: dp ", "expert parallelism"}) {
    EXPECT_NE(lite.out.find(part), std::string::npos) << part << "\n" << lite.out;
  }
  expect_user_error(rtx4090_x8({"--model", "deepseek-v3"}), "need at least 28 such nodes of 8 GPUs");
}

// Dropless, V3 fits no plan of 32 such nodes (every expert's receive buffer holds the worst
// case); the sentence names the flags with which one fits, and with them the planner plans.
// The planner never drops tokens unasked.
TEST(PlanCli, DroplessMoeThatFitsNoPlanNamesTheCapacityFactorThatFits) {
  const std::vector<std::string> v3 = {"--model", "deepseek-v3", "--nnodes", "32"};
  const std::string flags = "--moe-expert-capacity-factor 1.25 --bf16-optimizer-states";
  expect_user_error(rtx4090_x8(v3), "it fits with " + flags + " (each expert takes at most 1.25");
  std::vector<std::string> capped = v3;
  for (const char* flag : {"--moe-expert-capacity-factor", "1.25", "--bf16-optimizer-states"}) {
    capped.push_back(flag);
  }
  const CliResult r = run(rtx4090_x8(capped));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("plan: dp "), std::string::npos) << r.out;
}

// 8 x H100 on NVSwitch with 4 RDMA NICs (NIC0..NIC3: mlx5_0, mlx5_3, mlx5_4, mlx5_5).
std::vector<std::string> h100_nodes(std::vector<std::string> more) {
  std::vector<std::string> args = {"plan", "--from-nvidia-smi",
                                   fixture("h100-8gpu-nvswitch-4nic.txt"), "--gpu", "h100-sxm",
                                   "--host-memory", "2T", "--model", "13b"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(PlanCli, NnodesExplainsTheClusterAndKeepsTensorParallelismInsideANode) {
  const CliResult r = run(h100_nodes({"--nnodes", "4"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 4 NICs x 200 Gbit/s assumed at 90% = 90 GB/s per node (topology/cluster.cpp).
  for (const char* part :
       {"on 32 x NVIDIA H100", "each node: ",
        "cluster: 4 nodes x 8 GPUs joined by InfiniBand/RoCE, 90 GB/s per node each way (from 4 "
        "InfiniBand/RoCE NICs (mlx5_0, mlx5_3, mlx5_4, mlx5_5) in nvidia-smi topo -m",
        "rank = node x 8 + GPU; tensor parallelism stays inside a node", "placement: "}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }

  const CliResult json = run(h100_nodes({"--nnodes", "4", "--plan-json"}));
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["nnodes"], 4);
  EXPECT_EQ(j["gpus_per_node"], 8);
  EXPECT_EQ(j["gpus"], 32);
  EXPECT_EQ(j["dp"].get<int>() * j["tp"].get<int>() * j["pp"].get<int>(), 32);
  EXPECT_EQ(8 % j["tp"].get<int>(), 0);
  EXPECT_EQ(j["inter_node"]["kind"], "InfiniBand/RoCE");
  EXPECT_DOUBLE_EQ(j["inter_node"]["bytes_per_s"].get<double>(), 90e9);
  EXPECT_NE(j["inter_node"]["source"].get<std::string>().find("mlx5_0"), std::string::npos);

  const CliResult given = run(h100_nodes({"--nnodes", "4", "--inter-node-bandwidth", "100G",
                                          "--plan-json"}));
  ASSERT_EQ(given.exit_code, 0) << given.err;
  const nlohmann::json g = nlohmann::json::parse(given.out);
  EXPECT_DOUBLE_EQ(g["inter_node"]["bytes_per_s"].get<double>(), 12.5e9);
  EXPECT_EQ(g["inter_node"]["source"], "--inter-node-bandwidth 100G");
}

TEST(PlanCli, OneNodeLooksAsBefore) {
  const CliResult r = run(h100_nodes({"--nnodes", "1", "--plan-json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["nnodes"], 1);
  EXPECT_FALSE(j.contains("inter_node"));
  const CliResult text = run(h100_nodes({}));
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(text.out.find("cluster:"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("  machine: "), std::string::npos) << text.out;
}

TEST(PlanCli, BadNodeCountsAndBandwidthsAreOneSentence) {
  expect_user_error(h100_nodes({"--nnodes", "0"}), "--nnodes must be between 1 and 65536, not 0");
  expect_user_error(h100_nodes({"--nnodes=-2"}), "--nnodes must be between 1 and 65536, not -2");
  expect_user_error(h100_nodes({"--nnodes", "two"}), "--nnodes");
  expect_user_error(h100_nodes({"--nnodes", "2", "--inter-node-bandwidth", "fast"}),
                    "--inter-node-bandwidth 'fast' is not a bandwidth");
  // 2 nodes x 6 GPUs: tp 4 divides the 12 ranks and 13b's 40 heads, but ranks 4-7 span nodes.
  expect_user_error(h100_nodes({"--nnodes", "2", "--gpus", "6", "--tp", "4"}),
                    "tp 4 would put ranks 4-7 of node 0 and node 1 in one tensor-parallel group");
  const CliResult help = run({"plan", "--help"});
  ASSERT_EQ(help.exit_code, 0) << help.err;
  EXPECT_NE(help.out.find("--nnodes"), std::string::npos);
  EXPECT_NE(help.out.find("--inter-node-bandwidth"), std::string::npos);
}

TEST(PlanCli, WithoutAMachineSaysWhatItNeeds) {
  // This build has no CUDA and the test machines no driver: nothing to plan for.
  const CliResult probe = run({"topo", "--json"});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  if (!nlohmann::json::parse(probe.out)["gpus"].empty()) GTEST_SKIP() << "this machine has GPUs";
  expect_user_error({"plan", "--model", "6b"}, "--from-nvidia-smi FILE with --gpu NAME");
}

TEST(TopoCli, ShowsAMachineFromNvidiaSmiText) {
  const CliResult table =
      run({"topo", "--from-nvidia-smi", fixture("rtx4090-8gpu-pcie.txt"), "--gpu", "4090"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("NVIDIA GeForce RTX 4090"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("SYS*"), std::string::npos) << table.out;

  const CliResult json = run({"topo", "--json", "--from-nvidia-smi",
                              fixture("h100-8gpu-nvswitch.txt"), "--gpu", "h100-sxm",
                              "--host-memory", "2T"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["gpus"].size(), 8u);
  EXPECT_EQ(j["links"].size(), 28u);
  EXPECT_EQ(j["links"][0]["kind"], "nvlink");
  EXPECT_EQ(j["host_memory_bytes"], uint64_t{2} << 40);
}

TEST(TopoCli, ThisMachineWithoutGpusIsAStatementNotAnError) {
  const CliResult r = run({"topo"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.find("No NVIDIA GPU found") != std::string::npos ||
              r.out.find("GPU") != std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace dstrain
