// A communicator whose every call is a span of the calling thread's tracer (core/trace.h):
// "all_reduce" with its group and bytes on this rank, timed on the call's stream (device marks
// on a GPU, the clock on the CPU). The trainer wraps each of a rank's groups once; with no
// tracer installed the wrapper only forwards.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/trace.h"

namespace dstrain {

// Wraps `inner` (which must outlive the result). group: the group's name in the trace
// ("data", "tensor", ...; a string literal or one that outlives the result). track: where its
// spans go. split() returns an unwrapped child (owning it through the inner communicator).
std::unique_ptr<Communicator> make_traced_communicator(Communicator& inner, const char* group,
                                                       TraceTrack track);

}  // namespace dstrain
