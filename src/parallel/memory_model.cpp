#include "parallel/memory_model.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string_view>
#include <tuple>

#include "core/arena.h"
#include "core/check.h"

namespace dstrain {

uint64_t BufferSize::bytes() const {
  return static_cast<uint64_t>(numel) * dtype_size(dtype);
}

// ---- Model state --------------------------------------------------------------------------

int64_t shard_numel(int64_t block_numel, int world) {
  DSTRAIN_CHECK(world >= 1 && block_numel >= 0);
  return (block_numel + world - 1) / world;
}

BlockStateSizes block_state_sizes(int64_t block_numel, const ShardingSpec& spec) {
  DSTRAIN_CHECK(spec.zero >= 0 && spec.zero <= 3) << "ZeRO stage " << spec.zero;
  DSTRAIN_CHECK(spec.world >= 1 && block_numel >= 0) << spec.world << " " << block_numel;
  const DType p = spec.param_dtype;
  BlockStateSizes s;
  s.numel = block_numel;
  s.shard = shard_numel(block_numel, spec.world);
  s.padded = s.shard * spec.world;
  s.optimizer_numel = spec.zero >= 1 ? s.shard : s.padded;
  s.params = {MemCategory::Parameters, p, spec.zero >= 3 ? s.shard : s.padded, spec.offload_params};
  s.grads = {MemCategory::Gradients, p, spec.zero >= 2 ? s.shard : s.padded, spec.offload_params};
  if (spec.offload) {
    // The host steps the fp32 master: with fp32 parameters too, so the device's copy is only
    // ever written (by the upload), never read back.
    s.master = {MemCategory::OptimizerStateHost, DType::F32, s.optimizer_numel, true};
    s.exp_avg = {MemCategory::OptimizerStateHost, spec.moment_dtype, s.optimizer_numel, true};
  } else {
    if (p != DType::F32) s.master = {MemCategory::MasterWeights, DType::F32, s.optimizer_numel, false};
    s.exp_avg = {MemCategory::OptimizerState, spec.moment_dtype, s.optimizer_numel, false};
  }
  s.exp_avg_sq = s.exp_avg;
  return s;
}

RankStateBuffers rank_state_buffers(const std::vector<int64_t>& block_numels,
                                    const std::vector<int>& block_worlds, int embedding_position,
                                    const ShardingSpec& spec) {
  DSTRAIN_CHECK(block_worlds.empty() || block_worlds.size() == block_numels.size());
  const DType p = spec.param_dtype;
  int64_t max_padded = 0, max_other_padded = 0, max_shard = 0, max_optimizer = 0;
  int64_t embedding_padded = 0;
  for (size_t i = 0; i < block_numels.size(); ++i) {
    ShardingSpec block_spec = spec;
    if (!block_worlds.empty()) block_spec.world = block_worlds[i];
    const BlockStateSizes s = block_state_sizes(block_numels[i], block_spec);
    max_padded = std::max(max_padded, s.padded);
    if (static_cast<int>(i) == embedding_position) {
      embedding_padded = s.padded;
    } else {
      max_other_padded = std::max(max_other_padded, s.padded);
    }
    max_shard = std::max(max_shard, s.shard);
    max_optimizer = std::max(max_optimizer, s.optimizer_numel);
  }
  RankStateBuffers r;
  if (spec.zero >= 3 || spec.offload_params) {
    for (BufferSize& b : r.gathered_params) b = {MemCategory::GatheredParams, p, max_padded, false};
  }
  if (spec.zero >= 2 || spec.offload_params) {
    r.embedding_grads = {MemCategory::CommBuffers, p, embedding_padded, false};
    for (BufferSize& b : r.block_grads) b = {MemCategory::CommBuffers, p, max_other_padded, false};
  }
  if (spec.zero >= 1) r.reduced_shard = {MemCategory::CommBuffers, p, max_shard, false};
  if (spec.zero >= 2 && spec.offload_params) {
    r.shard_sum = {MemCategory::CommBuffers, p, max_shard, false};
  }
  if (spec.offload && !spec.offload_params) {
    for (BufferSize& b : r.host_grad_staging) b = {MemCategory::CommBuffers, p, max_optimizer, true};
    r.host_param_staging = r.host_grad_staging;
  }
  return r;
}

uint64_t token_batch_bytes(int64_t micro_batch, int64_t seq_len) {
  // inputs, targets and the positions of packed sequences
  return 3 * static_cast<uint64_t>(micro_batch * seq_len) * sizeof(int32_t);
}

bool stage_reads_tokens(const Plan& plan, const StageRange& range) {
  return range.first || range.last || plan.packed_sequences || plan.batch_tokens > 0;
}

// ---- Activations ----------------------------------------------------------------------------
//
// The stage's own plan (model/stage.h, plan_stage_buffers) for one tp rank's architecture:
// exactly what ModelStage allocates, with or without tensor and sequence parallelism.

namespace memory_detail {

struct ActivationTable {  // one stage shape's bytes
  uint64_t slot = 0, recomputed = 0, workspace = 0;
};

namespace {

ActivationTable make_activation_table(const Architecture& arch, const Plan& plan,
                                      const StageRange& range, Recompute recompute) {
  const StageBuffers buffers = plan_stage_buffers(arch, range, plan.micro_batch, plan.seq_len,
                                                  plan.param_dtype, true, recompute, 1);
  return ActivationTable{buffers.slot.bytes(), buffers.recomputed.bytes(),
                         buffers.workspace.bytes()};
}

void check_plan(const ModelConfig& config, const Plan& plan) {
  DSTRAIN_CHECK(plan.dp >= 1 && plan.tp >= 1 && plan.pp >= 1 && plan.pp <= config.n_layer &&
                tp_unsupported_reason(config, plan.tp).empty() && plan.ep >= 1 &&
                plan.dp % plan.ep == 0 && ep_unsupported_reason(config, plan.ep).empty() &&
                plan.zero >= 0 && plan.zero <= 3 && plan.micro_batch >= 1 && plan.grad_accum >= 1 &&
                plan.seq_len >= 1 &&
                (!plan.uses_sequence_parallel() || plan.micro_batch * plan.seq_len % plan.tp == 0))
      << describe(plan);
}

}  // namespace
}  // namespace memory_detail

using namespace memory_detail;

const ActivationTable& MemoryModel::activation_table(const Plan& plan, const StageRange& range,
                                                     Recompute recompute) const {
  // The bytes depend on the number of layers, not on which, when every layer is alike: then
  // they are planned from layer 0. Where they differ (a dense layer among MoE layers), on which.
  const int64_t first = mixed_layers_ ? range.first_layer : 0;
  const auto key = std::make_tuple(plan.micro_batch, plan.seq_len, plan.param_dtype, plan.tp,
                                   plan.uses_sequence_parallel(), plan.ep, plan.moe_capacity_factor,
                                   recompute, range.layers(), range.first, range.last, first,
                                   plan.fp8, fp8_options(plan).cache_weights);
  const std::lock_guard lock(cache_mutex_);
  auto it = activation_tables_.find(key);
  if (it == activation_tables_.end()) {
    const StageRange planned{first, first + range.layers(), range.first, range.last};
    it = activation_tables_
             .emplace(key, std::make_unique<ActivationTable>(
                               make_activation_table(architecture(plan), plan, planned,
                                                     recompute)))
             .first;
  }
  return *it->second;
}

std::vector<int64_t> MemoryModel::split(const Plan& plan) const {
  if (!plan.pp_split.empty()) return pipeline_split(config_, plan);  // checks it
  const std::lock_guard lock(cache_mutex_);
  auto it = splits_.find({plan.pp, plan.seq_len});
  if (it == splits_.end()) {
    it = splits_.emplace(std::make_pair(plan.pp, plan.seq_len), pipeline_split(config_, plan)).first;
  }
  return it->second;
}

StageRange MemoryModel::stage_range(const Plan& plan, int stage) const {
  return stage_of_split(split(plan), stage);
}

ActivationSizes MemoryModel::activation_sizes(const Plan& plan, int stage) const {
  check_plan(config_, plan);
  const StageRange range = stage_range(plan, stage);
  const ActivationTable& table = activation_table(plan, range, plan.recompute);
  ActivationSizes a;
  a.per_micro_batch = table.slot;
  a.in_flight = activation_slots(plan.pp_schedule, plan.pp, stage, static_cast<int>(plan.grad_accum));
  a.recompute_buffer = table.recomputed;
  a.workspace = table.workspace;
  a.without_recompute =
      activation_table(plan, range, Recompute::None).slot * static_cast<uint64_t>(a.in_flight);
  return a;
}

ActivationSizes activation_sizes(const ModelConfig& config, const Plan& plan, int stage) {
  return MemoryModel(config).activation_sizes(plan, stage);
}

// ---- Predictions --------------------------------------------------------------------------

uint64_t MemoryPrediction::device_total() const {
  uint64_t total = 0;
  for (uint64_t b : device) total += b;
  return total;
}

uint64_t MemoryPrediction::host_total() const {
  uint64_t total = 0;
  for (uint64_t b : host) total += b;
  return total;
}

MemoryModel::MemoryModel(const ModelConfig& config)
    : config_(config), layout_(config), mixed_layers_(decoder_parts(config).mixed_layers()) {}
MemoryModel::~MemoryModel() = default;

const Architecture& MemoryModel::architecture(const Plan& plan) const {
  const auto key =
      std::make_tuple(plan.tp, plan.uses_sequence_parallel(), plan.ep, plan.moe_capacity_factor,
                      plan.fp8, fp8_options(plan).cache_weights);
  const std::lock_guard lock(cache_mutex_);
  auto it = architectures_.find(key);
  if (it == architectures_.end()) {
    const TensorParallel tp{plan.tp, 0, plan.uses_sequence_parallel(), nullptr};
    ExpertParallel ep{plan.ep, 0};
    ep.capacity_factor = plan.moe_capacity_factor;
    it = architectures_.emplace(key, make_architecture(config_, tp, ep, fp8_options(plan))).first;
  }
  return *it->second;
}

std::vector<int64_t> MemoryModel::stage_block_numels(const Plan& plan, int stage) const {
  std::vector<int64_t> numels;
  for (int block : pipeline_stage_blocks(layout_, stage_range(plan, stage))) {
    numels.push_back(architecture(plan).layout().block_numel(block));
  }
  return numels;
}

std::vector<int> MemoryModel::stage_block_worlds(const Plan& plan, int stage) const {
  std::vector<int> worlds;
  for (int block : pipeline_stage_blocks(layout_, stage_range(plan, stage))) {
    worlds.push_back(layout_.expert_layer(block) >= 0 ? plan.dp / plan.ep : plan.dp);
  }
  return worlds;
}

namespace {

std::string shard_text(int zero_needed, const Plan& plan) {
  if (plan.zero < zero_needed || plan.dp == 1) return "";
  return ", 1/" + std::to_string(plan.dp) + " shard";
}

void add(MemoryPrediction& m, MemCategory category, bool host, std::string what, uint64_t bytes) {
  if (bytes == 0) return;
  (host ? m.host : m.device)[static_cast<size_t>(category)] += bytes;
  for (MemoryItem& item : m.items) {
    if (item.category == category && item.host == host && item.what == what) {
      item.bytes += bytes;
      return;
    }
  }
  m.items.push_back({category, host, std::move(what), bytes});
}

void add(MemoryPrediction& m, const BufferSize& buffer, const std::string& what) {
  add(m, buffer.category, buffer.host, what, buffer.bytes());
}

}  // namespace

MemoryPrediction MemoryModel::predict_stage(const Plan& plan, int stage) const {
  check_plan(config_, plan);
  const ShardingSpec spec{plan.zero, plan.dp, plan.offload, plan.param_dtype, plan.offload_params,
                          plan.moment_dtype()};
  const std::string p = precision_name(plan.param_dtype);
  MemoryPrediction m;
  m.stage = stage;

  const std::vector<int> blocks = pipeline_stage_blocks(layout_, stage_range(plan, stage));
  const std::vector<int64_t> numels = stage_block_numels(plan, stage);
  const std::vector<int> worlds = stage_block_worlds(plan, stage);
  const std::string host = plan.offload ? ", host" : "";
  const std::string params_host = plan.offload_params ? ", host" : "";
  const std::string params_what = "parameters (" + p + params_host + shard_text(3, plan) + ")";
  const std::string grads_what = "gradients (" + p + params_host + shard_text(2, plan) + ")";
  const std::string master_what = "fp32 master weights" + host + shard_text(1, plan);
  const std::string adam_what = std::string("Adam moments, ") +
                                (plan.bf16_optimizer_states ? "bf16" : "fp32") + host +
                                shard_text(1, plan);
  int embedding_position = -1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] == ParamLayout::embedding_block()) embedding_position = static_cast<int>(i);
    ShardingSpec block_spec = spec;
    block_spec.world = worlds[i];
    const BlockStateSizes s = block_state_sizes(numels[i], block_spec);
    add(m, s.params, params_what);
    add(m, s.grads, grads_what);
    add(m, s.master, master_what);
    add(m, s.exp_avg, adam_what);
    add(m, s.exp_avg_sq, adam_what);
  }
  const RankStateBuffers r = rank_state_buffers(numels, worlds, embedding_position, spec);
  const std::string gathered_what = plan.offload_params
                                        ? "blocks brought from the host (current + prefetched)"
                                        : "gathered-block buffers (current + prefetched)";
  add(m, r.gathered_params[0], gathered_what);
  add(m, r.gathered_params[1], gathered_what);
  const std::string block_grads_what = plan.zero >= 2
                                           ? "full-block gradient buffers before reduce-scatter"
                                           : "full-block gradient buffers on the way to the host";
  add(m, r.embedding_grads, block_grads_what);
  for (const BufferSize& b : r.block_grads) add(m, b, block_grads_what);
  add(m, r.reduced_shard, "reduce-scatter output shard");
  add(m, r.shard_sum, "gradient shard summed on the way to the host");
  for (int i = 0; i < 2; ++i) {
    add(m, r.host_grad_staging[i], "offload staging, gradients down and weights up (host)");
    add(m, r.host_param_staging[i], "offload staging, gradients down and weights up (host)");
  }

  const ActivationSizes a = activation_sizes(plan, stage);
  std::ostringstream what;
  what << "activations (" << a.in_flight << " micro-batch" << (a.in_flight == 1 ? "" : "es")
       << " of " << plan.micro_batch << " x " << plan.seq_len
       << (a.in_flight > 1 ? " in flight" : "") << ")";
  add(m, MemCategory::Activations, false, what.str(), a.per_micro_batch * a.in_flight);
  add(m, MemCategory::Activations, false, "recompute buffers (one layer's, shared)",
      a.recompute_buffer);
  add(m, MemCategory::Workspace, false,
      fp8_options(plan).cache_weights
          ? "workspace (logits, activation gradients, the layers' FP8 weights)"
          : "workspace (logits, activation gradients)",
      a.workspace);
  m.activations_without_recompute = a.without_recompute;

  const StageRange s = stage_range(plan, stage);
  if (stage_reads_tokens(plan, s)) {
    add(m, MemCategory::Data, false, "token batches (one per micro-batch in flight)",
        token_batch_bytes(plan.micro_batch, plan.seq_len) * static_cast<uint64_t>(a.in_flight));
  }
  return m;
}

