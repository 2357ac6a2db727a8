#include "train/options.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/check.h"
#include "optim/schedule.h"
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

bool given_flag(const TrainOptions& options, const char* flag) {
  return !options.explicit_flags.has_value() || options.explicit_flags->count(flag) != 0;
}

void validate_options(const TrainOptions& options) {
  DSTRAIN_USER_CHECK(options.batch >= 1) << "--batch must be at least 1";
  DSTRAIN_USER_CHECK(options.seq_len >= 1) << "--seq-len must be at least 1";
  DSTRAIN_USER_CHECK(options.grad_accum >= 1) << "--grad-accum must be at least 1";
  DSTRAIN_USER_CHECK(options.steps >= 1) << "--steps must be at least 1";
  DSTRAIN_USER_CHECK(options.lr > 0 && std::isfinite(options.lr)) << "--lr must be positive";
  DSTRAIN_USER_CHECK(options.warmup >= 0) << "--warmup must not be negative";
  const LrSchedule schedule = parse_lr_schedule(options.lr_schedule);  // a UserError naming it
  DSTRAIN_USER_CHECK(parse_warmup_type(options.warmup_type) == WarmupType::Linear ||
                     is_deepspeed_schedule(schedule))
      << "--warmup-type log is DeepSpeed's warmup: use it with --lr-schedule warmup-lr, "
      << "warmup-decay-lr or warmup-cosine-lr";
  DSTRAIN_USER_CHECK(options.warmup_min_lr >= 0 && options.warmup_min_lr <= options.lr)
      << "--warmup-min-lr must be between 0 and --lr";
  DSTRAIN_USER_CHECK(options.weight_decay >= 0) << "--weight-decay must not be negative";
  DSTRAIN_USER_CHECK(options.beta1 >= 0 && options.beta1 < 1) << "--beta1 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.beta2 >= 0 && options.beta2 < 1) << "--beta2 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.eps > 0) << "--eps must be positive";
  DSTRAIN_USER_CHECK(options.grad_clip >= 0) << "--grad-clip must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.moe_capacity_factor >= 0)
      << "--moe-expert-capacity-factor must not be negative (0: dropless)";
  DSTRAIN_USER_CHECK(options.moe_bias_update_rate >= 0 && options.moe_bias_update_rate < 1)
      << "--moe-router-bias-update-rate must be in [0, 1) (0: the selection bias stays)";
  DSTRAIN_USER_CHECK(options.eval_every >= 0) << "--eval-every must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.eval_batches >= 1) << "--eval-batches must be at least 1";
  DSTRAIN_USER_CHECK(options.packing == "auto" || options.packing == "on" ||
                     options.packing == "off")
      << "--packing must be auto, on or off, not '" << options.packing << "'";
  DSTRAIN_USER_CHECK(options.batch_tokens >= 0)
      << "--batch-tokens must not be negative (0: --batch rows of --seq-len)";
  DSTRAIN_USER_CHECK(options.batch_tokens == 0 || options.packing != "on")
      << "--batch-tokens is a token budget for one conversation per row: give --packing off "
      << "(or auto) with it, or --batch with packing";
  DSTRAIN_USER_CHECK(options.save_every >= 0) << "--save-every must not be negative";
  DSTRAIN_USER_CHECK(options.keep_last >= 0) << "--keep-last must not be negative (0 keeps all)";
  DSTRAIN_USER_CHECK(options.keep_last == 0 || !options.out.empty())
      << "--keep-last needs --out (the directory checkpoints go to)";
  DSTRAIN_USER_CHECK(options.mirror.empty() || !options.out.empty() || !options.resume.empty())
      << "--mirror copies the checkpoints of --out: give --out DIR";
  DSTRAIN_USER_CHECK(options.save_dtype == "source" || options.save_dtype == "fp32" ||
                     options.save_dtype == "bf16" || options.save_dtype == "fp16")
      << "--save-dtype must be fp32, bf16, fp16 or source, not '" << options.save_dtype << "'";
  DSTRAIN_USER_CHECK(options.epochs >= 0 && std::isfinite(options.epochs))
      << "--epochs must be a positive number";
  DSTRAIN_USER_CHECK(options.lr_decay_steps >= 0)
      << "--lr-decay-steps must be at least 1 (0: the run's --steps)";
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
  Plan precision;
  set_precision(precision, options.precision);  // a UserError naming the choices
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

