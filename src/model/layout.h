// The parameter layout: every parameter tensor lives in one flat buffer per block.
//   block 0            embeddings: wte (Vp,C), wpe (maxT,C)
//   block 1 + l        transformer layer l: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//                      mlp.c_proj (weights in the Hugging Face Conv1D layout (in, out))
//   block L + 1        final layernorm ln_f
// Names are the Hugging Face GPT-2 names without the "transformer." prefix. A block is the
// unit of sharding (ZeRO-3 gathers one block at a time) and of pipeline cuts.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace dstrain {

struct ParamSpec {
  std::string name;           // "h.0.attn.c_attn.weight"
  int block = 0;
  int64_t offset = 0;         // elements from the start of the block's flat buffer
  std::vector<int64_t> shape; // as stored inside dstrain: wte is (Vp, C)
  std::vector<int64_t> file_shape;  // as in model.safetensors: wte is (V, C)
  bool weight_decay = false;  // matrices and embeddings decay; biases and norms do not
  int64_t numel() const;
  int64_t file_numel() const;  // the leading rows of the stored tensor that files hold
};

// The order of the 12 tensors of a transformer layer inside its block.
enum LayerParam : int {
  kLn1Weight, kLn1Bias, kQkvWeight, kQkvBias, kAttnProjWeight, kAttnProjBias,
  kLn2Weight, kLn2Bias, kFcWeight, kFcBias, kFcProjWeight, kFcProjBias, kNumLayerParams
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& config);

  int num_blocks() const { return static_cast<int>(block_numel_.size()); }
  int64_t block_numel(int block) const { return block_numel_.at(block); }
  int64_t total_numel() const;  // with alignment gaps and vocabulary padding
  const std::vector<ParamSpec>& params() const { return params_; }
  // Indices into params() of the tensors of one block, in buffer order.
  const std::vector<int>& block_params(int block) const { return block_params_.at(block); }
  // REQUIRES: the name exists (throws otherwise).
  const ParamSpec& find(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  static int embedding_block() { return 0; }
  static int layer_block(int layer) { return 1 + layer; }
  int final_block() const { return num_blocks() - 1; }

  // A view of one parameter inside its block's flat buffer (dtype of the buffer).
  static Tensor view(const ParamSpec& spec, Tensor block_flat);
  // Views of every tensor of block b inside its flat buffer, in buffer order (none for an
  // empty buffer: a block whose gradients are not asked for).
  std::vector<Tensor> block_views(int block, Tensor block_flat) const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<int64_t> block_numel_;
  std::vector<std::vector<int>> block_params_;
  std::unordered_map<std::string, int> index_;
};

}  // namespace dstrain
