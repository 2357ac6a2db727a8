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
  if (tp < 1) {
    reason << "tensor parallelism needs at least 1 rank, not " << tp;
  } else if (divisible("n_head", config.n_head) &&
             divisible("the MLP width 4 * n_embd", 4 * config.n_embd) &&
             divisible("n_embd", config.n_embd)) {
    // Megatron pads the vocabulary to a multiple of 128 * tp; dstrain pads to 64 only, so some
    // vocabularies cannot be split evenly.
    if (!divisible("the padded vocabulary", config.padded_vocab())) {
      reason << " (vocab_size " << config.vocab_size << " padded to a multiple of 64)";
    }
  }
  return reason.str();
}

ParamLayout::ParamLayout(const ModelConfig& config, int tp) : tp_(tp) {
  const std::string unsupported = tp_unsupported_reason(config, tp);
  DSTRAIN_USER_CHECK(unsupported.empty()) << unsupported;
  const int64_t C = config.n_embd;
  int block = -1;
  int64_t cursor = 0;
  auto begin_block = [&] {
    if (block >= 0) block_numel_.push_back(cursor);
    ++block;
    cursor = 0;
    block_params_.emplace_back();
  };
  // split: {tp_dim, tp_parts}; {-1, 1} replicated.
  struct Split { int dim = -1, parts = 1; };
  auto add = [&](std::string name, std::vector<int64_t> full_shape, bool decay, Split split,
                 bool partial_grad = false, std::vector<int64_t> file_shape = {}) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.block = block;
    spec.offset = cursor;
    spec.full_shape = full_shape;
    spec.shape = full_shape;
    if (split.dim >= 0) spec.shape[static_cast<size_t>(split.dim)] /= tp;
    spec.file_shape = file_shape.empty() ? full_shape : file_shape;
    spec.weight_decay = decay;
    spec.tp_dim = split.dim;
    spec.tp_parts = split.parts;
    spec.tp_partial_grad = partial_grad;
    cursor += (spec.numel() + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    index_[spec.name] = static_cast<int>(params_.size());
    block_params_.back().push_back(static_cast<int>(params_.size()));
    params_.push_back(std::move(spec));
  };
  const Split replicated, rows{0, 1}, columns{1, 1}, qkv_columns{1, 3}, qkv_bias{0, 3};
  const bool norm = true;  // a layernorm: in the sequence-parallel region

  begin_block();
  add("wte.weight", {config.padded_vocab(), C}, true, rows, false, {config.vocab_size, C});
  add("wpe.weight", {config.n_positions, C}, true, replicated);
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    begin_block();
    const std::string prefix = "h." + std::to_string(layer) + ".";
    // Must match the LayerParam order.
    add(prefix + "ln_1.weight", {C}, false, replicated, norm);
    add(prefix + "ln_1.bias", {C}, false, replicated, norm);
    add(prefix + "attn.c_attn.weight", {C, 3 * C}, true, qkv_columns);
    add(prefix + "attn.c_attn.bias", {3 * C}, false, qkv_bias);
    add(prefix + "attn.c_proj.weight", {C, C}, true, rows);
    add(prefix + "attn.c_proj.bias", {C}, false, replicated);  // added once, after the sum
    add(prefix + "ln_2.weight", {C}, false, replicated, norm);
    add(prefix + "ln_2.bias", {C}, false, replicated, norm);
    add(prefix + "mlp.c_fc.weight", {C, 4 * C}, true, columns);
    add(prefix + "mlp.c_fc.bias", {4 * C}, false, rows);
    add(prefix + "mlp.c_proj.weight", {4 * C, C}, true, rows);
    add(prefix + "mlp.c_proj.bias", {C}, false, replicated);
  }
  begin_block();
  add("ln_f.weight", {C}, false, replicated, norm);
  add("ln_f.bias", {C}, false, replicated, norm);
  block_numel_.push_back(cursor);
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