// The settings that define a run, under their flag names: what it trains on, its optimizer and
// schedule, its outputs. A resume takes them from the checkpoint unless given again.
template <class Fn>
void for_each_run_setting(TrainOptions& o, Fn&& fn) {
  fn("data", o.data);
  fn("val-data", o.val_data);
  fn("shuffle", o.shuffle);
  fn("packing", o.packing);
  fn("batch-tokens", o.batch_tokens);
  fn("seq-len", o.seq_len);
  fn("steps", o.steps);
  fn("lr-decay-steps", o.lr_decay_steps);
  fn("lr", o.lr);
  fn("lr-schedule", o.lr_schedule);
  fn("warmup", o.warmup);
  fn("warmup-type", o.warmup_type);
  fn("warmup-min-lr", o.warmup_min_lr);
  fn("min-lr", o.min_lr);
  fn("weight-decay", o.weight_decay);
  fn("beta1", o.beta1);
  fn("beta2", o.beta2);
  fn("eps", o.eps);
  fn("grad-clip", o.grad_clip);
  fn("moe-expert-capacity-factor", o.moe_capacity_factor);
  fn("moe-router-bias-update-rate", o.moe_bias_update_rate);
  fn("seed", o.seed);
  fn("precision", o.precision);
  fn("loss-scale-init", o.loss_scaling.initial_scale);
  fn("loss-scale-window", o.loss_scaling.growth_interval);
  fn("loss-scale-hysteresis", o.loss_scaling.hysteresis);
  fn("min-loss-scale", o.loss_scaling.min_scale);
  fn("eval-every", o.eval_every);
  fn("eval-batches", o.eval_batches);
  fn("save-every", o.save_every);
  fn("keep-last", o.keep_last);
  fn("mirror", o.mirror);
  fn("save-dtype", o.save_dtype);
  fn("out", o.out);
  fn("log", o.log);
  fn("tensorboard", o.tensorboard);
}

// The settings of the plan: how the run's steps are laid out on the machine. A resume on the
// same machine takes them from the checkpoint; on another one the planner chooses anew.
// --offload as a run remembers it: the flag's word (none, optimizer, params, all); a checkpoint
// of an earlier version has a bool (true: the optimizer).
struct OffloadSetting {
  bool optimizer = false, params = false;
  bool operator==(const OffloadSetting&) const = default;
};

void to_json(nlohmann::json& json, const OffloadSetting& setting) {
  Plan plan;
  plan.offload = setting.optimizer;
  plan.offload_params = setting.params;
  json = offload_name(plan);
}

void from_json(const nlohmann::json& json, OffloadSetting& setting) {
  if (json.is_boolean()) {
    setting = OffloadSetting{json.get<bool>(), false};
    return;
  }
  Plan plan;
  set_offload(plan, json.get<std::string>());
  setting = OffloadSetting{plan.offload, plan.offload_params};
}

template <class Fn>
void for_each_plan_setting(TrainOptions& o, Fn&& fn) {
  fn("gpus", o.gpus);
  fn("tp", o.tp);
  fn("ep", o.ep);
  fn("sequence-parallel", o.sequence_parallel);
  fn("pp", o.pp);
  fn("pp-schedule", o.pp_schedule);
  fn("pp-split", o.pp_split);
  fn("batch", o.batch);
  fn("grad-accum", o.grad_accum);
  fn("zero", o.zero);
  OffloadSetting offload{o.offload, o.offload_params};
  fn("offload", offload);
  o.offload = offload.optimizer;
  o.offload_params = offload.params;
  fn("bf16-optimizer-states", o.bf16_optimizer_states);
  fn("recompute", o.recompute);
}

template <class Fn>
void for_each_resumable(TrainOptions& o, Fn&& fn) {
  for_each_run_setting(o, fn);
  for_each_plan_setting(o, fn);
}

// The optimizer and schedule settings a resume may change, said on the way.
const std::set<std::string> kChangeableOnResume = {
    "lr",    "lr-schedule", "warmup",          "warmup-type",       "warmup-min-lr",
    "min-lr", "lr-decay-steps", "weight-decay", "beta1",            "beta2",
    "eps",   "grad-clip",   "loss-scale-init", "loss-scale-window", "loss-scale-hysteresis",
    "min-loss-scale"};

template <class T>
void take_saved(const nlohmann::json& saved, const char* flag, T& field) {
  try {
    saved.at(flag).get_to(field);
  } catch (const nlohmann::json::exception&) {
    DSTRAIN_USER_ERROR() << "the checkpoint's remembered setting --" << flag << " is malformed";
  }
}

