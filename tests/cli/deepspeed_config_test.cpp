// --deepspeed-config: a DeepSpeed ds_config.json as dstrain's flags, what has no effect named,
// what dstrain cannot do refused in one sentence naming the key; and a run trained from one.
#include "cli/deepspeed_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "tests/common/temp_dir.h"

namespace dstrain {
namespace {

using nlohmann::json;

class DeepSpeedConfigTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  DeepSpeedMapping map(const json& config) const {
    const std::string path = (temp_.path() / "ds_config.json").string();
    std::ofstream(path) << config.dump(2);
    return map_deepspeed_config(path);
  }
  void expect_refused(const json& config, const std::string& fragment) const {
    try {
      map(config);
      ADD_FAILURE() << "accepted: " << config.dump();
    } catch (const UserError& error) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
          << "expected '" << fragment << "' in: " << error.what();
    }
  }
};

// A ZeRO-3 + optimizer offload fp16 config as DeepSpeed's tutorials write it.
const json kZero3Offload = json::parse(R"({
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 8,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "none"},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "stage3_prefetch_bucket_size": 5e8
  },
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
           "min_loss_scale": 2},
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000,
      "warmup_num_steps": 50, "warmup_min_ratio": 0, "cos_min_ratio": 0.1,
      "warmup_type": "linear"}},
  "wall_clock_breakdown": false
})");

TEST_F(DeepSpeedConfigTest, MapsATypicalZero3OffloadFp16Config) {
  const DeepSpeedMapping mapping = map(kZero3Offload);
  const json expected = {{"batch", 4},
                         {"grad-accum", 8},
                         {"grad-clip", 1.0},
                         {"print-every", 10},
                         {"zero", 3},
                         {"offload", "optimizer"},
                         {"precision", "fp16"},
                         {"loss-scale-init", 4096.0},
                         {"loss-scale-window", 500},
                         {"loss-scale-hysteresis", 2},  // DeepSpeed's default, not given
                         {"min-loss-scale", 2.0},
                         {"lr", 3e-4},
                         {"beta1", 0.9},
                         {"beta2", 0.95},
                         {"eps", 1e-8},
                         {"weight-decay", 0.1},
                         {"lr-schedule", "warmup-cosine-lr"},
                         {"lr-decay-steps", 1000},
                         {"steps", 1000},
                         {"warmup", 50},
                         {"warmup-type", "linear"},
                         {"warmup-min-lr", 0.0},
                         {"min-lr", 3e-4 * 0.1}};
  EXPECT_EQ(mapping.flags, expected) << mapping.flags.dump(1);
  std::string all;
  for (const std::string& line : mapping.lines) all += line + "\n";
  for (const char* named : {"zero_optimization.stage -> --zero 3",
                            "zero_optimization.overlap_comm: no effect in dstrain",
                            "stage3_prefetch_bucket_size: no effect",
                            "wall_clock_breakdown: no effect",
                            "fp16.initial_scale_power"}) {
    EXPECT_NE(all.find(named), std::string::npos) << named << " in:\n" << all;
  }
  EXPECT_FALSE(mapping.train_batch_size.has_value());
}

