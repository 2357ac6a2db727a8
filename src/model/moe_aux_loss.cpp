#include "model/moe_aux_loss.h"

#include <algorithm>
#include <memory>

#include "comm/gather_values.h"
#include "core/check.h"

namespace dstrain {

namespace {

// The routing of a layer on the host: the chosen experts (N, k) and the probabilities (N, E).
void read_routing(Backend& backend, const MoeActivations& a, std::vector<int32_t>& chosen,
                  std::vector<float>& scores, Stream stream) {
  chosen.resize(static_cast<size_t>(a.topk_expert.numel()));
  scores.resize(static_cast<size_t>(a.scores.numel()));
  backend.copy_bytes(chosen.data(), a.topk_expert.data, a.topk_expert.nbytes(), stream);
  backend.copy_bytes(scores.data(), a.scores.data, a.scores.nbytes(), stream);
  backend.synchronize(stream);
}

}  // namespace

MoeAuxLoss::MoeAuxLoss(AuxLossKind kind, int64_t experts, int64_t top_k, double coef,
                       Communicator* data)
    : kind_(kind), experts_(experts), top_k_(top_k), coef_(coef), data_(data) {
  DSTRAIN_CHECK(experts > 0 && top_k > 0 && coef > 0) << experts << " " << top_k << " " << coef;
}

std::unique_ptr<MoeAuxLoss> make_aux_loss(const ModelConfig& config, Communicator* data) {
  const MoeConfig& moe = config.moe;
  if (moe.aux_loss_coef > 0) {
    return std::make_unique<MoeAuxLoss>(AuxLossKind::Transformers, moe.experts, moe.top_k,
                                        moe.aux_loss_coef, data);
  }
  if (moe.deepseek_aux_alpha() > 0) {
    return std::make_unique<MoeAuxLoss>(
        moe.seq_aux ? AuxLossKind::DeepSeekSequence : AuxLossKind::DeepSeekToken, moe.experts,
        moe.top_k, moe.deepseek_aux_alpha(), data);
  }
  return nullptr;
}

void MoeAuxLoss::begin_step(double loss_scale, int64_t accumulation, int data_parallel) {
  // transformers' loop divides each micro-batch's loss by the accumulation; DeepSeek's
  // AddAuxiliaryLoss gives the loss a gradient of 1 per micro-batch, averaged over the ranks.
  weight_ = kind_ == AuxLossKind::Transformers ? loss_scale / static_cast<double>(accumulation)
                                               : loss_scale / data_parallel;
  micro_batches_.clear();
  current_ = 0;
}

void MoeAuxLoss::set_stage(bool first, bool last) {
  first_stage_ = first;
  last_stage_ = last;
}

MoeAuxLoss::MicroBatch& MoeAuxLoss::micro_batch(int index) {
  MicroBatch& m = micro_batches_[index];
  const size_t E = static_cast<size_t>(experts_);
  if (m.sums.empty()) m.sums.assign(2 * E, 0.0);
  if (m.gradient.empty()) m.gradient.assign(E, 0.0);
  return m;
}

void MoeAuxLoss::begin_forward(int index) {
  current_ = index;
  if (kind_ != AuxLossKind::Transformers) return;
  MicroBatch& m = micro_batch(index);
  // A later stage starts from the sums that came with the activations (forward_message).
  if (first_stage_) std::fill(m.sums.begin(), m.sums.end(), 0.0);
  m.combined = false;
}

void MoeAuxLoss::begin_backward(int index) {
  current_ = index;
  if (kind_ != AuxLossKind::Transformers) return;
  MicroBatch& m = micro_batch(index);
  if (last_stage_ && !m.combined) combine(m);
  DSTRAIN_CHECK(m.combined) << "the load-balancing loss's gradient of micro-batch " << index
                            << " did not arrive from the next pipeline stage";
}

Tensor MoeAuxLoss::forward_message(int index) {
  std::vector<double>& sums = micro_batch(index).sums;
  return Tensor(sums.data(), DType::I32, {static_cast<int64_t>(2 * sums.size())});
}

Tensor MoeAuxLoss::backward_message(int index) {
  MicroBatch& m = micro_batch(index);
  m.combined = true;  // sent from here, or received into before this stage's backward
  return Tensor(m.gradient.data(), DType::I32, {static_cast<int64_t>(2 * m.gradient.size())});
}

void MoeAuxLoss::add_layer(Backend& backend, const MoeActivations& a, Stream stream) {
  if (kind_ != AuxLossKind::Transformers) return;  // DeepSeek's is a layer's own, in backward
  const size_t E = static_cast<size_t>(experts_);
  std::vector<double>& sums = micro_batch(current_).sums;
  std::vector<int32_t> chosen;
  std::vector<float> scores;
  read_routing(backend, a, chosen, scores, stream);
  for (int32_t e : chosen) sums[static_cast<size_t>(e)] += 1;
  for (size_t i = 0; i < scores.size(); ++i) sums[E + i % E] += scores[i];
}

void MoeAuxLoss::combine(MicroBatch& m) {
  const size_t E = static_cast<size_t>(experts_);
  std::vector<double> total(2 * E, 0.0);
  if (data_ != nullptr && data_->size() > 1) {
    const std::vector<double> all = all_gather_values(*data_, m.sums);
    for (size_t i = 0; i < all.size(); ++i) total[i % (2 * E)] += all[i];  // in rank order
  } else {
    total = m.sums;
  }
  double choices = 0;
  for (size_t e = 0; e < E; ++e) choices += total[e];
  DSTRAIN_CHECK(choices > 0) << "the load-balancing loss's backward before its forward";
  const double rows = choices / static_cast<double>(top_k_);
  double aux = 0;
  for (size_t e = 0; e < E; ++e) {
    aux += (total[e] / rows) * (total[E + e] / rows);
    m.gradient[e] = static_cast<double>(experts_) * total[e] / (rows * rows);
  }
  step_sum_ += static_cast<double>(experts_) * aux;
  m.combined = true;
}

// DeepSeek's: per sequence (seq_aux) or over all N tokens as one group of `seq_len` = N.
void MoeAuxLoss::deepseek_gradient(const std::vector<int32_t>& chosen,
                                   const std::vector<float>& scores, int64_t seq_len,
                                   std::vector<float>& gradient) {
  const int64_t E = experts_, k = top_k_;
  const int64_t N = static_cast<int64_t>(scores.size()) / E;
  const int64_t T = kind_ == AuxLossKind::DeepSeekSequence ? seq_len : N;
  const int64_t groups = N / T;
  DSTRAIN_CHECK(groups * T == N) << N << " tokens in sequences of " << T;
  double aux = 0;
  for (int64_t s = 0; s < groups; ++s) {
    std::vector<double> f(static_cast<size_t>(E), 0.0), p(static_cast<size_t>(E), 0.0);
    for (int64_t i = s * T * k; i < (s + 1) * T * k; ++i) f[static_cast<size_t>(chosen[i])] += 1;
    for (int64_t t = s * T; t < (s + 1) * T; ++t) {
      for (int64_t e = 0; e < E; ++e) p[static_cast<size_t>(e)] += scores[t * E + e];
    }
    for (int64_t e = 0; e < E; ++e) {
      f[e] *= static_cast<double>(E) / static_cast<double>(T * k);
      aux += f[e] * p[e] / static_cast<double>(T) / static_cast<double>(groups);
      // d aux / d p_{t,e} = f_e / (T groups), for each token t of the group.
      const float g = static_cast<float>(coef_ * weight_ * f[e] / static_cast<double>(T * groups));
      for (int64_t t = s * T; t < (s + 1) * T; ++t) gradient[t * E + e] = g;
    }
  }
  step_sum_ += aux;
}

void MoeAuxLoss::layer_gradient(Backend& backend, const MoeActivations& a, int64_t seq_len,
                                Tensor dscores, Stream stream) {
  DSTRAIN_CHECK(dscores.dtype == DType::F32 && dscores.ndim == 2 && dscores.size(1) == experts_)
      << dscores.shape_str();
  std::vector<float> values(static_cast<size_t>(dscores.numel()));
  if (kind_ == AuxLossKind::Transformers) {
    MicroBatch& m = micro_batch(current_);
    if (!m.combined) {
      DSTRAIN_CHECK(last_stage_) << "the load-balancing loss's gradient before it arrived";
      combine(m);
    }
    const size_t E = static_cast<size_t>(experts_);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = static_cast<float>(coef_ * weight_ * m.gradient[i % E]);
    }
  } else {
    std::vector<int32_t> chosen;
    std::vector<float> scores;
    read_routing(backend, a, chosen, scores, stream);
    deepseek_gradient(chosen, scores, seq_len, values);
  }
  backend.copy_bytes(dscores.data, values.data(), dscores.nbytes(), stream);
  backend.synchronize(stream);  // the host values die on return
}

double MoeAuxLoss::take_step_sum() {
  const double sum = step_sum_;
  step_sum_ = 0;
  return sum;
}

}  // namespace dstrain
