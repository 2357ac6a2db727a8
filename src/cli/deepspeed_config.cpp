#include "cli/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace {

using nlohmann::json;

// DeepSpeed's fp16 defaults (runtime/constants.py), used for the keys a config leaves out.
constexpr int kInitialScalePower = 16;
constexpr int64_t kLossScaleWindow = 1000;
constexpr int64_t kHysteresis = 2;
constexpr double kMinLossScale = 1.0;

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
  const json& checked(const std::string& key, const json& value) const {
    if (value.is_string() && value.get<std::string>() == "auto") {
      refuse(key, "is \"auto\": give the value (the Hugging Face Trainer fills these in itself)");
    }
    return value;
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
  void warmup_type(const std::string& key, const json& params);

  std::string path_;
  DeepSpeedMapping& out_;
  std::optional<double> lr_;  // the optimizer's, for WarmupCosineLR's cos_min_ratio
};

void Mapper::top_level(const json& config) {
  const bool fp16_on = config.contains("fp16") && config["fp16"].value("enabled", false) == true;
  for (const char* bf16 : {"bf16", "bfloat16"}) {
    if (!config.contains(bf16)) continue;
    const json& section = object(bf16, config[bf16]);
    if (section.contains("enabled") &&
        boolean(std::string(bf16) + ".enabled", section["enabled"])) {
      if (fp16_on) refuse("fp16.enabled and bf16.enabled", "are both true: choose one");
      set(std::string(bf16) + ".enabled", "precision", "bf16");
    }
  }
  if (config.contains("optimizer")) optimizer(object("optimizer", config["optimizer"]));
  for (const auto& [key, value] : config.items()) {
    if (key == "train_micro_batch_size_per_gpu") {
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
    if (name == "stage") {
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
}

void Mapper::offload(const std::string& key, const json& offload, bool optimizer) {
  const json device =
      offload.contains("device") ? checked(key + ".device", offload["device"]) : json("none");
  if (device == "none") return;
  if (device != "cpu")
    refuse(key + ".device", "= " + device.dump() + " is not supported (cpu or none)");
  if (!optimizer) {
    refuse(key,
           "to the CPU is not supported: dstrain offloads the optimizer (--offload) and "
           "shards parameters with ZeRO-3");
  }
  set(key + ".device", "offload", true);
}

void Mapper::fp16(const json& fp16) {
  if (!fp16.contains("enabled") || !boolean("fp16.enabled", fp16["enabled"])) return;
  set("fp16.enabled", "precision", "fp16");
  if (fp16.contains("loss_scale") && number("fp16.loss_scale", fp16["loss_scale"], 0, 1e30) != 0) {
    refuse("fp16.loss_scale",
           "is a static loss scale, which dstrain does not support (0: dynamic)");
  }
  if (fp16.value("consecutive_hysteresis", false) == true) {
    refuse("fp16.consecutive_hysteresis", "is not supported");
  }
  // A key left out takes DeepSpeed's default, and the line says so.
  const auto label = [&](const char* name) {
    return std::string("fp16.") + name + (fp16.contains(name) ? "" : " (DeepSpeed's default)");
  };
  const auto get = [&](const char* name, const json& fallback) {
    return fp16.contains(name) ? fp16[name] : fallback;
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
  if (!optimizer.contains("params")) return;
  const json& params = object("optimizer.params", optimizer["params"]);
  for (const auto& [name, value] : params.items()) {
    const std::string key = "optimizer.params." + name;
    if (name == "lr") {
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
    } else if (name != "torch_adam" && name != "fused") {
      refuse(key, "is not supported");
    }
  }
}

void Mapper::warmup_type(const std::string& key, const json& params) {
  // DeepSpeed's default warmup is logarithmic; dstrain's is linear.
  const std::string type = params.value("warmup_type", std::string("log"));
  if (type != "linear") {
    refuse(key + ".warmup_type",
           "= \"" + type +
               "\" is not supported: dstrain warms up linearly "
               "(set \"warmup_type\": \"linear\"; DeepSpeed's default is log)");
  }
}

void Mapper::scheduler(const json& scheduler) {
  const std::string type = scheduler.value("type", std::string());
  const json params = scheduler.contains("params") ? object("scheduler.params", scheduler["params"])
                                                   : json::object();
  const std::string key = "scheduler.params";
  if (type != "WarmupLR" && type != "WarmupCosineLR") {
    refuse("scheduler.type", "= \"" + type + "\" is not supported (WarmupLR, WarmupCosineLR)");
  }
  warmup_type(key, params);
  const char* min_key = type == "WarmupLR" ? "warmup_min_lr" : "warmup_min_ratio";
  if (params.contains(min_key) && number(key + "." + min_key, params[min_key], 0, 1e3) != 0) {
    refuse(key + "." + min_key, "must be 0: dstrain's warmup starts from 0");
  }
  if (params.contains("warmup_num_steps")) {
    set(key + ".warmup_num_steps", "warmup",
        integer(key + ".warmup_num_steps", params["warmup_num_steps"], 0));
  }
  if (type == "WarmupLR") {
    set("scheduler.type", "lr-schedule", "constant");
    if (params.contains("warmup_max_lr"))
      set(key + ".warmup_max_lr", "lr",
          number(key + ".warmup_max_lr", params["warmup_max_lr"], 0, 1e3));
    return;
  }
  set("scheduler.type", "lr-schedule", "cosine");
  if (params.contains("total_num_steps"))
    set(key + ".total_num_steps", "steps",
        integer(key + ".total_num_steps", params["total_num_steps"], 1));
  if (params.contains("cos_min_ratio")) {
    const double ratio = number(key + ".cos_min_ratio", params["cos_min_ratio"], 0, 1);
    if (!lr_)
      refuse(key + ".cos_min_ratio", "needs optimizer.params.lr (the peak it is a ratio of)");
    set(key + ".cos_min_ratio", "min-lr", *lr_ * ratio);
  }
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
