#include "train/options.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_split.h"
#include "topology/cluster.h"
#include "topology/units.h"
#include "train/run_trace.h"

namespace dstrain {

uint64_t save_shard_bytes(const TrainOptions& options) {
  try {
    return parse_size(options.save_shard_size);
  } catch (const UserError& error) {
    DSTRAIN_USER_ERROR() << "--save-shard-size: " << error.what();
  }
  return 0;
}

void validate_options(const TrainOptions& options) {
  DSTRAIN_USER_CHECK(options.batch >= 1) << "--batch must be at least 1";
  DSTRAIN_USER_CHECK(options.seq_len >= 1) << "--seq-len must be at least 1";
  DSTRAIN_USER_CHECK(options.grad_accum >= 1) << "--grad-accum must be at least 1";
  DSTRAIN_USER_CHECK(options.steps >= 1) << "--steps must be at least 1";
  DSTRAIN_USER_CHECK(options.lr > 0 && std::isfinite(options.lr)) << "--lr must be positive";
  DSTRAIN_USER_CHECK(options.warmup >= 0) << "--warmup must not be negative";
  DSTRAIN_USER_CHECK(options.weight_decay >= 0) << "--weight-decay must not be negative";
  DSTRAIN_USER_CHECK(options.beta1 >= 0 && options.beta1 < 1) << "--beta1 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.beta2 >= 0 && options.beta2 < 1) << "--beta2 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.eps > 0) << "--eps must be positive";
  DSTRAIN_USER_CHECK(options.grad_clip >= 0) << "--grad-clip must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.eval_every >= 0) << "--eval-every must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.eval_batches >= 1) << "--eval-batches must be at least 1";
  DSTRAIN_USER_CHECK(options.save_every >= 0) << "--save-every must not be negative";
  (void)save_shard_bytes(options);  // a UserError naming the flag
  DSTRAIN_USER_CHECK(options.save_every == 0 || !options.out.empty())
      << "--save-every needs --out (the directory checkpoints go to)";
  DSTRAIN_USER_CHECK(options.gpus >= 1) << "--gpus must be at least 1";
  const int per_node = options.gpus / std::max(1, options.rendezvous.nnodes);  // train(): the world's
  DSTRAIN_USER_CHECK(per_node <= 64)
      << "--gpus " << per_node << " is more ranks than one machine holds (at most 64)";
  DSTRAIN_USER_CHECK(options.zero >= 0 && options.zero <= 3)
      << "--zero must be 0, 1, 2 or 3, not " << options.zero;
  DSTRAIN_USER_CHECK(options.comm_timeout > 0) << "--comm-timeout must be positive (seconds)";
  DSTRAIN_USER_CHECK(options.device == "auto" || options.device == "cpu" ||
                     options.device == "cuda")
      << "--device must be auto, cpu or cuda, not '" << options.device << "'";
  DSTRAIN_USER_CHECK(options.precision == "fp32" || options.precision == "fp16" ||
                     options.precision == "bf16")
      << "--precision must be fp32, fp16 or bf16, not '" << options.precision << "'";
  const LossScaling& scaling = options.loss_scaling;
  DSTRAIN_USER_CHECK(scaling.initial_scale > 0 && std::isfinite(scaling.initial_scale))
      << "--loss-scale-init must be a positive number";
  DSTRAIN_USER_CHECK(scaling.growth_interval >= 1) << "--loss-scale-window must be at least 1";
  DSTRAIN_USER_CHECK(scaling.hysteresis >= 1) << "--loss-scale-hysteresis must be at least 1";
  DSTRAIN_USER_CHECK(scaling.min_scale >= 0 && scaling.min_scale <= scaling.initial_scale)
      << "--min-loss-scale must be between 0 and --loss-scale-init";
  DSTRAIN_USER_CHECK(options.sample_tokens >= 0) << "--sample must not be negative";
  DSTRAIN_USER_CHECK(options.pp >= 1 && options.pp <= 64) << "--pp must be 1 to 64, not " << options.pp;
  DSTRAIN_USER_CHECK(options.tp >= 1) << "--tp must be at least 1, not " << options.tp;
  parse_pipeline_schedule(options.pp_schedule);  // a UserError naming the flag
  parse_trace_steps(options.trace_steps);        // likewise
  DSTRAIN_USER_CHECK(options.check_replicas >= 0) << "--check-replicas must not be negative";
  if (!options.inter_node_bandwidth.empty()) parse_network_bandwidth(options.inter_node_bandwidth);
  if (!options.pp_split.empty()) parse_pipeline_split(options.pp_split);
}

int data_parallel_ranks(const TrainOptions& options) {
  return std::max(1, options.gpus / (options.tp * options.pp));
}

