#include "cli/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <map>

#include "core/check.h"
#include "core/fs.h"
#include "parallel/plan.h"

namespace dstrain {

namespace {

using nlohmann::json;

// DeepSpeed's fp16 defaults (runtime/constants.py), used for the keys a config leaves out.
constexpr int kInitialScalePower = 16;
constexpr int64_t kLossScaleWindow = 1000;
constexpr int64_t kHysteresis = 2;
constexpr double kMinLossScale = 1.0;

// DeepSpeed's defaults for what an "optimizer" block leaves out: FusedAdam's and
// DeepSpeedCPUAdam's (deepspeed/ops/adam/fused_adam.py, cpu_adam.py: lr=1e-3,
// betas=(0.9, 0.999), eps=1e-8, weight_decay=0).
constexpr double kAdamLr = 1e-3;
constexpr double kAdamBeta1 = 0.9, kAdamBeta2 = 0.999;
constexpr double kAdamEps = 1e-8;
constexpr double kAdamWeightDecay = 0.0;
// Its schedulers' (deepspeed/runtime/lr_schedules.py): warmup_num_steps=1000, warmup_type
// "log", WarmupDecayLR's warmup_max_lr=0.001, WarmupCosineLR's cos_min_ratio=0.0001.
constexpr int64_t kWarmupNumSteps = 1000;
constexpr double kWarmupDecayMaxLr = 0.001;
constexpr double kCosMinRatio = 0.0001;

// Keys of DeepSpeed's own machinery that change nothing in what is computed.
const std::set<std::string> kNoEffect = {"wall_clock_breakdown",
                                         "zero_allow_untested_optimizer",
                                         "dump_state",
                                         "memory_breakdown",
                                         "activation_checkpointing",
                                         "flops_profiler",
                                         "tensorboard",
                                         "wandb",
                                         "csv_monitor",
                                         "comms_logger"};
const std::set<std::string> kZeroNoEffect = {"overlap_comm",
                                             "contiguous_gradients",
                                             "reduce_bucket_size",
                                             "allgather_bucket_size",
                                             "reduce_scatter",
                                             "allgather_partitions",
                                             "round_robin_gradients",
                                             "stage3_prefetch_bucket_size",
                                             "stage3_param_persistence_threshold",
                                             "stage3_max_live_parameters",
                                             "stage3_max_reuse_distance",
                                             "sub_group_size",
                                             "stage3_gather_16bit_weights_on_model_save",
                                             "gather_16bit_weights_on_model_save",
                                             "load_from_fp32_weights",
                                             "elastic_checkpoint",
                                             "ignore_unused_parameters",
                                             "memory_efficient_linear",
                                             "cpu_offload"};

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Reads one config; every message names the file and the key.
class Mapper {
 public:
  Mapper(std::string path, DeepSpeedMapping& out) : path_(std::move(path)), out_(out) {}

  [[noreturn]] void refuse(const std::string& key, const std::string& why) const {
    DSTRAIN_USER_ERROR() << "deepspeed config " << path_ << ": " << key << " " << why;
  }
  // "auto" (the Hugging Face Trainer's placeholder): DeepSpeed drops it inside its sections
  // (the default applies) and the Trainer fills the rest from its own arguments; dstrain fills
  // it from its flags. Callers handle it before reading a value.
  static bool is_auto(const json& value) {
    return value.is_string() && value.get<std::string>() == "auto";
  }
  const json& checked(const std::string& key, const json& value) const {
    if (is_auto(value)) refuse(key, "is \"auto\" where dstrain has no value to give it");
    return value;
  }
  void automatic(const std::string& key, const std::string& what) {
    out_.lines.push_back(key + " = auto -> " + what);
  }
  double number(const std::string& key, const json& value, double low, double high) const {
    checked(key, value);
    if (!value.is_number() || !(value.get<double>() >= low && value.get<double>() <= high)) {
      refuse(key, "= " + value.dump() + " is not a number in [" + json(low).dump() + ", " +
                      json(high).dump() + "]");
    }
    return value.get<double>();
  }
  int64_t integer(const std::string& key, const json& value, int64_t low) const {
    checked(key, value);
    if (!value.is_number_integer() || value.get<int64_t>() < low) {
      refuse(key, "= " + value.dump() + " is not an integer >= " + std::to_string(low));
    }
    return value.get<int64_t>();
  }
  bool boolean(const std::string& key, const json& value) const {
    checked(key, value);
    if (!value.is_boolean()) refuse(key, "must be true or false");
    return value.get<bool>();
  }
  const json& object(const std::string& key, const json& value) const {
    if (!value.is_object()) refuse(key, "must be an object");
    return value;
  }
  void set(const std::string& key, const std::string& flag, const json& value) {
    out_.flags[flag] = value;
    out_.lines.push_back(key + " -> --" + flag + " " +
                         (value.is_string() ? value.get<std::string>() : value.dump()));
  }
  void no_effect(const std::string& key, const std::string& why) {
    out_.lines.push_back(key + ": no effect in dstrain (" + why + ")");
  }