// The two configs most of our users start from (issue 31), verbatim: ZeRO-3 with the optimizer
// and the parameters on the CPU, fp16; and the same without offload_param, with a dynamic loss
// scale said as "loss_scale": 0.
TEST_F(DeepSpeedConfigTest, MapsParameterOffloadToTheCpu) {
  const json all = json::parse(R"({"train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu"}}, "fp16": {"enabled": true}, "steps_per_print": 10,
      "wall_clock_breakdown": false})");
  DeepSpeedMapping mapping = map(all);
  EXPECT_EQ(mapping.flags["offload"], "all") << mapping.flags.dump(1);
  EXPECT_EQ(mapping.flags["zero"], 3);
  EXPECT_EQ(mapping.flags["precision"], "fp16");
  EXPECT_EQ(mapping.flags["batch"], 4);
  EXPECT_EQ(mapping.flags["grad-accum"], 4);
  std::string lines;
  for (const std::string& line : mapping.lines) lines += line + "\n";
  EXPECT_NE(lines.find("zero_optimization.offload_optimizer.device + "
                       "zero_optimization.offload_param.device -> --offload all"),
            std::string::npos)
      << lines;
  EXPECT_NE(lines.find("offload_optimizer.pin_memory true -> pinned"), std::string::npos) << lines;
  json optimizer_only = all;
  optimizer_only["zero_optimization"].erase("offload_param");
  optimizer_only["fp16"]["loss_scale"] = 0;
  mapping = map(optimizer_only);
  EXPECT_EQ(mapping.flags["offload"], "optimizer");
  json params_only = all;
  params_only["zero_optimization"]["offload_optimizer"]["device"] = "none";
  params_only["zero_optimization"]["offload_param"]["pin_memory"] = false;
  params_only["zero_optimization"]["offload_param"]["buffer_count"] = 5;
  mapping = map(params_only);
  EXPECT_EQ(mapping.flags["offload"], "params");
  lines.clear();
  for (const std::string& line : mapping.lines) lines += line + "\n";
  EXPECT_NE(lines.find("offload_param.pin_memory: no effect"), std::string::npos) << lines;
  EXPECT_NE(lines.find("offload_param.buffer_count: no effect"), std::string::npos) << lines;
  // DeepSpeed's bf16 optimizer states; its bf16 master weights are not something dstrain does.
  json states = all;
  states.erase("fp16");
  states["bf16"] = {{"enabled", true}, {"bf16_optimizer_states", true}};
  mapping = map(states);
  EXPECT_EQ(mapping.flags["bf16-optimizer-states"], true) << mapping.flags.dump(1);
  EXPECT_EQ(mapping.flags["precision"], "bf16");
  states["bf16"]["bf16_master_weights_and_grads"] = true;
  expect_refused(states, "bf16.bf16_master_weights_and_grads");
}

TEST_F(DeepSpeedConfigTest, RefusesWhatDstrainCannotDoNamingTheKey) {
  json c = kZero3Offload;
  c["zero_optimization"]["offload_optimizer"]["device"] = "nvme";
  expect_refused(c, "zero_optimization.offload_optimizer.device");
  c = kZero3Offload;
  c["zero_optimization"]["offload_param"]["device"] = "nvme";
  expect_refused(c, "zero_optimization.offload_param.device");
  c = kZero3Offload;
  c["fp16"]["loss_scale"] = 128;
  expect_refused(c, "static loss scale");
  c = kZero3Offload;
  c["optimizer"]["type"] = "Lamb";
  expect_refused(c, "optimizer.type");
  c = kZero3Offload;
  c["optimizer"]["params"]["lr"] = "auto";  // WarmupCosineLR's ratios need it
  expect_refused(c, "ratios of the optimizer's lr");
  c = kZero3Offload;
  c["scheduler"].erase("params");
  expect_refused(c, "scheduler.params is missing");
  c = kZero3Offload;
  c["scheduler"]["params"].erase("total_num_steps");
  expect_refused(c, "total_num_steps is required by WarmupCosineLR");
  c = kZero3Offload;
  c["scheduler"]["params"]["warmup_num_steps"] = 0;  // DeepSpeed: a positive integer
  expect_refused(c, "warmup_num_steps");
  c = kZero3Offload;
  c["optimizer"]["params"]["torch_adam"] = true;
  expect_refused(c, "torch_adam");
  c = kZero3Offload;
  c["scheduler"] = {{"type", "OneCycle"}};
  expect_refused(c, "scheduler.type");
  c = kZero3Offload;
  c["sparse_attention"] = json::object();
  expect_refused(c, "sparse_attention is not supported");
  c = kZero3Offload;
  c["zero_optimization"]["stage"] = 4;
  expect_refused(c, "zero_optimization.stage");
  c = kZero3Offload;
  c["bf16"] = {{"enabled", true}};
  expect_refused(c, "choose one");
}

// Each value as DeepSpeed's own code sets it, read at deepspeedai/DeepSpeed edaa722 (v0.19.6
// dev): what a config leaves out takes DeepSpeed's default, not dstrain's.
struct MappingRow {
  const char* why;     // where DeepSpeed sets it
  const char* config;  // the ds_config.json
  json flags;          // the dstrain flags it becomes
};

