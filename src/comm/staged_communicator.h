// A communicator for device memory built on one that moves host memory only (the local one):
// "the local communicator on CUDA memory through copies". Each device tensor of a call is
// copied into a host staging buffer, the inner communicator runs on host memory, and what the
// call writes is copied back; host tensors pass through untouched. This is how several
// simulated ranks share one GPU in tests: the reductions are the local communicator's own
// (fixed rank order, fp32, one rounding), so they give the same bits as on the CPU backend.
//
// The copies go through a callback, so this layer needs no CUDA header: the trainer passes
// one that runs Backend::copy_bytes on the rank's stream and waits for it.
//
// - Every call finishes before it returns, like the local communicator (the device side is
//   copied back and the copy has completed).
// - In-place all_gather (input is output's own slice) stays in place on the staged copy.
// - Staging memory is plain host memory owned by the wrapper (grown to the largest call, kept
//   for reuse); it is a testing path, not counted by an Allocator.
// - Thread use as any Communicator: one thread, the rank's own.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "comm/communicator.h"

namespace dstrain {

// Copies `bytes` from src to dst, either side device or host memory, ordered on `stream`, and
// returns once dst holds them.
using CopyAndWait = std::function<void(void* dst, const void* src, size_t bytes, Stream stream)>;

// Wraps `inner` (which must outlive the result). Tensors whose device is not the CPU are
// staged; what the inner communicator requires of host tensors (sizes, dtypes, no overlap
// between ranks) it requires of the staged copies. split() returns a wrapper of the inner
// communicator's child (owning it), or nullptr for color < 0.
std::unique_ptr<Communicator> make_staged_communicator(Communicator& inner, CopyAndWait copy);

}  // namespace dstrain