  void top_level(const json& config);

 private:
  void zero(const json& zero);
  void offload(const std::string& key, const json& offload, bool optimizer);
  void fp16(const json& fp16);
  void optimizer(const json& optimizer);
  void scheduler(const json& scheduler);
  void warmup(const std::string& type, const json& params);
  void warmup_cosine(const json& params);
  void total_steps(const std::string& type, const json& params);
  // A scheduler parameter: the config's value, else DeepSpeed's default (said so); nullopt for
  // "auto" (said so: dstrain's `flag` fills it).
  std::optional<json> param(const json& params, const std::string& name, const json& fallback,
                            const std::string& flag);

  // What offload_optimizer and offload_param put on the CPU, and the keys that said so.
  bool offload_optimizer_ = false, offload_param_ = false;
  std::string offload_keys_;

  std::string path_;
  DeepSpeedMapping& out_;
  std::optional<double> lr_;  // the optimizer's, for WarmupCosineLR's ratios
};

void Mapper::top_level(const json& config) {
  const bool fp16_on = config.contains("fp16") && config["fp16"].is_object() &&
                       config["fp16"].contains("enabled") && config["fp16"]["enabled"] == true;
  for (const char* bf16 : {"bf16", "bfloat16"}) {
    if (!config.contains(bf16)) continue;
    const json& section = object(bf16, config[bf16]);
    if (section.contains("enabled") && is_auto(section["enabled"])) {
      automatic(std::string(bf16) + ".enabled", "dstrain's --precision");
    } else if (section.contains("enabled") &&
               boolean(std::string(bf16) + ".enabled", section["enabled"])) {
      if (fp16_on) refuse("fp16.enabled and bf16.enabled", "are both true: choose one");
      set(std::string(bf16) + ".enabled", "precision", "bf16");
    }
    const std::string states = std::string(bf16) + ".bf16_optimizer_states";
    if (section.contains("bf16_optimizer_states") && !is_auto(section["bf16_optimizer_states"]) &&
        boolean(states, section["bf16_optimizer_states"])) {
      set(states, "bf16-optimizer-states", true);
    }
    const std::string master = std::string(bf16) + ".bf16_master_weights_and_grads";
    if (section.contains("bf16_master_weights_and_grads") &&
        !is_auto(section["bf16_master_weights_and_grads"]) &&
        boolean(master, section["bf16_master_weights_and_grads"])) {
      refuse(master, "is not supported: dstrain keeps an fp32 master copy of the weights");
    }
  }
  if (config.contains("optimizer")) optimizer(object("optimizer", config["optimizer"]));
  const std::map<std::string, std::string> filled = {
      {"train_micro_batch_size_per_gpu", "--batch"}, {"gradient_accumulation_steps", "--grad-accum"},
      {"train_batch_size", "--batch x --grad-accum x data-parallel ranks"},
      {"gradient_clipping", "--grad-clip"}, {"steps_per_print", "--print-every"}};
  for (const auto& [key, value] : config.items()) {
    if (is_auto(value) && filled.count(key)) {
      automatic(key, "dstrain's " + filled.at(key) + " (as the Hugging Face Trainer fills it)");
    } else if (key == "train_micro_batch_size_per_gpu") {
      set(key, "batch", integer(key, value, 1));
    } else if (key == "gradient_accumulation_steps") {
      set(key, "grad-accum", integer(key, value, 1));
    } else if (key == "train_batch_size") {
      out_.train_batch_size = integer(key, value, 1);
      out_.lines.push_back(key + " " + value.dump() +
                           " -> micro-batch x accumulation x data-parallel ranks");
    } else if (key == "steps_per_print") {
      set(key, "print-every", integer(key, value, 0));
    } else if (key == "gradient_clipping") {
      set(key, "grad-clip", number(key, value, 0, 1e30));
    } else if (key == "zero_optimization") {
      zero(object(key, value));
    } else if (key == "fp16") {
      fp16(object(key, value));
    } else if (key == "scheduler") {
      scheduler(object(key, value));
    } else if (key == "prescale_gradients" || key == "gradient_predivide_factor") {
      const bool neutral =
          key == "prescale_gradients" ? !boolean(key, value) : number(key, value, 0, 1e30) == 1.0;
      if (!neutral) refuse(key, "is not supported: dstrain averages the gradients once, in fp32");
    } else if (kNoEffect.count(key)) {
      no_effect(key, key == "activation_checkpointing" ? "--recompute decides, or the planner"
                                                       : "a DeepSpeed diagnostic");
    } else if (key != "optimizer" && key != "bf16" && key != "bfloat16") {
      refuse(key, "is not supported (dstrain --help lists what it does)");
    }
  }
}

void Mapper::zero(const json& zero) {
  for (const auto& [name, value] : zero.items()) {
    const std::string key = "zero_optimization." + name;
    if (is_auto(value)) {
      automatic(key, name == "stage" ? "the planner's ZeRO stage" : "DeepSpeed's default");
    } else if (name == "stage") {
      set(key, "zero", integer(key, value, 0));
      if (value.get<int64_t>() > 3) refuse(key, "must be 0, 1, 2 or 3");
    } else if (name == "offload_optimizer" || name == "offload_param") {
      offload(key, object(key, value), name == "offload_optimizer");
    } else if (kZeroNoEffect.count(name)) {
      no_effect(key, "dstrain gathers and reduces one block at a time, overlapped");
    } else {
      refuse(key, "is not supported");
    }
  }
  if (offload_optimizer_ || offload_param_) {
    Plan plan;
    plan.offload = offload_optimizer_;
    plan.offload_params = offload_param_;
    set(offload_keys_, "offload", offload_name(plan));
  }
}

void Mapper::offload(const std::string& key, const json& offload, bool optimizer) {
  const json device = offload.contains("device") && !is_auto(offload["device"])
                          ? offload["device"]
                          : json("none");  // DeepSpeed drops "auto": its default, none
  if (device == "none") return;
  if (device != "cpu")
    refuse(key + ".device", "= " + device.dump() + " is not supported (cpu or none)");
  (optimizer ? offload_optimizer_ : offload_param_) = true;
  offload_keys_ += (offload_keys_.empty() ? "" : " + ") + key + ".device";
  for (const auto& [name, value] : offload.items()) {
    const std::string sub = key + "." + name;
    if (name == "device") continue;
    if (name == "pin_memory" && !is_auto(value) && boolean(sub, value)) {
      out_.lines.push_back(sub + " true -> pinned host memory (as dstrain always offloads)");
    } else if (name == "pin_memory") {
      no_effect(sub, "dstrain's offloaded state is always pinned: its copies overlap compute "
                     "only from page-locked memory; --host-memory budgets it");
    } else {
      no_effect(sub, "dstrain moves one block at a time, planned by its memory model");
    }
  }
}

void Mapper::fp16(const json& fp16) {
  if (fp16.contains("enabled") && is_auto(fp16["enabled"])) {
    automatic("fp16.enabled", "dstrain's --precision");
    return;
  }
  if (!fp16.contains("enabled") || !boolean("fp16.enabled", fp16["enabled"])) return;
  set("fp16.enabled", "precision", "fp16");
  if (fp16.contains("loss_scale") && !is_auto(fp16["loss_scale"]) &&
      number("fp16.loss_scale", fp16["loss_scale"], 0, 1e30) != 0) {
    refuse("fp16.loss_scale",
           "is a static loss scale, which dstrain does not support (0: dynamic)");
  }
  if (fp16.contains("consecutive_hysteresis") && fp16["consecutive_hysteresis"] == true) {
    refuse("fp16.consecutive_hysteresis", "is not supported");
  }
  // A key left out takes DeepSpeed's default, and the line says so.
  // A key left out, or "auto" (which DeepSpeed drops), takes DeepSpeed's default.
  const auto given = [&](const char* name) { return fp16.contains(name) && !is_auto(fp16[name]); };
  const auto label = [&](const char* name) {
    return std::string("fp16.") + name + (given(name) ? "" : " (DeepSpeed's default)");
  };
  const auto get = [&](const char* name, const json& fallback) {
    return given(name) ? fp16[name] : fallback;
  };
  const double power =
      number(label("initial_scale_power"), get("initial_scale_power", kInitialScalePower), 0, 126);
  set(label("initial_scale_power"), "loss-scale-init", std::ldexp(1.0, static_cast<int>(power)));
  set(label("loss_scale_window"), "loss-scale-window",
      integer(label("loss_scale_window"), get("loss_scale_window", kLossScaleWindow), 1));
  set(label("hysteresis"), "loss-scale-hysteresis",
      integer(label("hysteresis"), get("hysteresis", kHysteresis), 1));
  set(label("min_loss_scale"), "min-loss-scale",
      number(label("min_loss_scale"), get("min_loss_scale", kMinLossScale), 0, 1e30));
}

void Mapper::optimizer(const json& optimizer) {
  const std::string type = lower(optimizer.value("type", std::string()));
  if (type != "adam" && type != "adamw") {
    refuse("optimizer.type", "= " + optimizer.value("type", json()).dump() +
                                 " is not supported: dstrain trains with AdamW");
  }
  const json params = optimizer.contains("params")
                          ? object("optimizer.params", optimizer["params"])
                          : json::object();
  for (const auto& [name, value] : params.items()) {
    const std::string key = "optimizer.params." + name;
    if (is_auto(value)) {
      automatic(key, "dstrain's own flag (as the Hugging Face Trainer fills it)");
      if (name == "lr") lr_.reset();
    } else if (name == "lr") {
      lr_ = number(key, value, 0, 1e3);
      set(key, "lr", *lr_);
    } else if (name == "betas") {
      if (!value.is_array() || value.size() != 2) refuse(key, "must be [beta1, beta2]");
      set(key + "[0]", "beta1", number(key, value[0], 0, 1));
      set(key + "[1]", "beta2", number(key, value[1], 0, 1));
    } else if (name == "eps") {
      set(key, "eps", number(key, value, 0, 1));
    } else if (name == "weight_decay") {
      set(key, "weight-decay", number(key, value, 0, 1e3));
    } else if (name == "adam_w_mode" || name == "bias_correction") {
      if (!boolean(key, value))
        refuse(
            key,
            "= false is not supported: dstrain's AdamW decouples the decay and corrects the bias");
    } else if (name == "torch_adam") {
      if (boolean(key, value)) {
        refuse(key, "= true picks torch.optim.AdamW, whose defaults differ (weight_decay "
                    "0.01): leave it out, or give every parameter");
      }
    } else if (name != "fused") {
      refuse(key, "is not supported");
    }
  }
  // What the block leaves out takes DeepSpeed's Adam defaults, not dstrain's.
  const std::string label = " (DeepSpeed's default)";
  if (!params.contains("lr")) {
    lr_ = kAdamLr;
    set("optimizer.params.lr" + label, "lr", kAdamLr);
  }
  if (!params.contains("betas")) {
    set("optimizer.params.betas[0]" + label, "beta1", kAdamBeta1);
    set("optimizer.params.betas[1]" + label, "beta2", kAdamBeta2);
  }
  if (!params.contains("eps")) set("optimizer.params.eps" + label, "eps", kAdamEps);
  if (!params.contains("weight_decay")) {
    set("optimizer.params.weight_decay" + label, "weight-decay", kAdamWeightDecay);
  }
}

std::optional<json> Mapper::param(const json& params, const std::string& name,
                                  const json& fallback, const std::string& flag) {
  const std::string key = "scheduler.params." + name;
  if (params.contains(name) && is_auto(params[name])) {
    automatic(key, "dstrain's " + flag + " (as the Hugging Face Trainer fills it)");
    return std::nullopt;
  }
  if (params.contains(name)) return params[name];
  out_.lines.push_back(key + " (DeepSpeed's default) = " + fallback.dump());
  return fallback;
}

// The warmup every DeepSpeed scheduler shares: its steps, shape and start.
void Mapper::warmup(const std::string& type, const json& params) {
  const std::string key = "scheduler.params";
  if (const auto steps = param(params, "warmup_num_steps", kWarmupNumSteps, "--warmup")) {
    set(key + ".warmup_num_steps", "warmup", integer(key + ".warmup_num_steps", *steps, 1));
  }
  if (const auto shape = param(params, "warmup_type", "log", "--warmup-type")) {
    const std::string name = shape->is_string() ? shape->get<std::string>() : shape->dump();
    // DeepSpeed warns about any other and warms up logarithmically.
    set(key + ".warmup_type" + (name == "linear" || name == "log" ? "" : " (unknown: log, as DeepSpeed)"),
        "warmup-type", name == "linear" ? "linear" : "log");
  }
  if (type == "WarmupCosineLR") return;  // its warmup starts at a ratio of the lr
  if (const auto start = param(params, "warmup_min_lr", 0.0, "--warmup-min-lr")) {
    set(key + ".warmup_min_lr", "warmup-min-lr", number(key + ".warmup_min_lr", *start, 0, 1e3));
    // WarmupDecayLR decays back to where the warmup started.
    if (type == "WarmupDecayLR") set(key + ".warmup_min_lr", "min-lr", start->get<double>());
  }
  // WarmupLR's peak is the optimizer's lr unless given; WarmupDecayLR's defaults to 0.001.
  const json peak = type == "WarmupDecayLR" ? json(kWarmupDecayMaxLr) : json();
  if (params.contains("warmup_max_lr") || !peak.is_null()) {
    if (const auto max = param(params, "warmup_max_lr", peak, "--lr")) {
      set(key + ".warmup_max_lr", "lr", number(key + ".warmup_max_lr", *max, 0, 1e3));
    }
  } else {
    out_.lines.push_back(key + ".warmup_max_lr (DeepSpeed's default): the optimizer's lr");
  }
}

// WarmupCosineLR's ratios are of the optimizer's lr (its org_lrs).
void Mapper::warmup_cosine(const json& params) {
  const std::string key = "scheduler.params";
  if (!lr_) {
    refuse("scheduler WarmupCosineLR",
           "counts its learning rates as ratios of the optimizer's lr: give optimizer.params.lr");
  }
  if (const auto ratio = param(params, "warmup_min_ratio", 0.0, "--warmup-min-lr")) {
    set(key + ".warmup_min_ratio", "warmup-min-lr",
        *lr_ * number(key + ".warmup_min_ratio", *ratio, 0, 1));
  }
  if (const auto ratio = param(params, "cos_min_ratio", kCosMinRatio, "--min-lr")) {
    set(key + ".cos_min_ratio", "min-lr", *lr_ * number(key + ".cos_min_ratio", *ratio, 0, 1));
  }
}

// total_num_steps: the decay's horizon (and the run's length, which --steps may change).
void Mapper::total_steps(const std::string& type, const json& params) {
  const std::string key = "scheduler.params.total_num_steps";
  if (!params.contains("total_num_steps")) refuse(key, "is required by " + type);
  if (is_auto(params["total_num_steps"])) {
    automatic(key, "dstrain's --steps (as the Hugging Face Trainer fills it)");
    return;
  }
  const int64_t total = integer(key, params["total_num_steps"], 1);
  set(key, "lr-decay-steps", total);
  set(key, "steps", total);
}

void Mapper::scheduler(const json& scheduler) {
  const std::string type = scheduler.value("type", std::string());
  if (type != "WarmupLR" && type != "WarmupDecayLR" && type != "WarmupCosineLR") {
    refuse("scheduler.type", "= \"" + type +
                                 "\" is not supported (WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  }
  if (!scheduler.contains("params")) {
    refuse("scheduler.params", "is missing: DeepSpeed builds " + type + " from it");
  }
  const json& params = object("scheduler.params", scheduler["params"]);
  for (const auto& [name, value] : params.items()) {
    static const std::set<std::string> known = {
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
        "warmup_min_ratio", "cos_min_ratio", "last_batch_iteration"};
    if (!known.count(name)) refuse("scheduler.params." + name, "is not a parameter of " + type);
  }
  if (params.contains("last_batch_iteration") && params["last_batch_iteration"] != -1) {
    refuse("scheduler.params.last_batch_iteration",
           "other than -1 is not supported: resume a run with --resume instead");
  }
  set("scheduler.type", "lr-schedule",
      type == "WarmupLR" ? "warmup-lr" : type == "WarmupDecayLR" ? "warmup-decay-lr"
                                                                 : "warmup-cosine-lr");
  warmup(type, params);
  if (type == "WarmupCosineLR") warmup_cosine(params);
  if (type != "WarmupLR") total_steps(type, params);
}

}  // namespace

DeepSpeedMapping map_deepspeed_config(const std::string& path) {
  std::error_code error;
  DSTRAIN_USER_CHECK(std::filesystem::is_regular_file(path, error))
      << "deepspeed config " << path << " does not exist or is not a file";
  json config;
  try {
    config = json::parse(read_file(path));
  } catch (const json::exception& parse_error) {
    DSTRAIN_USER_ERROR() << "deepspeed config " << path << " is not valid JSON ("
                         << parse_error.what() << ")";
  }
  DSTRAIN_USER_CHECK(config.is_object()) << "deepspeed config " << path << " is not a JSON object";
  DeepSpeedMapping mapping;
  try {
    Mapper(path, mapping).top_level(config);
  } catch (const json::exception& type_error) {  // a field of the wrong JSON type
    DSTRAIN_USER_ERROR() << "deepspeed config " << path << " has a field of an unexpected type ("
                         << type_error.what() << ")";
  }
  return mapping;
}

void apply_train_batch_size(const DeepSpeedMapping& mapping, const std::set<std::string>& given,
                            TrainOptions& options) {
  if (!mapping.train_batch_size) return;
  const int64_t total = *mapping.train_batch_size;
  const bool micro = given.count("batch") != 0, accum = given.count("grad-accum") != 0;
  if (given.count("gpus") == 0 && !(micro && accum)) {
    options.global_batch_tokens = total * options.seq_len;  // the planner shares it out
    return;
  }
  const int64_t dp = data_parallel_ranks(options);
  if (micro && !accum) {
    DSTRAIN_USER_CHECK(total % (options.batch * dp) == 0)
        << "train_batch_size " << total << " is not a multiple of the micro-batch " << options.batch
        << " x " << dp << " data-parallel ranks";
    options.grad_accum = total / (options.batch * dp);
  } else if (accum && !micro) {
    DSTRAIN_USER_CHECK(total % (options.grad_accum * dp) == 0)
        << "train_batch_size " << total << " is not a multiple of the accumulation "
        << options.grad_accum << " x " << dp << " data-parallel ranks";
    options.batch = total / (options.grad_accum * dp);
  }
  DSTRAIN_USER_CHECK(options.batch * options.grad_accum * dp == total)
      << "train_batch_size " << total << " is not the micro-batch " << options.batch << " x "
      << options.grad_accum << " accumulation steps x " << dp << " data-parallel ranks";
}

}  // namespace dstrain
