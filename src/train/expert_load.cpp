#include "train/expert_load.h"

#include <algorithm>

#include "comm/gather_values.h"
#include "core/check.h"

namespace dstrain {

SummedExpertLoad sum_expert_load(Communicator& world, const ExpertLoad& mine, bool counted,
                                 int layers, int64_t experts) {
  // Per layer: each expert's copies, then the copies dropped; exact below 2^53.
  const size_t stride = static_cast<size_t>(experts) + 1;
  const size_t per_rank = static_cast<size_t>(layers) * stride;
  std::vector<double> counts(per_rank, 0.0);
  for (size_t l = 0; counted && l < mine.tokens.size(); ++l) {
    for (size_t e = 0; e < mine.tokens[l].size(); ++e) {
      counts[l * stride + e] = static_cast<double>(mine.tokens[l][e]);
    }
  }
  for (size_t l = 0; counted && l < mine.dropped.size(); ++l) {
    counts[l * stride + stride - 1] = static_cast<double>(mine.dropped[l]);
  }
  const std::vector<double> all = all_gather_values(world, counts);
  SummedExpertLoad sum(static_cast<size_t>(layers), std::vector<double>(stride, 0.0));
  for (size_t i = 0; i < all.size(); ++i) sum[(i % per_rank) / stride][i % stride] += all[i];
  return sum;
}

std::vector<LayerLoad> layer_loads(const SummedExpertLoad& summed) {
  std::vector<LayerLoad> load;
  for (size_t l = 0; l < summed.size(); ++l) {
    const auto first = summed[l].begin(), last = summed[l].end() - 1;  // last: the dropped
    double total = 0;
    for (auto it = first; it != last; ++it) total += *it;
    if (total == 0 && *last == 0) continue;  // a dense layer
    load.push_back({static_cast<int>(l), static_cast<int64_t>(*std::min_element(first, last)),
                    static_cast<int64_t>(*std::max_element(first, last)),
                    total / static_cast<double>(last - first), static_cast<int64_t>(*last)});
  }
  return load;
}

void update_selection_bias(std::vector<float>& bias, const std::vector<double>& load,
                           double rate) {
  DSTRAIN_CHECK(load.size() >= bias.size() && !bias.empty())
      << load.size() << " loads for " << bias.size() << " experts";
  double total = 0;
  for (size_t e = 0; e < bias.size(); ++e) total += load[e];
  const double mean = total / static_cast<double>(bias.size());
  const auto step = static_cast<float>(rate);
  for (size_t e = 0; e < bias.size(); ++e) {
    if (load[e] < mean) bias[e] += step;
    if (load[e] > mean) bias[e] -= step;
  }
}

nlohmann::json expert_load_json(const std::vector<LayerLoad>& load) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerLoad& l : load) {
    layers.push_back({{"layer", l.layer},
                      {"min", l.min},
                      {"max", l.max},
                      {"mean", l.mean},
                      {"dropped", l.dropped}});
  }
  return layers;
}

}  // namespace dstrain
