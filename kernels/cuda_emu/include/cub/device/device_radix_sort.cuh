// cub::DeviceRadixSort as the CUDA emulator provides it (this folder comes before the toolkit's
// on the emulator build's include path): SortPairs with CUB's contract -- a first call with
// d_temp_storage == nullptr asks for the temporary bytes; the sort is stable and looks only at
// key bits [begin_bit, end_bit). Keys and values live in host memory under the emulator; the
// sort is queued on `stream` like any other stream work (emu_runtime.h).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

#include "kernels/cuda_emu/emu_runtime.h"

namespace cub {

struct DeviceRadixSort {
  template <class Key, class Value, class NumItems>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes,
                               const Key* d_keys_in, Key* d_keys_out, const Value* d_values_in,
                               Value* d_values_out, NumItems num_items, int begin_bit = 0,
                               int end_bit = sizeof(Key) * 8, cudaStream_t stream = 0) {
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = 256;  // CUB always asks for some
      return cudaSuccess;
    }
    if (num_items < 0 || begin_bit < 0 || end_bit > static_cast<int>(sizeof(Key) * 8) ||
        begin_bit > end_bit) {
      return cudaErrorInvalidValue;
    }
    const size_t n = static_cast<size_t>(num_items);
    dstrain::emu::enqueue(stream, [=] {
      const int bits = end_bit - begin_bit;
      auto digit = [&](Key key) {
        using Unsigned = std::make_unsigned_t<Key>;
        const Unsigned shifted = static_cast<Unsigned>(key) >> begin_bit;
        return bits >= static_cast<int>(sizeof(Key) * 8)
                   ? shifted
                   : static_cast<Unsigned>(shifted & ((Unsigned{1} << bits) - 1));
      };
      std::vector<size_t> order(n);
      std::iota(order.begin(), order.end(), size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return digit(d_keys_in[a]) < digit(d_keys_in[b]);
      });
      std::vector<Key> keys(n);
      std::vector<Value> values(n);
      for (size_t i = 0; i < n; ++i) {
        keys[i] = d_keys_in[order[i]];
        values[i] = d_values_in[order[i]];
      }
      std::copy(keys.begin(), keys.end(), d_keys_out);
      std::copy(values.begin(), values.end(), d_values_out);
    });
    return cudaSuccess;
  }
};

}  // namespace cub
