#include "model/layout.h"

#include <cstring>
#include <utility>
#include <sstream>

namespace dstrain {

// Each tensor starts on a multiple of 32 elements (128 bytes in fp32): aligned vector loads
// and GEMM operands, on the CPU and on GPUs. The gaps are zero and stay zero.
constexpr int64_t kParamAlignment = 32;

static int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ParamSpec::numel() const { return product(shape); }
int64_t ParamSpec::full_numel() const { return product(full_shape); }
int64_t ParamSpec::file_numel() const { return product(file_shape); }

int64_t ParamSpec::slice_file_numel(int tp_rank) const {
  if (file_shape == full_shape) return numel();
  // Files drop trailing rows (wte's padded vocabulary): only a replicated tensor or one split
  // by rows has its file rows as a prefix of each slice.
  DSTRAIN_CHECK(tp_dim <= 0 && tp_parts == 1) << name << ": file rows of a column split";
  const int64_t row = numel() / shape[0];
  const int64_t first_row = tp_dim == 0 ? tp_rank * shape[0] : 0;
  return std::clamp(file_shape[0] - first_row, int64_t{0}, shape[0]) * row;
}

std::string tp_unsupported_reason(const ModelConfig& config, int tp) {
  std::ostringstream reason;
  const std::string over = "tensor parallelism over " + std::to_string(tp) + " ranks needs ";
  auto divisible = [&](const std::string& what, int64_t n) {
    if (n % tp == 0) return true;
    reason << over << what << " (" << n << ") divisible by " << tp;
    return false;
  };
  const DecoderParts parts = decoder_parts(config);
  // The experts stay whole on every tp rank (Megatron's expert tensor parallelism 1): only a
  // dense MLP splits.
  const MlpPart& split_mlp = parts.mlp.kind == MlpKind::MoE ? parts.dense_mlp : parts.mlp;
  const bool splits_mlp = parts.mlp.kind != MlpKind::MoE || parts.mixed_layers();
  if (tp < 1) {
    reason << "tensor parallelism needs at least 1 rank, not " << tp;
  } else if (divisible("n_head", parts.attention.heads) &&
             divisible("num_key_value_heads", parts.attention.kv_heads) &&
             (!splits_mlp || divisible(split_mlp.width_name, split_mlp.width)) &&
             divisible("n_embd", config.n_embd)) {
    // Megatron pads the vocabulary to a multiple of 128 * tp; dstrain pads to 64 only, so some
    // vocabularies cannot be split evenly.
    if (!divisible("the padded vocabulary", config.padded_vocab())) {
      reason << " (vocab_size " << config.vocab_size << " padded to a multiple of 64)";
    }
  }
  return reason.str();
}

namespace {

// How a tensor splits over tp ranks: {tp_dim, tp_parts}; {-1, 1} replicated.
struct TensorSplit {
  int dim = -1, parts = 1;
};
struct TensorOptions {
  bool partial_grad = false;  // a norm inside the sequence-parallel region
  bool summed_grad = false;   // replicated, its gradient a per-rank part under any tp
  bool packed = false;        // right after the previous tensor, no alignment gap
  std::vector<int64_t> file_shape = {};
  // A routed expert's tensor (ParamSpec::expert); held: by this ep rank (else no rows here).
  bool expert = false, held = true;
};

}  // namespace

// Builds a layout tensor by tensor: blocks in order, each tensor aligned (or packed right
// after the previous one, so that two tensors form one matrix).
class ParamLayout::Builder {
 public:
  Builder(ParamLayout& layout, int tp, int64_t width) : layout_(layout), tp_(tp), width_(width) {}
  ~Builder() { layout_.block_numel_.push_back(aligned(cursor_)); }

