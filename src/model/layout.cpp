#include "model/layout.h"

#include <cstring>
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
  const bool llama = config.llama_family();
  if (tp < 1) {
    reason << "tensor parallelism needs at least 1 rank, not " << tp;
  } else if (divisible("n_head", config.n_head) &&
             (!llama || divisible("num_key_value_heads", config.kv_heads())) &&
             divisible(llama ? "the MLP width intermediate_size" : "the MLP width 4 * n_embd",
                       config.mlp_width()) &&
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
  bool packed = false;        // right after the previous tensor, no alignment gap
  std::vector<int64_t> file_shape = {};
};

}  // namespace

// Builds a layout tensor by tensor: blocks in order, each tensor aligned (or packed right
// after the previous one, so that two tensors form one matrix).
class ParamLayout::Builder {
 public:
  Builder(ParamLayout& layout, int tp) : layout_(layout), tp_(tp) {}
  ~Builder() { layout_.block_numel_.push_back(aligned(cursor_)); }

  void begin_block() {
    if (block_ >= 0) layout_.block_numel_.push_back(aligned(cursor_));
    ++block_;
    cursor_ = 0;
    layout_.block_params_.emplace_back();
  }
  using Split = TensorSplit;
  using Options = TensorOptions;
  void add(std::string name, std::vector<int64_t> full_shape, bool decay, Split split,
           Options options = {}) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.block = block_;
    spec.full_shape = full_shape;
    spec.shape = full_shape;
    if (split.dim >= 0) spec.shape[static_cast<size_t>(split.dim)] /= tp_;
    spec.file_shape = options.file_shape.empty() ? full_shape : options.file_shape;
    spec.weight_decay = decay;
    spec.tp_dim = split.dim;
    spec.tp_parts = split.parts;
    spec.tp_partial_grad = options.partial_grad;
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
  int block_ = -1;
  int64_t cursor_ = 0;
};

namespace {

using Builder = ParamLayout::Builder;
const Builder::Split kReplicated, kRows{0, 1}, kColumns{1, 1};

// GPT-2, with the Hugging Face GPT-2 names without "transformer.".
void add_gpt2_tensors(Builder& b, const ModelConfig& config) {
  const int64_t C = config.n_embd;
  const Builder::Split qkv_columns{1, 3}, qkv_bias{0, 3};
  const Builder::Options norm{.partial_grad = true};
  b.begin_block();
  b.add("wte.weight", {config.padded_vocab(), C}, true, kRows,
        Builder::Options{.file_shape = {config.vocab_size, C}});
  b.add("wpe.weight", {config.n_positions, C}, true, kReplicated);
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    b.begin_block();
    const std::string prefix = "h." + std::to_string(layer) + ".";
    // Must match the LayerParam order.
    b.add(prefix + "ln_1.weight", {C}, false, kReplicated, norm);
    b.add(prefix + "ln_1.bias", {C}, false, kReplicated, norm);
    b.add(prefix + "attn.c_attn.weight", {C, 3 * C}, true, qkv_columns);
    b.add(prefix + "attn.c_attn.bias", {3 * C}, false, qkv_bias);
    b.add(prefix + "attn.c_proj.weight", {C, C}, true, kRows);
    b.add(prefix + "attn.c_proj.bias", {C}, false, kReplicated);  // added once, after the sum
    b.add(prefix + "ln_2.weight", {C}, false, kReplicated, norm);
    b.add(prefix + "ln_2.bias", {C}, false, kReplicated, norm);
    b.add(prefix + "mlp.c_fc.weight", {C, 4 * C}, true, kColumns);
    b.add(prefix + "mlp.c_fc.bias", {4 * C}, false, kRows);
    b.add(prefix + "mlp.c_proj.weight", {4 * C, C}, true, kRows);
    b.add(prefix + "mlp.c_proj.bias", {C}, false, kReplicated);
  }
  b.begin_block();
  b.add("ln_f.weight", {C}, false, kReplicated, norm);
  b.add("ln_f.bias", {C}, false, kReplicated, norm);
}

// One LLaMA-family layer. nn.Linear weights are (out, in). q, k and v are packed into one
// ((NH + 2 KV) hd, C) matrix (under tp: this rank's heads of each), gate and up into one
// (2 I, C): one GEMM each. Their biases likewise.
void add_llama_layer(Builder& b, const ModelConfig& config, int64_t layer) {
  const int64_t C = config.n_embd, I = config.mlp_width(), hd = config.head_dim();
  const int64_t q = config.n_head * hd, kv = config.kv_heads() * hd;
  const Builder::Options norm{.partial_grad = true}, packed{.packed = true};
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  b.add(p + "input_layernorm.weight", {C}, false, kReplicated, norm);
  b.add(p + "self_attn.q_proj.weight", {q, C}, true, kRows);
  b.add(p + "self_attn.k_proj.weight", {kv, C}, true, kRows, packed);
  b.add(p + "self_attn.v_proj.weight", {kv, C}, true, kRows, packed);
  if (config.qkv_bias) {
    b.add(p + "self_attn.q_proj.bias", {q}, false, kRows);
    b.add(p + "self_attn.k_proj.bias", {kv}, false, kRows, packed);
    b.add(p + "self_attn.v_proj.bias", {kv}, false, kRows, packed);
  }
  b.add(p + "self_attn.o_proj.weight", {C, q}, true, kColumns);
  if (config.o_bias) b.add(p + "self_attn.o_proj.bias", {C}, false, kReplicated);
  b.add(p + "post_attention_layernorm.weight", {C}, false, kReplicated, norm);
  b.add(p + "mlp.gate_proj.weight", {I, C}, true, kRows);
  b.add(p + "mlp.up_proj.weight", {I, C}, true, kRows, packed);
  if (config.mlp_bias) {
    b.add(p + "mlp.gate_proj.bias", {I}, false, kRows);
    b.add(p + "mlp.up_proj.bias", {I}, false, kRows, packed);
  }
  b.add(p + "mlp.down_proj.weight", {C, I}, true, kColumns);
  if (config.mlp_bias) b.add(p + "mlp.down_proj.bias", {C}, false, kReplicated);
}

// Llama / Qwen2 / DeepSeek-LLM with the Hugging Face names ("model.layers.0...", "lm_head").
void add_llama_tensors(Builder& b, const ModelConfig& config) {
  const int64_t C = config.n_embd;
  const Builder::Options vocab{.file_shape = {config.vocab_size, C}};
  b.begin_block();
  b.add("model.embed_tokens.weight", {config.padded_vocab(), C}, true, kRows, vocab);
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    b.begin_block();
    add_llama_layer(b, config, layer);
  }
  b.begin_block();
  b.add("model.norm.weight", {C}, false, kReplicated, {.partial_grad = true});
  if (!config.tie_word_embeddings) {
    b.add("lm_head.weight", {config.padded_vocab(), C}, true, kRows, vocab);
  }
}

}  // namespace

ParamLayout::ParamLayout(const ModelConfig& config, int tp)
    : tp_(tp), tied_embedding_(!config.llama_family() || config.tie_word_embeddings) {
  const std::string unsupported = tp_unsupported_reason(config, tp);
  DSTRAIN_USER_CHECK(unsupported.empty()) << unsupported;
  Builder builder(*this, tp);
  if (config.llama_family()) {
    add_llama_tensors(builder, config);
  } else {
    add_gpt2_tensors(builder, config);
  }
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
