// The CUDA emulator's streams (emu_streams.cpp), for the emulated runtime (emu_cuda_api.cpp):
// queues of work per stream, run lazily, with CUDA's ordering rules.
//
// What "lazily" means: work queued on a stream runs only when something needs it -- the host
// waits for the stream, for an event recorded on it, or for a synchronous copy; or work of
// another stream that must come after it (an event wait, the legacy stream's implicit ordering)
// is itself run. Every schedule this produces is one a GPU could produce, and it is the latest
// one: a kernel reading memory another stream writes without an event between them, or the
// host reading a pinned buffer an asynchronous copy has not written yet, sees stale data, and
// the tests that compare results catch it.
//
// Ordering rules kept (CUDA's): work of one stream runs in issue order; an event wait makes the
// waiting stream's later work follow what the event's record captured; the legacy default
// stream (nullptr) of a device waits for, and is waited for by, every *blocking* stream of that
// device (streams created without cudaStreamNonBlocking). Work gated by a ready() predicate
// (an emulated NCCL collective) runs once ready() holds; while a host thread waits for such
// work, every stream's runnable work makes progress, as on a GPU, so peers can arrive.
// DSTRAIN_CUDA_EMU_STREAMS=eager runs work as soon as it is queued (for debugging the emulator).
//
// Time. The host runs the work one op at a time, but a GPU runs streams at once: events are
// stamped in model time, where an op starts once the host issued it, its stream's previous op
// ended and every op it waits for (events, the legacy stream's rule) ended, and lasts as long
// as the host took to run it. Work of two streams with no order between them overlaps in model
// time as it could on a GPU (with no contention for the SMs: a bound, not a prediction), so a
// trace timed with events (cudaEventElapsedTime) shows a program's overlap.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <functional>

namespace dstrain::emu {

// The calling thread's current device (emu_cuda_api.cpp).
int current_device();

// A stream handle: nullptr, cudaStreamLegacy and cudaStreamPerThread name the legacy stream
// of the calling thread's current device.
cudaStream_t create_stream(int device, bool blocking);
bool is_stream(cudaStream_t stream);  // false: a handle that is not (or no longer) a stream
// Runs the stream's remaining work, then forgets the handle. False: not a stream.
bool destroy_stream(cudaStream_t stream);

// A position in a stream: done once every op queued up to it has run.
struct StreamMark {
  const void* stream = nullptr;  // the engine's stream (not the user's handle)
  uint64_t seq = 0;
};

// Queues work (see emu_runtime.h's enqueue) and returns its position.
StreamMark enqueue_work(cudaStream_t stream, std::function<void()> work,
                        std::function<bool()> ready = {});
// Queues a wait: the stream's later work runs after `mark`.
void enqueue_wait(cudaStream_t stream, StreamMark mark);

// The model time at which the op now running on this thread started (event records stamp it).
std::chrono::steady_clock::time_point model_now();

// Host waits. synchronize_*: blocks until done. query_*: runs what can run without waiting and
// says whether it is done.
void synchronize_stream(cudaStream_t stream);
bool query_stream(cudaStream_t stream);
void synchronize_mark(StreamMark mark);
bool query_mark(StreamMark mark);
void synchronize_device(int device);

}  // namespace dstrain::emu
