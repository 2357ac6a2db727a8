#include "model/layout.h"

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
int64_t ParamSpec::file_numel() const { return product(file_shape); }

ParamLayout::ParamLayout(const ModelConfig& config) {
  const int64_t C = config.n_embd;
  int block = -1;
  int64_t cursor = 0;
  auto begin_block = [&] {
    if (block >= 0) block_numel_.push_back(cursor);
    ++block;
    cursor = 0;
    block_params_.emplace_back();
  };
  auto add = [&](std::string name, std::vector<int64_t> shape, bool decay,
                 std::vector<int64_t> file_shape = {}) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.block = block;
    spec.offset = cursor;
    spec.shape = shape;
    spec.file_shape = file_shape.empty() ? shape : file_shape;
    spec.weight_decay = decay;
    cursor += (spec.numel() + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    index_[spec.name] = static_cast<int>(params_.size());
    block_params_.back().push_back(static_cast<int>(params_.size()));
    params_.push_back(std::move(spec));
  };

  begin_block();
  add("wte.weight", {config.padded_vocab(), C}, true, {config.vocab_size, C});
  add("wpe.weight", {config.n_positions, C}, true);
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    begin_block();
    const std::string prefix = "h." + std::to_string(layer) + ".";
    // Must match the LayerParam order.
    add(prefix + "ln_1.weight", {C}, false);
    add(prefix + "ln_1.bias", {C}, false);
    add(prefix + "attn.c_attn.weight", {C, 3 * C}, true);
    add(prefix + "attn.c_attn.bias", {3 * C}, false);
    add(prefix + "attn.c_proj.weight", {C, C}, true);
    add(prefix + "attn.c_proj.bias", {C}, false);
    add(prefix + "ln_2.weight", {C}, false);
    add(prefix + "ln_2.bias", {C}, false);
    add(prefix + "mlp.c_fc.weight", {C, 4 * C}, true);
    add(prefix + "mlp.c_fc.bias", {4 * C}, false);
    add(prefix + "mlp.c_proj.weight", {4 * C, C}, true);
    add(prefix + "mlp.c_proj.bias", {C}, false);
  }
  begin_block();
  add("ln_f.weight", {C}, false);
  add("ln_f.bias", {C}, false);
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

}  // namespace dstrain
