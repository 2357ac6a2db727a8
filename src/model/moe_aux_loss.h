// The auxiliary losses that balance a mixture of experts' load, exactly as the models' own code
// computes them where the config asks.
//
// transformers (Mixtral, Qwen2-MoE: output_router_logits with router_aux_loss_coef;
// load_balancing_loss_func, Switch Transformer's loss), over the R rows (token, MoE layer) of a
// micro-batch:
//
//   aux = E * sum_e f_e * P_e,   f_e = c_e / R,   P_e = S_e / R
//
// c_e the choices of expert e (each row chooses k experts), S_e the sum of the rows' softmax
// probabilities of e. The training loss is the cross-entropy plus coef * aux; its gradient
// reaches the router through the probabilities only (the choices are constants):
// d aux / d p_{row, e} = E c_e / R^2, the same for every row. Over data-parallel ranks the
// statistics of a micro-batch are summed before aux is formed (Megatron's global auxiliary
// loss): dp ranks at micro-batch b give one rank's numbers at micro-batch dp x b. The layers of
// a micro-batch are all on one pipeline stage (pp > 1 is refused with this loss).
//
// DeepSeekMoE (aux_loss_alpha, seq_aux; its MoEGate): each MoE layer's own loss, with seq_aux
// per sequence s of T tokens, f_{s,e} = c_{s,e} E / (T k), P_{s,e} = the mean over its tokens,
// aux = alpha * mean_s sum_e f_{s,e} P_{s,e}; without it over the micro-batch's N tokens, f_e =
// c_e E / (N k), P_e the mean, aux = alpha * sum_e f_e P_e. DeepSeek's AddAuxiliaryLoss puts it
// into the gradient only, with weight 1 per micro-batch (not divided by the accumulation; the
// data-parallel average divides it by dp): the training loss it reports is the cross-entropy.
// Sequences are whole on each rank, so no statistic crosses ranks: dp ranks at b again equal
// one rank at dp x b.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/moe_mlp.h"

namespace dstrain {

enum class AuxLossKind { Transformers, DeepSeekSequence, DeepSeekToken };

class MoeAuxLoss {
 public:
  // data: the data-parallel group the transformers statistics are summed over (nullptr: this
  // rank alone).
  MoeAuxLoss(AuxLossKind kind, int64_t experts, int64_t top_k, double coef, Communicator* data);

  AuxLossKind kind() const { return kind_; }
  double coef() const { return coef_; }
  // Whether the training loss it reports includes coef * aux (transformers), or only the
  // gradient does (DeepSeek).
  bool in_reported_loss() const { return kind_ == AuxLossKind::Transformers; }
  // The step's gradient weight from its loss scale, accumulation and data-parallel ranks.
  void begin_step(double loss_scale, int64_t accumulation, int data_parallel);

  // A MoE layer's forward (not a recompute): its routing `a` (topk_expert, scores) is added to
  // the micro-batch's statistics (transformers); `first` starts a new micro-batch.
  void add_layer(Backend& backend, const MoeActivations& a, bool first, Stream stream);
  // A MoE layer's backward: dscores (N, E) F32 = the loss's gradient w.r.t. the layer's
  // probabilities, times the step's weight; `a` its routing, of sequences of `seq_len` tokens.
  // Transformers: the first call of a micro-batch sums its statistics over the data-parallel
  // ranks (collective).
  void layer_gradient(Backend& backend, const MoeActivations& a, int64_t seq_len, Tensor dscores,
                      Stream stream);

  // The sum of the micro-batches' aux (without coef) since the last call: transformers' once per
  // micro-batch, DeepSeek's summed over the MoE layers.
  double take_step_sum();

 private:
  void combine();
  void deepseek_gradient(const std::vector<int32_t>& chosen, const std::vector<float>& scores,
                         int64_t seq_len, std::vector<float>& gradient);

  AuxLossKind kind_;
  int64_t experts_, top_k_;
  double coef_, weight_ = 0;
  Communicator* data_;
  std::vector<double> counts_, prob_sums_;  // c_e, S_e of this rank's rows
  std::vector<double> gradient_;            // E c_e / R^2 of all ranks' rows, per expert
  bool combined_ = false;
  double step_sum_ = 0;
};

// The loss the config asks for, or nullptr.
std::unique_ptr<MoeAuxLoss> make_aux_loss(const ModelConfig& config, Communicator* data);

}  // namespace dstrain
