#include "parallel/memory_model.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string_view>
#include <tuple>

#include "core/arena.h"
#include "core/check.h"
#include "model/gpt2.h"
#include "parallel/sharded_model.h"  // shard_numel: the sharded model's own cut

namespace dstrain {

uint64_t BufferSize::bytes() const {
  return static_cast<uint64_t>(numel) * dtype_size(dtype);
}

// ---- Model state --------------------------------------------------------------------------

BlockStateSizes block_state_sizes(int64_t block_numel, const ShardingSpec& spec) {
  DSTRAIN_CHECK(spec.zero >= 0 && spec.zero <= 3) << "ZeRO stage " << spec.zero;
  DSTRAIN_CHECK(spec.world >= 1 && block_numel >= 0) << spec.world << " " << block_numel;
  const DType p = spec.param_dtype;
  BlockStateSizes s;
  s.numel = block_numel;
  s.shard = shard_numel(block_numel, spec.world);
  s.padded = s.shard * spec.world;
  s.optimizer_numel = spec.zero >= 1 ? s.shard : s.padded;
  s.params = {MemCategory::Parameters, p, spec.zero >= 3 ? s.shard : s.padded, false};
  s.grads = {MemCategory::Gradients, p, spec.zero >= 2 ? s.shard : s.padded, false};
  if (spec.offload) {
    // The host steps the fp32 master: with fp32 parameters too, so the device's copy is only
    // ever written (by the upload), never read back.
    s.master = {MemCategory::OptimizerStateHost, DType::F32, s.optimizer_numel, true};
    s.exp_avg = {MemCategory::OptimizerStateHost, DType::F32, s.optimizer_numel, true};
  } else {
    if (p != DType::F32) s.master = {MemCategory::MasterWeights, DType::F32, s.optimizer_numel, false};
    s.exp_avg = {MemCategory::OptimizerState, DType::F32, s.optimizer_numel, false};
  }
  s.exp_avg_sq = s.exp_avg;
  return s;
}

RankStateBuffers rank_state_buffers(const std::vector<int64_t>& block_numels,
                                    int embedding_position, const ShardingSpec& spec) {
  const DType p = spec.param_dtype;
  int64_t max_padded = 0, max_other_padded = 0, max_shard = 0, max_optimizer = 0;
  int64_t embedding_padded = 0;
  for (size_t i = 0; i < block_numels.size(); ++i) {
    const BlockStateSizes s = block_state_sizes(block_numels[i], spec);
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
  if (spec.zero >= 3) {
    for (BufferSize& b : r.gathered_params) b = {MemCategory::GatheredParams, p, max_padded, false};
  }
  if (spec.zero >= 2) {
    r.embedding_grads = {MemCategory::CommBuffers, p, embedding_padded, false};
    for (BufferSize& b : r.block_grads) b = {MemCategory::CommBuffers, p, max_other_padded, false};
  }
  if (spec.zero >= 1) r.reduced_shard = {MemCategory::CommBuffers, p, max_shard, false};
  if (spec.offload) {
    for (BufferSize& b : r.host_grad_staging) b = {MemCategory::CommBuffers, p, max_optimizer, true};
    r.host_param_staging = r.host_grad_staging;
  }
  return r;
}

namespace {
constexpr int64_t kParamAlignment = 32;  // as ParamLayout: each tensor on 32 elements
int64_t aligned(int64_t n) { return (n + kParamAlignment - 1) / kParamAlignment * kParamAlignment; }
}  // namespace

int64_t tp_block_numel(const ParamLayout& layout, int block, int tp) {
  DSTRAIN_CHECK(tp >= 1) << tp;
  if (tp == 1) return layout.block_numel(block);
  const bool layer = block != ParamLayout::embedding_block() && block != layout.final_block();
  if (!layer) return layout.block_numel(block);
  int64_t total = 0;
  const std::vector<int>& params = layout.block_params(block);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& spec = layout.params()[static_cast<size_t>(params[i])];
    int64_t numel = spec.numel();
    switch (static_cast<LayerParam>(i)) {
      case kQkvWeight: case kQkvBias: case kFcWeight: case kFcBias:       // column split
      case kAttnProjWeight: case kFcProjWeight:                           // row split
        DSTRAIN_CHECK(numel % tp == 0) << spec.name << " (" << numel << ") over tp " << tp;
        numel /= tp;
        break;
      default:  // layernorms and the row-split layers' biases: whole on every rank
        break;
    }
    total += aligned(numel);
  }
  return total;
}

PipelineStage pipeline_stage(int64_t n_layer, int pp, int stage) {
  DSTRAIN_CHECK(pp >= 1 && pp <= n_layer && stage >= 0 && stage < pp)
      << "stage " << stage << " of " << pp << " over " << n_layer << " layers";
  const int64_t base = n_layer / pp, extra = n_layer % pp;
  PipelineStage s;
  s.first_layer = stage * base + std::min<int64_t>(stage, extra);
  s.end_layer = s.first_layer + base + (stage < extra ? 1 : 0);
  s.first = stage == 0;
  s.last = stage == pp - 1;
  return s;
}

std::vector<int> pipeline_stage_blocks(const ParamLayout& layout, int pp, int stage) {
  const int64_t n_layer = layout.num_blocks() - 2;
  const PipelineStage s = pipeline_stage(n_layer, pp, stage);
  std::vector<int> blocks;
  if (s.first || s.last) blocks.push_back(ParamLayout::embedding_block());
  for (int64_t l = s.first_layer; l < s.end_layer; ++l) {
    blocks.push_back(ParamLayout::layer_block(static_cast<int>(l)));
  }
  if (s.last) blocks.push_back(layout.final_block());
  return blocks;
}

uint64_t token_batch_bytes(int64_t micro_batch, int64_t seq_len) {
  return 2 * static_cast<uint64_t>(micro_batch * seq_len) * sizeof(int32_t);
}

// ---- Activations ----------------------------------------------------------------------------
//
// The tensors come from plan_gpt2_buffers(config, B, T, dtype, true, recompute), the function
// Gpt2 allocates with, planned for a 1-layer model. Its activations are of three kinds:
// per-layer tensors it keeps ("h.<l>.ln1", the same shapes for every layer), tensors that
// backward recomputes into buffers all layers share ("recompute.ln1", once), and the rest
// ("encoded", "lnf", ...). So one layer's list gives any number of layers exactly (ArenaPlan
// sizes add tensor by tensor). What this file adds is the selection for the parts that do
// not run yet: which non-layer tensors a pipeline stage holds, and which tensors tensor
// parallelism splits (planned again with n_embd / tp and n_head / tp). Once pipeline stages
// and tensor parallelism are written in the model, plan_gpt2_buffers can take the layer range
// and tp and this selection goes away.

namespace memory_detail {

enum class EntryKind : uint8_t { Layer, Recomputed, Other };

struct ArenaEntry {  // one tensor of an ArenaPlan
  std::string name;  // without the "h.0." / "recompute." prefix
  uint64_t bytes = 0;
  EntryKind kind = EntryKind::Other;
};

namespace {

// Each tensor's share of the arena (its aligned size), read from the plan's own offsets.
std::vector<ArenaEntry> arena_entries(const ArenaPlan& plan) {
  alignas(256) static char base[1];
  std::vector<uint64_t> offsets;
  for (int id = 0; id < plan.size(); ++id) {
    const Tensor view = plan.view(id, base, Device{});
    offsets.push_back(static_cast<uint64_t>(static_cast<const char*>(view.data) - base));
  }
  offsets.push_back(plan.bytes());
  std::vector<ArenaEntry> entries;
  for (int id = 0; id < plan.size(); ++id) {
    ArenaEntry e;
    e.name = plan.name(id);
    e.bytes = offsets[static_cast<size_t>(id) + 1] - offsets[static_cast<size_t>(id)];
    for (const auto& [prefix, kind] : {std::pair{"h.0.", EntryKind::Layer},
                                       std::pair{"recompute.", EntryKind::Recomputed}}) {
      const std::string_view p = prefix;
      if (e.name.starts_with(p)) {
        e.kind = kind;
        e.name = e.name.substr(p.size());
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

bool is_one_of(const std::string& name, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (name == n) return true;
  }
  return false;
}

// Split across tensor-parallel ranks (Megatron-LM without sequence parallelism): the
// attention heads and the MLP's hidden units; the residual stream stays whole.
bool tp_split(const std::string& name) {
  return is_one_of(name, {"qkv", "atty", "att_lse", "fch", "fch_gelu", "dqkv", "dfch",
                          "dfch_gelu"});
}
// Non-layer tensors of the last stage only (the rest: every stage; "encoded" is the first
// stage's embedding output and the received input of the others).
bool last_stage_only(const std::string& name) {
  return is_one_of(name, {"lnf", "lnf_mean", "lnf_rstd", "losses", "logits", "dlogits"});
}

}  // namespace

struct ActivationTable {
  std::vector<ArenaEntry> activations;  // one layer + the shared recompute buffers + the rest
  std::vector<ArenaEntry> workspace;
  uint64_t stage_input = 0;             // "encoded": (B, T, C)
};

namespace {

ActivationTable make_activation_table(const ModelConfig& config, const Plan& plan) {
  ModelConfig one_layer = config;
  one_layer.n_layer = 1;
  const Gpt2Buffers whole = plan_gpt2_buffers(one_layer, plan.micro_batch, plan.seq_len,
                                              plan.param_dtype, true, plan.recompute);
  ActivationTable table;
  table.activations = arena_entries(whole.activations);
  table.workspace = arena_entries(whole.workspace);
  if (plan.tp > 1) {
    DSTRAIN_CHECK(config.n_head % plan.tp == 0) << config.n_head << " heads over tp " << plan.tp;
    ModelConfig split = one_layer;
    split.n_embd = config.n_embd / plan.tp;
    split.n_head = config.n_head / plan.tp;
    const Gpt2Buffers part = plan_gpt2_buffers(split, plan.micro_batch, plan.seq_len,
                                               plan.param_dtype, true, plan.recompute);
    auto take_split = [](std::vector<ArenaEntry>& entries, const std::vector<ArenaEntry>& from) {
      for (ArenaEntry& e : entries) {
        if (!tp_split(e.name)) continue;
        for (const ArenaEntry& f : from) {
          if (f.name == e.name && f.kind == e.kind) e.bytes = f.bytes;
        }
      }
    };
    take_split(table.activations, arena_entries(part.activations));
    take_split(table.workspace, arena_entries(part.workspace));
  }
  for (const ArenaEntry& e : table.activations) {
    if (e.kind == EntryKind::Other && e.name == "encoded") table.stage_input = e.bytes;
  }
  DSTRAIN_CHECK(table.stage_input > 0) << "plan_gpt2_buffers has no 'encoded' tensor";
  return table;
}

// Activations of one stage from the tables of the plan's recompute mode and of none.
ActivationSizes sizes_from_tables(const ActivationTable& table, const ActivationTable& none,
                                  const ModelConfig& config, const Plan& plan, int stage) {
  const PipelineStage s = pipeline_stage(config.n_layer, plan.pp, stage);
  const uint64_t layers = static_cast<uint64_t>(s.end_layer - s.first_layer);
  // (per micro-batch, shared recompute buffers) of a table for this stage.
  auto sum = [&](const ActivationTable& t) {
    uint64_t per_micro_batch = 0, recomputed = 0;
    for (const ArenaEntry& e : t.activations) {
      switch (e.kind) {
        case EntryKind::Layer: per_micro_batch += layers * e.bytes; break;
        case EntryKind::Recomputed: recomputed += e.bytes; break;
        case EntryKind::Other:
          if (!last_stage_only(e.name) || s.last) per_micro_batch += e.bytes;
          break;
      }
    }
    return std::make_pair(per_micro_batch, recomputed);
  };
  ActivationSizes a;
  std::tie(a.per_micro_batch, a.recompute_buffer) = sum(table);
  a.in_flight = std::min<int64_t>(plan.pp - stage, plan.grad_accum);
  a.without_recompute = sum(none).first * static_cast<uint64_t>(a.in_flight);
  for (const ArenaEntry& e : table.workspace) {
    if (!last_stage_only(e.name) || s.last) a.workspace += e.bytes;
  }
  if (!s.first) a.pipeline_buffers += table.stage_input;  // receives activations
  if (!s.last) a.pipeline_buffers += table.stage_input;   // receives gradients
  return a;
}

void check_plan(const ModelConfig& config, const Plan& plan) {
  DSTRAIN_CHECK(plan.dp >= 1 && plan.tp >= 1 && plan.pp >= 1 && plan.pp <= config.n_layer &&
                config.n_head % plan.tp == 0 && plan.zero >= 0 && plan.zero <= 3 &&
                plan.micro_batch >= 1 && plan.grad_accum >= 1 && plan.seq_len >= 1)
      << describe(plan);
}

}  // namespace
}  // namespace memory_detail

using namespace memory_detail;

ActivationSizes activation_sizes(const ModelConfig& config, const Plan& plan, int stage) {
  check_plan(config, plan);
  Plan plain = plan;
  plain.recompute = Recompute::None;
  return sizes_from_tables(make_activation_table(config, plan),
                           make_activation_table(config, plain), config, plan, stage);
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

MemoryModel::MemoryModel(const ModelConfig& config) : config_(config), layout_(config) {}
MemoryModel::~MemoryModel() = default;

const ActivationTable& MemoryModel::activation_table(const Plan& plan) const {
  const auto key = std::make_tuple(plan.micro_batch, plan.seq_len, plan.param_dtype, plan.tp,
                                   plan.recompute);
  auto it = activation_tables_.find(key);
  if (it == activation_tables_.end()) {
    it = activation_tables_
             .emplace(key, std::make_unique<ActivationTable>(make_activation_table(config_, plan)))
             .first;
  }
  return *it->second;
}

int64_t MemoryModel::tp_numel(int block, int tp) const {
  auto it = tp_numels_.find(tp);
  if (it == tp_numels_.end()) {
    std::vector<int64_t> numels;
    for (int b = 0; b < layout_.num_blocks(); ++b) numels.push_back(tp_block_numel(layout_, b, tp));
    it = tp_numels_.emplace(tp, std::move(numels)).first;
  }
  return it->second.at(static_cast<size_t>(block));
}

std::vector<int64_t> MemoryModel::stage_block_numels(const Plan& plan, int stage) const {
  std::vector<int64_t> numels;
  for (int block : pipeline_stage_blocks(layout_, plan.pp, stage)) {
    numels.push_back(tp_numel(block, plan.tp));
  }
  return numels;
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
  const ShardingSpec spec{plan.zero, plan.dp, plan.offload, plan.param_dtype};
  const std::string p = precision_name(plan.param_dtype);
  MemoryPrediction m;
  m.stage = stage;

  const std::vector<int> blocks = pipeline_stage_blocks(layout_, plan.pp, stage);
  const std::vector<int64_t> numels = stage_block_numels(plan, stage);
  const std::string host = plan.offload ? ", host" : "";
  const std::string params_what = "parameters (" + p + shard_text(3, plan) + ")";
  const std::string grads_what = "gradients (" + p + shard_text(2, plan) + ")";
  const std::string master_what = "fp32 master weights" + host + shard_text(1, plan);
  const std::string adam_what = "Adam moments, fp32" + host + shard_text(1, plan);
  int embedding_position = -1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] == ParamLayout::embedding_block()) embedding_position = static_cast<int>(i);
    const BlockStateSizes s = block_state_sizes(numels[i], spec);
    add(m, s.params, params_what);
    add(m, s.grads, grads_what);
    add(m, s.master, master_what);
    add(m, s.exp_avg, adam_what);
    add(m, s.exp_avg_sq, adam_what);
  }
  const RankStateBuffers r = rank_state_buffers(numels, embedding_position, spec);
  add(m, r.gathered_params[0], "gathered-block buffers (current + prefetched)");
  add(m, r.gathered_params[1], "gathered-block buffers (current + prefetched)");
  add(m, r.embedding_grads, "full-block gradient buffers before reduce-scatter");
  for (const BufferSize& b : r.block_grads)
    add(m, b, "full-block gradient buffers before reduce-scatter");
  add(m, r.reduced_shard, "reduce-scatter output shard");
  for (int i = 0; i < 2; ++i) {
    add(m, r.host_grad_staging[i], "offload staging, gradients down and weights up (host)");
    add(m, r.host_param_staging[i], "offload staging, gradients down and weights up (host)");
  }