MemoryPrediction MemoryModel::predict(const Plan& plan) const {
  MemoryPrediction worst;
  for (int stage = 0; stage < plan.pp; ++stage) {
    MemoryPrediction m = predict_stage(plan, stage);
    if (stage == 0 || m.device_total() > worst.device_total()) worst = std::move(m);
  }
  return worst;
}

namespace {

// `bytes` of one rank summed over every rank of the plan (the dp x tp ranks of each stage are
// alike).
template <class Bytes>
uint64_t over_all_ranks(const MemoryModel& model, const Plan& plan, Bytes&& bytes) {
  uint64_t total = 0;
  for (int stage = 0; stage < plan.pp; ++stage) {
    total += bytes(model.predict_stage(plan, stage)) * static_cast<uint64_t>(plan.dp * plan.tp);
  }
  return total;
}

}  // namespace

uint64_t MemoryModel::host_bytes_all_ranks(const Plan& plan) const {
  return over_all_ranks(*this, plan, [](const MemoryPrediction& rank) { return rank.host_total(); });
}

uint64_t MemoryModel::cpu_bytes_all_ranks(const Plan& plan) const {
  return over_all_ranks(*this, plan, [](const MemoryPrediction& rank) {
    return rank.device_total() + rank.host_total();
  });
}

MemoryPrediction predict_memory(const ModelConfig& config, const Plan& plan) {
  return MemoryModel(config).predict(plan);
}

}  // namespace dstrain