namespace {

// Each remembered setting: its flag name and the field.
template <class Fn>
void for_each_resumable(TrainOptions& o, Fn&& fn) {
  fn("data", o.data);
  fn("val-data", o.val_data);
  fn("shuffle", o.shuffle);
  fn("batch", o.batch);
  fn("seq-len", o.seq_len);
  fn("grad-accum", o.grad_accum);
  fn("gpus", o.gpus);
  fn("tp", o.tp);
  fn("sequence-parallel", o.sequence_parallel);
  fn("pp", o.pp);
  fn("pp-schedule", o.pp_schedule);
  fn("pp-split", o.pp_split);
  fn("steps", o.steps);
  fn("lr", o.lr);
  fn("lr-schedule", o.lr_schedule);
  fn("warmup", o.warmup);
  fn("min-lr", o.min_lr);
  fn("weight-decay", o.weight_decay);
  fn("beta1", o.beta1);
  fn("beta2", o.beta2);
  fn("eps", o.eps);
  fn("grad-clip", o.grad_clip);
  fn("seed", o.seed);
  fn("precision", o.precision);
  fn("loss-scale-init", o.loss_scaling.initial_scale);
  fn("loss-scale-window", o.loss_scaling.growth_interval);
  fn("loss-scale-hysteresis", o.loss_scaling.hysteresis);
  fn("min-loss-scale", o.loss_scaling.min_scale);
  fn("zero", o.zero);
  fn("offload", o.offload);
  fn("recompute", o.recompute);
  fn("eval-every", o.eval_every);
  fn("eval-batches", o.eval_batches);
  fn("save-every", o.save_every);
  fn("out", o.out);
  fn("log", o.log);
}

}  // namespace

nlohmann::json resumable_options(const TrainOptions& options) {
  TrainOptions copy = options;
  nlohmann::json saved = nlohmann::json::object();
  for_each_resumable(copy, [&](const char* flag, auto& field) { saved[flag] = field; });
  return saved;
}

nlohmann::json run_config(const TrainOptions& options) {
  nlohmann::json config = resumable_options(options);
  config["model"] = options.model;
  if (!options.init_from.empty()) config["init-from"] = options.init_from;
  if (!options.tokenizer.empty()) config["tokenizer"] = options.tokenizer;
  config["device"] = options.device;
  config["threads"] = options.threads;
  config["comm-timeout"] = options.comm_timeout;
  config["save-shard-size"] = options.save_shard_size;
  config["sample"] = options.sample_tokens;
  if (!options.trace.empty()) {
    config["trace"] = options.trace;
    config["trace-steps"] = options.trace_steps;
  }
  if (options.check_replicas > 0) config["check-replicas"] = options.check_replicas;
  return config;
}

void apply_resumable_options(TrainOptions& options, const nlohmann::json& saved) {
  if (!options.explicit_flags || !saved.is_object()) return;
  const std::set<std::string>& given = *options.explicit_flags;
  const bool ranks_given =
      given.count("gpus") != 0 || given.count("pp") != 0 || given.count("tp") != 0;
  const bool accum_given = given.count("grad-accum") != 0;
  const int64_t saved_dp = std::max<int64_t>(
      1, saved.value("gpus", int64_t{1}) /
             (saved.value("pp", int64_t{1}) * saved.value("tp", int64_t{1})));
  const int64_t micro_batches = saved.value("grad-accum", int64_t{1}) * saved_dp;
  const bool new_depth = given.count("pp") != 0 && saved.value("pp", int64_t{1}) != options.pp;
  for_each_resumable(options, [&](const char* flag, auto& field) {
    if (given.count(flag) || !saved.contains(flag)) return;
    try {
      saved.at(flag).get_to(field);
    } catch (const nlohmann::json::exception&) {
      DSTRAIN_USER_ERROR() << "the checkpoint's remembered setting --" << flag << " is malformed";
    }
  });
  // Another pipeline depth: the remembered split was for the old one.
  if (new_depth && given.count("pp-split") == 0) options.pp_split.clear();
  // A new --pp or --tp alone keeps the data-parallel ranks: the rank count follows.
  if ((given.count("pp") != 0 || given.count("tp") != 0) && given.count("gpus") == 0) {
    options.gpus = static_cast<int>(saved_dp) * options.pp * options.tp;
  }
  // Other ranks than before, same micro-batches per step: the accumulation follows.
  if (ranks_given && !accum_given) {
    const int dp = data_parallel_ranks(options);
    DSTRAIN_USER_CHECK(micro_batches % dp == 0)
        << "the checkpoint's run makes each step of " << micro_batches << " micro-batches, which "
        << dp << " data-parallel ranks cannot share evenly; give --grad-accum too";
    options.grad_accum = micro_batches / dp;
  }
}

}  // namespace dstrain
