// Fresh parameters (init_model_parameters, model/architecture.h), drawn on all cores: a 7B model
// is 7 billion normals, minutes on one core. Each tensor is cut into chunks whose streams are
// skipped ahead, so the values are those of one sequential loop over the tensor's stream, for
// any number of threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/rng.h"
#include "model/architecture.h"
#include "model/layout.h"
#include "model/parts.h"

namespace dstrain {

namespace {

constexpr int64_t kChunk = int64_t{1} << 16;  // values (or floats to zero) per task

// Zeroes n floats in parallel chunks.
void zero_floats(float* data, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    std::memset(data + begin, 0, static_cast<size_t>(std::min(n - begin, kChunk)) * sizeof(float));
  }
}

}  // namespace

void fill_normal(float* data, int64_t n, const Rng& rng, double stddev) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  bool redrawn = false;
#pragma omp parallel for schedule(dynamic) reduction(|| : redrawn)
  for (int64_t c = 0; c < chunks; ++c) {
    Rng chunk = rng;
    chunk.skip(2 * static_cast<uint64_t>(c * kChunk));  // two draws a value before the chunk
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      const double u1 = chunk.uniform();
      const double u2 = chunk.uniform();
      if (u1 <= 0.0) {  // normal() redraws it: the chunks after this one start one draw late
        redrawn = true;
        break;
      }
      data[i] = static_cast<float>(Rng::box_muller(u1, u2) * stddev);
    }
  }
  if (!redrawn) return;
  Rng sequential = rng;
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(sequential.normal() * stddev);
}

void init_model_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                           const std::vector<Tensor>& block_flats) {
  DSTRAIN_CHECK(static_cast<int>(block_flats.size()) == layout.num_blocks());
  for (int block = 0; block < layout.num_blocks(); ++block) {
    DSTRAIN_CHECK(block_flats[block].numel() == layout.block_numel(block));
    zero_floats(block_flats[block].f32(), block_flats[block].numel());
  }
  const double init_std = decoder_parts(config).init_std;
  const double residual_std = init_std / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, block_flats[spec.block]).f32();
    const int64_t n = spec.file_numel();  // padded vocabulary rows stay zero
    if (spec.init == ParamInit::Zero) continue;
    if (spec.init == ParamInit::One) {
      std::fill(data, data + n, 1.0f);
      continue;
    }
    const double stddev = spec.init == ParamInit::ResidualNormal ? residual_std : init_std;
    fill_normal(data, n, Rng(seed, hash_name(spec.name)), stddev);
  }
}

}  // namespace dstrain
