// The load-balancing loss of a mixture-of-experts model, exactly as transformers computes it
// (load_balancing_loss_func, Switch Transformer's loss) where the config asks for it
// (output_router_logits with router_aux_loss_coef): over the R rows (token, MoE layer) of a
// micro-batch,
//
//   aux = E * sum_e f_e * P_e,   f_e = c_e / R,   P_e = S_e / R
//
// c_e the choices of expert e (each row chooses k experts), S_e the sum of the rows' softmax
// probabilities of e. The training loss is the cross-entropy plus coef * aux. Its gradient
// reaches the router through the probabilities only (the choices are constants):
// d aux / d p_{row, e} = E c_e / R^2, the same for every row.
//
// Over data-parallel ranks the statistics of a micro-batch are summed before aux is formed
// (Megatron's global auxiliary loss): dp ranks at micro-batch b give one rank's numbers at
// micro-batch dp x b. Across gradient accumulation aux is per micro-batch, as in transformers.
// The layers of a micro-batch are all on one pipeline stage (pp > 1 is refused with the loss).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/moe_mlp.h"

namespace dstrain {

class MoeAuxLoss {
 public:
  // data: the data-parallel group the statistics are summed over (nullptr: this rank alone).
  MoeAuxLoss(int64_t experts, int64_t top_k, double coef, Communicator* data);

  double coef() const { return coef_; }
  // The weight of the loss's gradient in the step (the loss scale over the accumulation).
  void set_gradient_weight(double weight) { weight_ = weight; }

  // A MoE layer's forward (not a recompute): its routing `a` (topk_expert, scores) is added to
  // the micro-batch's statistics; `first` starts a new micro-batch.
  void add_layer(Backend& backend, const MoeActivations& a, bool first, Stream stream);
  // A MoE layer's backward: dscores (N, E) F32 = the loss's gradient w.r.t. the layer's
  // probabilities times the weight. The first call of a micro-batch sums its statistics over
  // the data-parallel ranks (collective) and adds its aux to the step's.
  void layer_gradient(Backend& backend, Tensor dscores, Stream stream);

  // The sum of the micro-batches' aux since the last call.
  double take_step_sum();

 private:
  void combine();

  int64_t experts_, top_k_;
  double coef_, weight_ = 0;
  Communicator* data_;
  std::vector<double> counts_, prob_sums_;  // c_e, S_e of this rank's rows
  std::vector<double> gradient_;            // E c_e / R^2 of all ranks' rows, per expert
  bool combined_ = false;
  double step_sum_ = 0;
};

}  // namespace dstrain