  void begin_block() {
    if (block_ >= 0) layout_.block_numel_.push_back(aligned(cursor_));
    ++block_;
    cursor_ = 0;
    layout_.block_params_.emplace_back();
  }
  using Split = TensorSplit;
  using Options = TensorOptions;
  int64_t width() const { return width_; }  // C
  void add(std::string name, std::vector<int64_t> full_shape, bool decay, Split split,
           Options options = {}, ParamInit init = ParamInit::Normal) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.block = block_;
    spec.full_shape = full_shape;
    spec.shape = full_shape;
    if (split.dim >= 0) spec.shape[static_cast<size_t>(split.dim)] /= tp_;
    spec.expert = options.expert;
    if (!options.held) spec.shape[0] = 0;
    spec.file_shape = options.file_shape.empty() ? full_shape : options.file_shape;
    spec.weight_decay = decay;
    spec.tp_dim = split.dim;
    spec.tp_parts = split.parts;
    spec.tp_partial_grad = options.partial_grad;
    spec.tp_summed_grad = options.summed_grad;
    spec.init = init;
    if (!options.packed) cursor_ = aligned(cursor_);
    spec.offset = cursor_;
    cursor_ += spec.numel();
    layout_.index_[spec.name] = static_cast<int>(layout_.params_.size());
    layout_.block_params_.back().push_back(static_cast<int>(layout_.params_.size()));
    layout_.params_.push_back(std::move(spec));
  }

