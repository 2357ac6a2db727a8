// What the decoder's source files share (model/decoder.cpp, model/decoder_buffers.cpp):
// internal to them.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace dstrain::decoder_internal {

// The layers' workspace, in LayerRun::workspace order: every entry always declared (with no
// rows where unused: the gradients without backward, the sequence-parallel buffers unless tp > 1
// with sequence parallelism) so that the indices stay fixed; the rotary table last, with a
// rotary position part only. Then the MoE part's buffers and latent attention's
// (Decoder::LayerWorkspace).
enum LayerWork : int { kScratch, kDnorm, kDqkv, kDup, kDact, kStreamPart, kGathered, kRopeFreqs };

// tensors[index], or an empty tensor for index -1 (a tensor the parts do not have).
inline Tensor optional(const std::vector<Tensor>& tensors, int index) {
  return index >= 0 ? tensors[static_cast<size_t>(index)] : Tensor();
}

}  // namespace dstrain::decoder_internal
