#include "parallel/plan.h"

#include <sstream>
#include <tuple>

#include "core/check.h"

namespace dstrain {

const char* precision_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "fp32";
    case DType::F16: return "fp16";
    case DType::BF16: return "bf16";
    case DType::I32:
    case DType::F8E4M3:
    case DType::F8E5M2: break;
  }
  DSTRAIN_CHECK(false) << "not a precision: " << dtype_name(dtype);
  return "?";
}

const char* precision_name(const Plan& plan) {
  return plan.fp8 ? "fp8" : precision_name(plan.param_dtype);
}

Fp8Options fp8_options(const Plan& plan) {
  return {plan.fp8, plan.fp8 && plan.fp8_weight_cache && plan.zero < 3 && !plan.offload_params};
}

void set_precision(Plan& plan, const std::string& name) {
  plan.fp8 = name == "fp8";
  if (plan.fp8) {
    plan.param_dtype = DType::BF16;
    return;
  }
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    if (name == precision_name(dtype)) {
      plan.param_dtype = dtype;
      return;
    }
  }
  DSTRAIN_USER_ERROR() << "--precision must be fp32, fp16, bf16 or fp8, not '" << name << "'";
}

const char* offload_name(const Plan& plan) {
  if (plan.offload_params) return plan.offload ? "all" : "params";
  return plan.offload ? "optimizer" : "none";
}

void set_offload(Plan& plan, const std::string& name) {
  const bool on = name == "on" || name == "yes" || name == "true" || name == "1";
  const bool off = name == "off" || name == "no" || name == "false" || name == "0";
  const std::string canonical = on ? "optimizer" : off ? "none" : name;
  for (const auto& [text, optimizer, params] :
       {std::tuple{"none", false, false}, std::tuple{"optimizer", true, false},
        std::tuple{"params", false, true}, std::tuple{"all", true, true}}) {
    if (canonical == text) {
      plan.offload = optimizer;
      plan.offload_params = params;
      return;
    }
  }
  DSTRAIN_USER_ERROR() << "--offload takes optimizer, params, all or none (on and off: "
                          "optimizer and none), not '"
                       << name << "'";
}

const char* offloaded_parts(const Plan& plan) {
  if (plan.offload_params) return plan.offload ? "parameters and optimizer" : "parameters";
  return plan.offload ? "optimizer" : "";
}

const char* const kBf16StatesNeedOffload =
    "--bf16-optimizer-states keeps the Adam moments in bf16 for the host's AdamW: it needs "
    "--offload optimizer or --offload all";

std::string describe(const Plan& plan) {
  std::ostringstream text;
  text << "dp " << plan.dp;
  if (plan.ep > 1) text << " (ep " << plan.ep << ")";
  text << " x tp " << plan.tp << " x pp " << plan.pp
       << (plan.uses_sequence_parallel() ? " (sequence parallel)" : "") << ", ZeRO-" << plan.zero
       << ", " << precision_name(plan)
       << (plan.fp8 && !fp8_options(plan).cache_weights ? " (weights cast at each use)" : "")
       << ", "
       << (plan.offload || plan.offload_params
               ? std::string(offloaded_parts(plan)) + " offloaded to host"
               : std::string("no offload"))
       << (plan.bf16_optimizer_states ? " (bf16 Adam moments)" : "") << ", ";
  if (plan.recompute == Recompute::None) {
    text << "no recompute";
  } else {
    text << recompute_name(plan.recompute) << " recompute";
  }
  text << ", micro-batch " << plan.micro_batch << " x " << plan.grad_accum
       << " accumulation (seq " << plan.seq_len << ")";
  if (plan.pp > 1) {
    text << ", " << pipeline_schedule_name(plan.pp_schedule) << " schedule";
    if (!plan.pp_split.empty()) {
      text << ", layers per stage ";
      for (size_t i = 0; i < plan.pp_split.size(); ++i) text << (i ? "," : "") << plan.pp_split[i];
    }
  }
  return text.str();
}

nlohmann::json to_json(const Plan& plan) {
  return nlohmann::json{{"dp", plan.dp},
                        {"tp", plan.tp},
                        {"ep", plan.ep},
                        {"moe_capacity_factor", plan.moe_capacity_factor},
                        {"pp", plan.pp},
                        {"zero", plan.zero},
                        {"offload", plan.offload},
                        {"offload_params", plan.offload_params},
                        {"bf16_optimizer_states", plan.bf16_optimizer_states},
                        {"recompute", recompute_name(plan.recompute)},
                        {"micro_batch", plan.micro_batch},
                        {"grad_accum", plan.grad_accum},
                        {"seq_len", plan.seq_len},
                        {"precision", precision_name(plan)},
                        {"fp8_weight_cache", fp8_options(plan).cache_weights},
                        {"pp_schedule", pipeline_schedule_name(plan.pp_schedule)},
                        {"pp_split", plan.pp_split},
                        {"sequence_parallel", plan.uses_sequence_parallel()},
                        {"world", plan.world()},
                        {"tokens_per_step", plan.tokens_per_step()}};
}

}  // namespace dstrain
