#include "model/moe_aux_loss.h"

#include "comm/gather_values.h"
#include "core/check.h"

namespace dstrain {

MoeAuxLoss::MoeAuxLoss(int64_t experts, int64_t top_k, double coef, Communicator* data)
    : experts_(experts), top_k_(top_k), coef_(coef), data_(data) {
  DSTRAIN_CHECK(experts > 0 && top_k > 0 && coef > 0) << experts << " " << top_k << " " << coef;
}

void MoeAuxLoss::add_layer(Backend& backend, const MoeActivations& a, bool first, Stream stream) {
  const size_t E = static_cast<size_t>(experts_);
  if (first || counts_.empty()) {
    counts_.assign(E, 0.0);
    prob_sums_.assign(E, 0.0);
    combined_ = false;
  }
  std::vector<int32_t> chosen(static_cast<size_t>(a.topk_expert.numel()));
  std::vector<float> scores(static_cast<size_t>(a.scores.numel()));
  backend.copy_bytes(chosen.data(), a.topk_expert.data, a.topk_expert.nbytes(), stream);
  backend.copy_bytes(scores.data(), a.scores.data, a.scores.nbytes(), stream);
  backend.synchronize(stream);
  for (int32_t e : chosen) counts_[static_cast<size_t>(e)] += 1;
  for (size_t i = 0; i < scores.size(); ++i) prob_sums_[i % E] += scores[i];
}

void MoeAuxLoss::combine() {
  const size_t E = static_cast<size_t>(experts_);
  std::vector<double> mine = counts_;
  mine.insert(mine.end(), prob_sums_.begin(), prob_sums_.end());
  std::vector<double> total(2 * E, 0.0);
  if (data_ != nullptr && data_->size() > 1) {
    const std::vector<double> all = all_gather_values(*data_, mine);
    for (size_t i = 0; i < all.size(); ++i) total[i % (2 * E)] += all[i];  // in rank order
  } else {
    total = mine;
  }
  double choices = 0;
  for (size_t e = 0; e < E; ++e) choices += total[e];
  const double rows = choices / static_cast<double>(top_k_);
  double aux = 0;
  gradient_.assign(E, 0.0);
  for (size_t e = 0; e < E; ++e) {
    aux += (total[e] / rows) * (total[E + e] / rows);
    gradient_[e] = static_cast<double>(experts_) * total[e] / (rows * rows);
  }
  step_sum_ += static_cast<double>(experts_) * aux;
  combined_ = true;
}

void MoeAuxLoss::layer_gradient(Backend& backend, Tensor dscores, Stream stream) {
  DSTRAIN_CHECK(!counts_.empty()) << "the load-balancing loss's backward before its forward";
  if (!combined_) combine();
  const size_t E = static_cast<size_t>(experts_);
  DSTRAIN_CHECK(dscores.dtype == DType::F32 && dscores.ndim == 2 && dscores.size(1) == experts_)
      << dscores.shape_str();
  std::vector<float> values(static_cast<size_t>(dscores.numel()));
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(coef_ * weight_ * gradient_[i % E]);
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