 private:
  static int64_t aligned(int64_t n) {
    return (n + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
  }

  ParamLayout& layout_;
  int tp_;
  int64_t width_;
  int block_ = -1;
  int64_t cursor_ = 0;
};

namespace {

using Builder = ParamLayout::Builder;
const Builder::Split kReplicated, kRows{0, 1};

// A norm's weight (1) and, for LayerNorm, its bias (0): replicated, inside the
// sequence-parallel region.
void add_norm(Builder& b, const NormPart& norm, const std::string& name) {
  const Builder::Options options{.partial_grad = true};
  b.add(name + ".weight", {b.width()}, false, kReplicated, options, ParamInit::One);
  if (norm.has_bias()) {
    b.add(name + ".bias", {b.width()}, false, kReplicated, options, ParamInit::Zero);
  }
}

// A linear layer of `in` inputs whose outputs are the groups `outs` (q, k, v), stored as the
// tensors `names` (one per group, packed into one matrix, or one holding them all), weights then
// biases. Column-parallel (Megatron's ColumnParallelLinear): every group's outputs split over
// the tp ranks. Row-parallel: the inputs split, the bias replicated (added once, after the sum).
struct Linear {
  std::vector<std::string> names;
  std::vector<int64_t> outs;
  int64_t in = 0;
  bool column_parallel = true;
  bool bias = false;
  ParamInit init = ParamInit::Normal;
};

void add_linear(Builder& b, const TensorNames& format, const std::string& prefix,
                const Linear& linear) {
  const size_t tensors = linear.names.size();
  DSTRAIN_CHECK(tensors == 1 || tensors == linear.outs.size()) << linear.names.front();
  std::vector<int64_t> outs = linear.outs;
  int64_t out_dim_groups = 1;
  if (tensors == 1 && outs.size() > 1) {
    // One tensor of equal groups: tp splits each group (GPT-2's c_attn: q, k, v).
    for (int64_t out : outs) DSTRAIN_CHECK(out == outs[0]) << linear.names[0] << ": unequal groups";
    out_dim_groups = static_cast<int64_t>(outs.size());
    outs = {outs[0] * out_dim_groups};
  }
  const int out_dim = format.in_by_out ? 1 : 0, in_dim = 1 - out_dim;
  const Builder::Split split = linear.column_parallel
                                   ? Builder::Split{out_dim, static_cast<int>(out_dim_groups)}
                                   : Builder::Split{in_dim, 1};
  for (size_t i = 0; i < tensors; ++i) {
    std::vector<int64_t> shape = {outs[i], linear.in};
    if (format.in_by_out) std::swap(shape[0], shape[1]);
    b.add(prefix + linear.names[i] + ".weight", shape, true, split, {.packed = i > 0}, linear.init);
  }
  if (!linear.bias) return;
  const Builder::Split bias_split =
      linear.column_parallel ? Builder::Split{0, static_cast<int>(out_dim_groups)} : kReplicated;
  for (size_t i = 0; i < tensors; ++i) {
    b.add(prefix + linear.names[i] + ".bias", {outs[i]}, false, bias_split, {.packed = i > 0},
          ParamInit::Zero);
  }
}

// The routed experts of a MoE layer (their own block): every expert's [gate | up] (E, 2I, C)
// and every expert's down (E, C, I), each packed into one tensor of the grouped matmul (experts
// whole: no tensor parallelism); ep rank r holds experts [r E / ep, (r + 1) E / ep).
void add_routed_experts(Builder& b, const TensorNames& names, const MlpPart& mlp,
                        const std::string& p, int ep, int ep_rank) {
  const int64_t C = b.width(), local = mlp.experts / ep;
  auto held = [&](int64_t e) { return e / local == ep_rank; };
  bool packed = false;
  for (int64_t e = 0; e < mlp.experts; ++e) {
    for (const std::string& up : names.expert_up) {
      b.add(p + names.experts + std::to_string(e) + "." + up + ".weight", {mlp.width, C}, true,
            kReplicated, {.packed = packed, .expert = true, .held = held(e)});
      packed = true;
    }
  }
  for (int64_t e = 0; e < mlp.experts; ++e) {
    b.add(p + names.experts + std::to_string(e) + "." + names.expert_down + ".weight",
          {C, mlp.width}, true, kReplicated, {.packed = e > 0, .expert = true, .held = held(e)});
  }
}

// What a MoE layer's block holds of its MLP: the router (E, C) and its selection bias (E: never
// given a gradient, so AdamW leaves it as loaded), then the shared expert if any.
void add_experts(Builder& b, const TensorNames& names, const MlpPart& mlp, const std::string& p) {
  const int64_t C = b.width();
  b.add(p + names.router + ".weight", {mlp.experts, C}, true, kReplicated);
  if (mlp.selection_bias) {
    b.add(p + names.router_bias, {mlp.experts}, false, kReplicated, {}, ParamInit::Zero);
  }
  if (mlp.shared_width == 0) return;
  // The shared expert: [gate | up] (2 Is, C), down (C, Is), and its gate (1, C).
  const std::string shared = p + names.shared_expert;
  for (size_t i = 0; i < names.expert_up.size(); ++i) {
    b.add(shared + names.expert_up[i] + ".weight", {mlp.shared_width, C}, true, kReplicated,
          {.packed = i > 0});
  }
  b.add(shared + names.expert_down + ".weight", {C, mlp.shared_width}, true, kReplicated);
  if (mlp.shared_gate) b.add(p + names.shared_gate + ".weight", {1, C}, true, kReplicated);
}

// Latent attention's tensors before o: q (or q_a, its norm, q_b), kv_a (latent | rope key), the
// latent's norm, kv_b (nn.Linear layouts, no biases). The per-head projections (q or q_b, kv_b)
// are column-parallel; the latent path is replicated.
void add_latent_attention(Builder& b, const TensorNames& names, const AttentionPart& attn,
                          const std::string& p) {
  const int64_t C = b.width();
  const Builder::Options latent{.summed_grad = true};
  if (attn.q_rank == 0) {
    b.add(p + names.q + ".weight", {attn.q_width(), C}, true, kRows);
  } else {
    b.add(p + names.q_a + ".weight", {attn.q_rank, C}, true, kReplicated, latent);
    b.add(p + names.q_norm + ".weight", {attn.q_rank}, false, kReplicated, latent,
          ParamInit::One);
    b.add(p + names.q_b + ".weight", {attn.q_width(), attn.q_rank}, true, kRows);
  }
  b.add(p + names.kv_a + ".weight", {attn.kv_rank + attn.rope_dim, C}, true, kReplicated, latent);
  b.add(p + names.kv_norm + ".weight", {attn.kv_rank}, false, kReplicated, latent,
        ParamInit::One);
  b.add(p + names.kv_b + ".weight", {attn.kv_latent_width(), attn.kv_rank}, true, kRows);
}

// One layer: norm, attention (qkv column-parallel, or latent attention's tensors; o
// row-parallel), norm, MLP (up column-parallel, down row-parallel; or the experts).
void add_layer(Builder& b, const DecoderParts& parts, int64_t layer) {
  const TensorNames& names = parts.names;
  const AttentionPart& attn = parts.attention;
  const MlpPart& mlp = parts.layer_mlp(layer);
  const int64_t C = parts.width;
  const std::string p = names.layer_prefix + std::to_string(layer) + ".";
  const ParamInit residual =
      parts.scaled_residual_init ? ParamInit::ResidualNormal : ParamInit::Normal;
  add_norm(b, parts.norm, p + names.norm1);
  if (attn.latent()) {
    add_latent_attention(b, names, attn, p);
  } else {
    add_linear(b, names, p,
               {names.qkv, {attn.q_width(), attn.kv_width(), attn.kv_width()}, C, true,
                attn.qkv_bias});
  }
  add_linear(b, names, p, {{names.o}, {C}, attn.out_width(), false, attn.o_bias, residual});
  add_norm(b, parts.norm, p + names.norm2);
  if (mlp.kind == MlpKind::MoE) {
    add_experts(b, names, mlp, p);
    return;
  }
  add_linear(b, names, p,
             {names.up, std::vector<int64_t>(static_cast<size_t>(mlp.up_factor()), mlp.width), C,
              true, mlp.bias});
  add_linear(b, names, p, {{names.down}, {C}, mlp.width, false, mlp.bias, residual});
}

// Block 0 the embedding (and a learned position table), a block per layer, the final block the
// final norm (and an untied head), then a block of routed experts per MoE layer.
void add_decoder_tensors(Builder& b, const ModelConfig& config, const DecoderParts& parts, int ep,
                         int ep_rank) {
  const int64_t C = parts.width;
  const Builder::Options vocab{.file_shape = {config.vocab_size, C}};
  b.begin_block();
  b.add(parts.names.embedding, {config.padded_vocab(), C}, true, kRows, vocab);
  if (parts.position.kind == PositionKind::Learned) {
    b.add(parts.names.positions, {parts.position.table_rows, C}, true, kReplicated);
  }
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    b.begin_block();
    add_layer(b, parts, layer);
  }
  b.begin_block();
  add_norm(b, parts.norm, parts.names.final_norm);
  if (!parts.head.tied) b.add(parts.names.head, {config.padded_vocab(), C}, true, kRows, vocab);
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    if (parts.layer_mlp(layer).kind != MlpKind::MoE) continue;
    b.begin_block();
    add_routed_experts(b, parts.names, parts.mlp,
                       parts.names.layer_prefix + std::to_string(layer) + ".", ep, ep_rank);
  }
}

}  // namespace

