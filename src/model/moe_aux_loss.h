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
// loss): dp ranks at micro-batch b give one rank's numbers at micro-batch dp x b. With pipeline
// stages the statistics travel with the micro-batch: each stage adds its layers' c_e and S_e to
// the running sums it received with the activations (the same additions in the same order as
// one stage), the last stage sums them over its data-parallel ranks and forms aux, and E c_e /
// R^2 travels back with the gradients (PipelineRunner sends both beside its own messages).
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
#include <map>
#include <memory>
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

  // Which pipeline stage this is (default: the only one). Only the last forms aux.
  void set_stage(bool first, bool last);
  // The micro-batch whose forward (backward) this stage runs next: the pipeline runner says so
  // before each compute action. A forward on the first stage starts its statistics from zero;
  // on a later one from what arrived in forward_message. A backward on the last stage sums the
  // statistics over the data-parallel ranks (collective) and forms aux. Without these calls
  // every layer counts toward micro-batch 0 (one micro-batch in flight, as in tests).
  void begin_forward(int micro_batch);
  void begin_backward(int micro_batch);

  // A MoE layer's forward (not a recompute): its routing `a` (topk_expert, scores) is added to
  // the current micro-batch's statistics (transformers).
  void add_layer(Backend& backend, const MoeActivations& a, Stream stream);
  // A MoE layer's backward: dscores (N, E) F32 = the loss's gradient w.r.t. the layer's
  // probabilities, times the step's weight; `a` its routing, of sequences of `seq_len` tokens.
  void layer_gradient(Backend& backend, const MoeActivations& a, int64_t seq_len, Tensor dscores,
                      Stream stream);

  // What travels between pipeline stages (transformers' loss only: `travels()`), host tensors
  // of the same size on both ends, valid until the step ends: the running c_e and S_e of a
  // micro-batch, sent after its forward to the next stage (and received into before it), and
  // E c_e / R^2 over every layer and rank, sent back with its gradient. Doubles, as I32 pairs.
  bool travels() const { return kind_ == AuxLossKind::Transformers; }
  Tensor forward_message(int micro_batch);
  Tensor backward_message(int micro_batch);

  // The sum of the micro-batches' aux (without coef) since the last call: transformers' once per
  // micro-batch, DeepSeek's summed over the MoE layers.
  double take_step_sum();

 private:
  struct MicroBatch {
    std::vector<double> sums;      // c_e, then S_e: the running sums of the layers so far
    std::vector<double> gradient;  // E c_e / R^2 of every layer and rank, per expert
    bool combined = false;         // gradient holds it (formed here or received)
  };
  MicroBatch& micro_batch(int index);
  void combine(MicroBatch& m);
  void deepseek_gradient(const std::vector<int32_t>& chosen, const std::vector<float>& scores,
                         int64_t seq_len, std::vector<float>& gradient);

  AuxLossKind kind_;
  int64_t experts_, top_k_;
  double coef_, weight_ = 0;
  Communicator* data_;
  bool first_stage_ = true, last_stage_ = true;
  std::map<int, MicroBatch> micro_batches_;  // this step's, by index (cleared by begin_step)
  int current_ = 0;
  double step_sum_ = 0;
};

// The loss the config asks for, or nullptr.
std::unique_ptr<MoeAuxLoss> make_aux_loss(const ModelConfig& config, Communicator* data);

}  // namespace dstrain
