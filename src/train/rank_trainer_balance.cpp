// A router's selection bias (DeepSeek-V3's e_score_correction_bias, a parameter the gradient
// never reaches): every rank keeps each MoE layer's whole in F32, from the starting weights, and
// the routing reads these (the parameters may be 16-bit: their rounding would change choices).
// DeepSeek-V3's auxiliary-loss-free balancing (--moe-router-bias-update-rate) moves them after
// every applied step by the rate times sign(the mean load - the expert's load), the loads summed
// over the step's micro-batches and every rank (train/expert_load.h): every rank by the same
// loads, each writing them where it stores them (ShardedModel::set_param_values), so the master
// weights, checkpoints and resumes carry them.
#include "model/parts.h"
#include "train/rank_trainer.h"

namespace dstrain {

namespace {

std::string selection_bias_name(const DecoderParts& parts, int layer) {
  return parts.names.layer_prefix + std::to_string(layer) + "." + parts.names.router_bias;
}

}  // namespace

void RankTrainer::load_selection_biases() {
  selection_biases_.clear();
  selection_bias_specs_.clear();
  const DecoderParts parts = decoder_parts(config_);
  const bool biased = parts.mlp.kind == MlpKind::MoE && parts.mlp.selection_bias;
  DSTRAIN_USER_CHECK(biased || options_.moe_bias_update_rate == 0)
      << "--moe-router-bias-update-rate needs a router with a selection bias (DeepSeek-V3's "
         "e_score_correction_bias); "
      << config_.name << " has none";
  if (!biased) return;
  for (int layer = 0; layer < config_.n_layer; ++layer) {
    if (parts.layer_mlp(layer).kind != MlpKind::MoE) continue;
    const ParamSpec& spec = full_layout_.find(selection_bias_name(parts, layer));
    const float* values = ParamLayout::view(spec, ctx_.initial->params.block(spec.block)).f32();
    selection_biases_.emplace_back(layer, std::vector<float>(values, values + spec.numel()));
    selection_bias_specs_.push_back(&arch_->layout().find(selection_bias_name(parts, layer)));
  }
}

void RankTrainer::update_selection_biases(const SummedExpertLoad& load) {
  if (options_.moe_bias_update_rate == 0) return;
  for (size_t i = 0; i < selection_biases_.size(); ++i) {
    auto& [layer, bias] = selection_biases_[i];
    update_selection_bias(bias, load[static_cast<size_t>(layer)], options_.moe_bias_update_rate);
    const ParamSpec& spec = *selection_bias_specs_[i];
    if (state_->holds(spec.block)) state_->set_param_values(spec, bias);
  }
}

}  // namespace dstrain