TEST_F(DeepSpeedConfigTest, EachMappedValueAsDeepSpeedsCodeSetsIt) {
  const std::vector<MappingRow> rows = {
      {"ops/adam/fused_adam.py:76-85: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0; "
       "runtime/engine.py:2097-2100: Adam is AdamW unless adam_w_mode is false",
       R"({"optimizer": {"type": "Adam"}})",
       {{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight-decay", 0.0}}},
      {"runtime/lr_schedules.py:700-714: WarmupLR(warmup_min_lr=0.0, warmup_max_lr=None -> the "
       "optimizer's lr, warmup_num_steps=1000, warmup_type='log')",
       R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95],
           "eps": 1e-8, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}})",
       {{"lr", 2e-5}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight-decay", 0.1},
        {"lr-schedule", "warmup-lr"}, {"warmup", 100}, {"warmup-type", "log"},
        {"warmup-min-lr", 0.0}}},
      {"runtime/lr_schedules.py:789-814: WarmupDecayLR(total_num_steps, warmup_max_lr=0.001 "
       "(not the optimizer's), ...), decaying linearly back to warmup_min_lr",
       R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}})",
       {{"lr-schedule", "warmup-decay-lr"}, {"warmup", 1000}, {"warmup-type", "log"},
        {"warmup-min-lr", 0.0}, {"min-lr", 0.0}, {"lr", 0.001}, {"lr-decay-steps", 500},
        {"steps", 500}}},
      {"runtime/lr_schedules.py:840-903: WarmupCosineLR(total_num_steps, warmup_min_ratio=0.0, "
       "warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type='log'), ratios of the "
       "optimizer's lr",
       R"({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
           "eps": 1e-8, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000}}})",
       {{"lr", 3e-4}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight-decay", 0.1},
        {"lr-schedule", "warmup-cosine-lr"}, {"warmup", 1000}, {"warmup-type", "log"},
        {"warmup-min-lr", 0.0}, {"min-lr", 3e-4 * 1e-4}, {"lr-decay-steps", 1000},
        {"steps", 1000}}},
      {"runtime/precision_config.py:105-155: initial_scale_power=16, loss_scale_window=1000, "
       "hysteresis=2, min_loss_scale=1",
       R"({"fp16": {"enabled": true}})",
       {{"precision", "fp16"}, {"loss-scale-init", 65536.0}, {"loss-scale-window", 1000},
        {"loss-scale-hysteresis", 2}, {"min-loss-scale", 1.0}}},
      {"runtime/config_utils.py:54-57: DeepSpeed drops \"auto\" inside its sections (the "
       "default applies); transformers' HfTrainerDeepSpeedConfig fills the rest from its "
       "arguments, as dstrain from its flags",
       R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "offload_optimizer": {"device": "auto"}}})",
       {{"zero", 3}}},
  };
  for (const MappingRow& row : rows) {
    const DeepSpeedMapping mapping = map(json::parse(row.config));
    EXPECT_EQ(mapping.flags, row.flags) << row.why << "\n" << mapping.flags.dump(1);
  }
}

TEST_F(DeepSpeedConfigTest, TrainBatchSizeIsMicroBatchTimesAccumulationTimesRanks) {
  DeepSpeedMapping mapping;
  mapping.train_batch_size = 32;
  TrainOptions options;
  options.gpus = 2;
  options.batch = 4;
  apply_train_batch_size(mapping, {"gpus", "batch"}, options);
  EXPECT_EQ(options.grad_accum, 4);  // 32 = 4 x 4 x 2
  options.grad_accum = 2;
  apply_train_batch_size(mapping, {"gpus", "grad-accum"}, options);
  EXPECT_EQ(options.batch, 8);  // 32 = 8 x 2 x 2
  options.batch = 4;
  EXPECT_THROW(apply_train_batch_size(mapping, {"gpus", "batch", "grad-accum"}, options), UserError);
  options.batch = 3;
  EXPECT_THROW(apply_train_batch_size(mapping, {"gpus", "batch"}, options), UserError);
  // The ranks left to the planner: it gets the step's tokens.
  TrainOptions planned;
  planned.seq_len = 128;
  apply_train_batch_size(mapping, {}, planned);
  EXPECT_EQ(planned.global_batch_tokens, 32 * 128);
}

}  // namespace
}  // namespace dstrain
