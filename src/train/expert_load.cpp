#include "train/expert_load.h"

#include <algorithm>

#include "comm/gather_values.h"

namespace dstrain {

std::vector<LayerLoad> gather_expert_load(Communicator& world, const ExpertLoad& mine, bool counted,
                                          int layers, int64_t experts) {
  const size_t per_rank = static_cast<size_t>(layers) * static_cast<size_t>(experts);
  std::vector<double> counts(per_rank, 0.0);  // exact below 2^53 copies
  for (size_t l = 0; counted && l < mine.tokens.size(); ++l) {
    for (size_t e = 0; e < mine.tokens[l].size(); ++e) {
      counts[l * static_cast<size_t>(experts) + e] = static_cast<double>(mine.tokens[l][e]);
    }
  }
  const std::vector<double> all = all_gather_values(world, counts);
  std::vector<double> sum(per_rank, 0.0);
  for (size_t i = 0; i < all.size(); ++i) sum[i % per_rank] += all[i];
  std::vector<LayerLoad> load;
  for (int l = 0; l < layers; ++l) {
    const auto first = sum.begin() + static_cast<std::ptrdiff_t>(l * experts);
    const auto last = first + static_cast<std::ptrdiff_t>(experts);
    double total = 0;
    for (auto it = first; it != last; ++it) total += *it;
    if (total == 0) continue;  // a dense layer
    load.push_back({l, static_cast<int64_t>(*std::min_element(first, last)),
                    static_cast<int64_t>(*std::max_element(first, last)),
                    total / static_cast<double>(experts)});
  }
  return load;
}

nlohmann::json expert_load_json(const std::vector<LayerLoad>& load) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerLoad& l : load) {
    layers.push_back({{"layer", l.layer}, {"min", l.min}, {"max", l.max}, {"mean", l.mean}});
  }
  return layers;
}

}  // namespace dstrain
