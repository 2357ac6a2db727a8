// Small host values gathered from every rank exactly (their bytes through an I32 all-gather):
// the loss, timings and memory counts of the trainer, the replica checksums.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "comm/communicator.h"

namespace dstrain {

// Every rank's values (n each, the same n on every rank), in rank order. Collective.
template <class T>
std::vector<T> all_gather_values(Communicator& comm, const std::vector<T>& mine) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0, "whole 32-bit words");
  if (comm.size() == 1 || mine.empty()) {
    return comm.size() == 1 ? mine : std::vector<T>();
  }
  const int64_t words = static_cast<int64_t>(mine.size() * sizeof(T) / 4);
  std::vector<int32_t> local(static_cast<size_t>(words)), all(static_cast<size_t>(words * comm.size()));
  std::memcpy(local.data(), mine.data(), mine.size() * sizeof(T));
  comm.all_gather(Tensor(all.data(), DType::I32, {static_cast<int64_t>(all.size())}),
                  Tensor(local.data(), DType::I32, {words}), nullptr);
  std::vector<T> values(mine.size() * static_cast<size_t>(comm.size()));
  std::memcpy(values.data(), all.data(), values.size() * sizeof(T));
  return values;
}

}  // namespace dstrain