std::string ep_unsupported_reason(const ModelConfig& config, int ep) {
  if (ep < 1) return "expert parallelism needs at least 1 rank, not " + std::to_string(ep);
  if (ep == 1) return "";
  const std::string over = "expert parallelism over " + std::to_string(ep) + " ranks ";
  if (!config.moe.enabled())
    return over + "needs a mixture-of-experts model; " + config.name + " is dense";
  if (config.moe.experts % ep != 0) {
    return over + "needs the experts (" + std::to_string(config.moe.experts) + ") divisible by " +
           std::to_string(ep);
  }
  return "";
}

ParamLayout::ParamLayout(const ModelConfig& config, int tp, int ep, int ep_rank)
    : tp_(tp), ep_(ep), ep_rank_(ep_rank) {
  const std::string unsupported = tp_unsupported_reason(config, tp);
  DSTRAIN_USER_CHECK(unsupported.empty()) << unsupported;
  const std::string ep_unsupported = ep_unsupported_reason(config, ep);
  DSTRAIN_USER_CHECK(ep_unsupported.empty()) << ep_unsupported;
  DSTRAIN_CHECK(ep_rank >= 0 && ep_rank < ep) << "ep rank " << ep_rank << " of " << ep;
  const DecoderParts parts = decoder_parts(config);
  tied_embedding_ = parts.head.tied;
  layers_ = static_cast<int>(parts.layers);
  skipped_layers_ = config.mtp_layers;
  layer_prefix_ = parts.names.layer_prefix;
  local_experts_ = parts.mlp.kind == MlpKind::MoE ? parts.mlp.experts / ep : 0;
  int next_expert_block = final_block() + 1;
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    expert_blocks_.push_back(parts.layer_mlp(layer).kind == MlpKind::MoE ? next_expert_block++
                                                                         : -1);
  }
  {
    Builder builder(*this, tp, parts.width);
    add_decoder_tensors(builder, config, parts, ep, ep_rank);
  }
  DSTRAIN_CHECK(num_blocks() == next_expert_block) << num_blocks() << " blocks";
}