  Plan plain = plan;
  plain.recompute = Recompute::None;
  const ActivationSizes a =
      sizes_from_tables(activation_table(plan), activation_table(plain), config_, plan, stage);
  std::ostringstream what;
  what << "activations (" << a.in_flight << " micro-batch" << (a.in_flight == 1 ? "" : "es")
       << " of " << plan.micro_batch << " x " << plan.seq_len
       << (a.in_flight > 1 ? " in flight" : "") << ")";
  add(m, MemCategory::Activations, false, what.str(), a.per_micro_batch * a.in_flight);
  add(m, MemCategory::Activations, false, "recompute buffers (one layer's, shared)",
      a.recompute_buffer);
  add(m, MemCategory::Workspace, false, "workspace (logits, activation gradients)", a.workspace);
  add(m, MemCategory::CommBuffers, false, "pipeline receive buffers", a.pipeline_buffers);
  m.activations_without_recompute = a.without_recompute;

  const PipelineStage s = pipeline_stage(config_.n_layer, plan.pp, stage);
  if (s.first || s.last) {
    add(m, MemCategory::Data, false, "token batch", token_batch_bytes(plan.micro_batch, plan.seq_len));
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

uint64_t MemoryModel::host_bytes_all_ranks(const Plan& plan) const {
  uint64_t total = 0;
  for (int stage = 0; stage < plan.pp; ++stage) {
    total += predict_stage(plan, stage).host_total() * static_cast<uint64_t>(plan.dp * plan.tp);
  }
  return total;
}

MemoryPrediction predict_memory(const ModelConfig& config, const Plan& plan) {
  return MemoryModel(config).predict(plan);
}

}  // namespace dstrain