// The largest divisor of n no larger than at_most (at least 1).
int64_t largest_divisor(int64_t n, int64_t at_most) {
  for (int64_t d = std::min(n, at_most); d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

// The checkpoint's global batch (sequences per step) split anew over this run's data-parallel
// ranks: the micro-batch `batch_fixed` keeps, else the checkpoint's if it still divides, else
// the largest that does; the accumulation follows.
void split_global_batch(TrainOptions& options, int64_t sequences, int64_t saved_micro,
                        bool batch_fixed) {
  const int64_t dp = data_parallel_ranks(options);
  DSTRAIN_USER_CHECK(sequences % dp == 0)
      << "the checkpoint's run makes each step of " << sequences << " sequences, which " << dp
      << " data-parallel ranks cannot share evenly; resume on ranks that divide it (or give "
      << "--dp, --tp, --pp)";
  const int64_t per_rank = sequences / dp;
  if (!batch_fixed) options.batch = largest_divisor(per_rank, saved_micro);
  DSTRAIN_USER_CHECK(per_rank % options.batch == 0)
      << "the checkpoint's run makes each step of " << sequences << " sequences: " << dp
      << " data-parallel ranks x --batch " << options.batch
      << " do not divide it; give a --batch that does";
  options.grad_accum = per_rank / options.batch;
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

namespace {

// The data-parallel ranks of the run whose remembered settings these are.
int64_t saved_data_parallel(const nlohmann::json& saved) {
  const int64_t model_ranks =
      std::max<int64_t>(1, saved.value("pp", int64_t{1}) * saved.value("tp", int64_t{1}));
  return std::max<int64_t>(1, saved.value("gpus", int64_t{1}) / model_ranks);
}

}  // namespace

int64_t saved_global_batch(const nlohmann::json& saved) {
  return saved.value("batch", int64_t{1}) * saved.value("grad-accum", int64_t{1}) *
         saved_data_parallel(saved);
}

ResumedSettings apply_resumable_options(TrainOptions& options, const nlohmann::json& saved,
                                        bool same_machine) {
  ResumedSettings result;
  if (!options.explicit_flags || !saved.is_object()) return result;
  std::set<std::string>& given = *options.explicit_flags;
  result.global_batch = saved_global_batch(saved);
  // The schedule's horizon is part of the run: a checkpoint of an earlier version kept it as
  // its --steps, which a resume may raise.
  if (!given.count("lr-decay-steps") && !saved.contains("lr-decay-steps") &&
      saved.contains("steps")) {
    options.lr_decay_steps = saved.value("steps", int64_t{0});
  }
  for_each_run_setting(options, [&](const char* flag, auto& field) {
    // --out: the run continues where its checkpoint lies (train/trainer.cpp), wherever the
    // directory was when it was written.
    if (!saved.contains(flag) || std::string(flag) == "out") return;
    if (!given.count(flag)) {
      take_saved(saved, flag, field);
      given.insert(flag);  // the run's: fixed for the planner and the defaults
      return;
    }
    auto before = field;
    take_saved(saved, flag, before);
    if (kChangeableOnResume.count(flag) && before != field) {
      std::ostringstream change;
      change << "--" << flag << " " << nlohmann::json(field).dump() << " (the run had "
             << nlohmann::json(before).dump() << ")";
      result.changed.push_back(change.str());
    }
  });
  const std::set<std::string> user = given;  // before the checkpoint's plan joins it
  const int64_t saved_micro = saved.value("batch", int64_t{1});
  if (!same_machine) {
    // Another machine: the planner chooses the plan for this one; only the global batch stays.
    options.global_batch_tokens = result.global_batch * options.seq_len;
    options.exact_global_batch = true;
    given.insert("global-batch-tokens");
    if (!user.count("grad-accum")) {
      split_global_batch(options, result.global_batch, saved_micro, user.count("batch") != 0);
    }
    return result;
  }
  result.plan_taken = true;
  const int64_t saved_pp = saved.value("pp", int64_t{1}), saved_dp = saved_data_parallel(saved);
  for_each_plan_setting(options, [&](const char* flag, auto& field) {
    if (user.count(flag) || !saved.contains(flag)) return;
    take_saved(saved, flag, field);
    given.insert(flag);  // the planner keeps what the checkpoint's plan was
  });
  // Another pipeline depth: the remembered split was for the old one.
  if (user.count("pp") && saved_pp != options.pp && !user.count("pp-split")) {
    options.pp_split.clear();
    given.erase("pp-split");
  }
  // A new --pp or --tp alone keeps the data-parallel ranks, a new --dp alone the model's: the
  // rank count follows.
  if ((user.count("pp") || user.count("tp") || user.count("dp")) && !user.count("gpus")) {
    const int dp = user.count("dp") && options.dp > 0 ? options.dp : static_cast<int>(saved_dp);
    options.gpus = dp * options.pp * options.tp;
  }
  // Another split of the step's sequences (ranks or micro-batch): the accumulation follows.
  const bool resplit = user.count("gpus") || user.count("pp") || user.count("tp") ||
                       user.count("dp") || user.count("batch");
  if (resplit && !user.count("grad-accum")) {
    split_global_batch(options, result.global_batch, saved_micro, true);
  }
  return result;
}

}  // namespace dstrain