bool ParamLayout::is_skipped_layer_tensor(const std::string& name) const {
  if (skipped_layers_ == 0 || !name.starts_with(layer_prefix_)) return false;
  const size_t begin = layer_prefix_.size(), dot = name.find('.', begin);
  if (dot == std::string::npos || dot == begin || dot - begin > 6) return false;
  int64_t layer = 0;
  for (size_t i = begin; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    layer = layer * 10 + (name[i] - '0');
  }
  return layer >= layers_ && layer < layers_ + skipped_layers_;
}

int ParamLayout::expert_layer(int block) const {
  for (size_t layer = 0; layer < expert_blocks_.size(); ++layer) {
    if (expert_blocks_[layer] == block) return static_cast<int>(layer);
  }
  return -1;
}

int64_t ParamLayout::total_numel() const {
  int64_t total = 0;
  for (int64_t n : block_numel_) total += n;
  return total;
}

const ParamSpec& ParamLayout::find(const std::string& name) const {
  auto it = index_.find(name);
  DSTRAIN_CHECK(it != index_.end()) << "no parameter named " << name;
  return params_[it->second];
}

Tensor ParamLayout::view(const ParamSpec& spec, Tensor block_flat) {
  Tensor tensor = block_flat.slice(spec.offset, {spec.numel()});
  tensor.ndim = static_cast<int>(spec.shape.size());
  for (int i = 0; i < tensor.ndim; ++i) tensor.shape[i] = spec.shape[i];
  return tensor;
}

std::vector<Tensor> ParamLayout::block_views(int block, Tensor block_flat) const {
  std::vector<Tensor> tensors;
  if (block_flat.empty()) return tensors;
  for (int index : block_params(block)) {
    tensors.push_back(view(params_[static_cast<size_t>(index)], block_flat));
  }
  return tensors;
}

TpSliceRuns tp_slice_runs(const ParamSpec& spec) {
  if (spec.tp_dim < 0) return {spec.numel(), 1};
  const auto dim = static_cast<size_t>(spec.tp_dim);
  const int64_t tp = spec.full_shape[dim] / spec.shape[dim];
  int64_t inner = 1;
  for (size_t d = dim + 1; d < spec.shape.size(); ++d) inner *= spec.shape[d];
  return {spec.shape[dim] / spec.tp_parts * inner, tp};
}

void extract_tp_slice(const ParamSpec& spec, int tp_rank, const float* full, float* slice) {
  for_each_tp_run(spec, tp_rank, 0, spec.numel(), [&](int64_t local, int64_t at, int64_t count) {
    std::memcpy(slice + local, full + at, static_cast<size_t>(count) * sizeof(float));
  });
}

void insert_tp_slice(const ParamSpec& spec, int tp_rank, const float* slice, float* full) {
  for_each_tp_run(spec, tp_rank, 0, spec.numel(), [&](int64_t local, int64_t at, int64_t count) {
    std::memcpy(full + at, slice + local, static_cast<size_t>(count) * sizeof(float));
  });
}

}  // namespace dstrain
