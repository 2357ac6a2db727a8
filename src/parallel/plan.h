// Plan: how one training step is laid out over the GPUs of a machine.
//
//   ranks = dp x tp x pp. Rank r has tensor-parallel index r % tp, data-parallel index
//   (r / tp) % dp and pipeline stage r / (tp * dp): tensor parallelism is innermost (its
//   groups are consecutive GPUs, so they can sit inside one NVLink island), the pipeline
//   outermost (its point-to-point traffic is the lightest).
//   ZeRO stage 0..3 shards state over the data-parallel group (parallel/memory_model.h).
//   One optimizer step = grad_accum micro-batches of micro_batch sequences of seq_len tokens
//   on each data-parallel rank: dp * micro_batch * grad_accum * seq_len tokens.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>

#include <nlohmann/json.hpp>

#include <vector>

#include "core/dtype.h"
#include "model/architecture.h"
#include "parallel/pipeline_schedule.h"

namespace dstrain {

// Recompute (none | selective | full) is the model's (model/architecture.h): plan_stage_buffers
// plans the buffers each mode keeps.

struct Plan {
  int dp = 1, tp = 1, pp = 1;
  // Expert parallelism: the experts of every MoE layer split over ep ranks of the data-parallel
  // group (each expert whole on one of them); ep divides dp. The ranks of data-parallel index d
  // hold the experts of ep rank d % ep, and exchange tokens with the ep - 1 others of their
  // group (parallel/groups.h).
  int ep = 1;
  int zero = 0;            // ZeRO stage 0..3 over the data-parallel group
  bool offload = false;    // fp32 master weights + Adam moments (and the step) in host memory
  // The working parameters and their gradients in host memory too, each block brought to the
  // GPU ahead of its use (--offload params / all; parallel/sharded_model.h).
  bool offload_params = false;
  // The Adam moments in bf16 (DeepSpeed's bf16_optimizer_states), with the optimizer offloaded:
  // 4 bytes a parameter instead of 8 (optim/host_adamw.h).
  bool bf16_optimizer_states = false;
  Recompute recompute = Recompute::None;
  int64_t micro_batch = 1; // sequences per micro-batch per data-parallel rank
  int64_t grad_accum = 1;  // micro-batches per optimizer step (the pipeline's micro-batches)
  int64_t seq_len = 1024;  // T
  // Precision of the working parameters, gradients and activations. F32: no master copy.
  // F16 / BF16: mixed precision with an fp32 master copy (on the device, or on the host with
  // offload).
  DType param_dtype = DType::F32;
  // --precision fp8: param_dtype BF16, and the projections of attention and of the dense MLPs
  // in FP8 on their way through the tensor cores (model/fp8_linear.h).
  bool fp8 = false;
  // fp8 with the working parameters resident (ZeRO 0-2, not offloaded): each layer's FP8
  // weights kept from one use to the next (fp8_options). The planner weighs it: 2 bytes a
  // parameter of the layers' linears against casting each weight twice a micro-batch.
  bool fp8_weight_cache = true;
  // pp > 1: the order of forwards and backwards (parallel/pipeline_schedule.h), and the layers
  // of each stage (parallel/pipeline_split.h; empty: the balanced split).
  PipelineScheduleKind pp_schedule = PipelineScheduleKind::OneFOneB;
  std::vector<int64_t> pp_split;
  // tp > 1: sequence parallelism (model/tensor_parallel.h) outside the tensor-parallel regions.
  bool sequence_parallel = true;
  // Mixture-of-experts models: an expert capacity (model/expert_parallel.h), which also bounds
  // the experts' buffers; 0: dropless, the buffers for the worst case.
  double moe_capacity_factor = 0;
  // Packed sequences (--packing on): every stage reads the token batch, the middle stages for
  // its positions (attention and rotary restart at each sequence). Set from the data when the
  // run starts (train/run_start.cpp), not part of the plan's JSON.
  bool packed_sequences = false;
  // --batch-tokens: micro-batches of whole conversations up to this many positions, each of
  // its own shape (b, t) with b * t <= micro_batch * seq_len; every stage reads the token batch
  // for that shape. Set with packed_sequences; 0: every micro-batch (micro_batch, seq_len).
  int64_t batch_tokens = 0;

  int world() const { return dp * tp * pp; }
  int64_t tokens_per_step() const { return dp * micro_batch * grad_accum * seq_len; }
  bool mixed_precision() const { return param_dtype != DType::F32; }
  DType moment_dtype() const { return bf16_optimizer_states ? DType::BF16 : DType::F32; }
  bool uses_sequence_parallel() const { return tp > 1 && sequence_parallel; }
  // --batch-tokens: what a micro-batch's width rounds up to: 8 positions, and a multiple of tp
  // under sequence parallelism (its b * t rows split over the tp ranks).
  int64_t token_batch_width_multiple() const {
    return uses_sequence_parallel() ? std::lcm(int64_t{8}, int64_t{tp}) : 8;
  }
};

// "fp32", "fp16", "bf16".
const char* precision_name(DType dtype);
// --precision's word for a plan: "fp8" where plan.fp8, else precision_name(param_dtype).
const char* precision_name(const Plan& plan);
// --precision fp8's choices for the model (model/fp8_linear.h Fp8Options): the FP8 weights
// cached where the plan asks (fp8_weight_cache) and the working parameters stay resident
// (ZeRO 0-2, not offloaded). Under ZeRO-3 or parameter offload holding whole weights is what
// the plan avoids: the casts stay.
Fp8Options fp8_options(const Plan& plan);
// Sets plan.param_dtype and plan.fp8 from --precision's word (fp32, fp16, bf16 or fp8); throws
// UserError naming the choices otherwise.
void set_precision(Plan& plan, const std::string& name);

// What --offload names: "none", "optimizer", "params", "all".
const char* offload_name(const Plan& plan);
// What the plan keeps in host memory, for people: "parameters and optimizer", "parameters",
// "optimizer", or "" (nothing).
const char* offloaded_parts(const Plan& plan);

// The sentence for bf16 optimizer states without the optimizer offloaded.
extern const char* const kBf16StatesNeedOffload;

// Sets plan.offload and plan.offload_params from one of those names (and on / off, yes / no,
// true / false, 1 / 0 for optimizer / none); throws UserError naming the choices otherwise.
void set_offload(Plan& plan, const std::string& name);

// One line for people: "dp 8 x tp 1 x pp 1, ZeRO-1, bf16, no offload, no recompute,
// micro-batch 8 x 8 accumulation (seq 1024)".
std::string describe(const Plan& plan);

// {"dp", "tp", "pp", "zero", "offload", "recompute", "micro_batch", "grad_accum", "seq_len",
//  "precision", "fp8_weight_cache" (whether fp8_options caches), "pp_schedule", "ep", "pp_split",
//  "sequence_parallel", "world", "tokens_per_step", "offload_params"};
//  pp_split as the plan has
// it (an empty list: the balanced split; the planner and the trainer fill it in).
nlohmann::json to_json(const Plan& plan);

}  // namespace dstrain
