// The CUDA emulator's stream engine (see emu_streams.h): one lock over every queue; work runs on
// whichever host thread needs it, with that lock held.
//
// Every op has a global sequence number, so an op can only depend on ops issued before it (an
// event wait captures a record already issued; the legacy stream's implicit ordering looks only
// at earlier work). Running an op first runs its dependencies -- earlier ops -- so the recursion
// ends, and no schedule it picks breaks CUDA's rules.
#include "kernels/cuda_emu/emu_streams.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/cuda_emu/emu_runtime.h"

namespace dstrain::emu {

namespace {

using Clock = std::chrono::steady_clock;
using Lock = std::unique_lock<std::mutex>;
constexpr uint64_t kEnd = std::numeric_limits<uint64_t>::max();
// How long a host wait may sit on gated work (an emulated collective whose peers never come)
// before it is reported instead of hanging the test.
constexpr double kHangSeconds = 300.0;

struct Stream;

// Every op of `stream` with a sequence number <= seq.
struct Dependency {
  Stream* stream = nullptr;
  uint64_t seq = 0;
};

struct Op {
  uint64_t seq = 0;
  Clock::time_point issued;     // when the host queued it
  std::function<void()> work;   // may be empty: a marker (an event record, a wait)
  std::function<bool()> ready;  // may be empty: always ready
  Dependency wait;              // cudaStreamWaitEvent
};

struct Stream {
  int device = 0;
  bool legacy = false;
  bool blocking = true;
  std::deque<Op> queue;
  // The model time (see emu_streams.h) at which its last op ended, and the ends of its last
  // ops by sequence number (what a later event wait looks up).
  Clock::time_point model_end{};
  std::deque<std::pair<uint64_t, Clock::time_point>> ends;
};
constexpr size_t kEndsKept = 4096;  // older ops ended long before anything that waits for them

thread_local Clock::time_point t_model_now{};

struct Engine {
  std::mutex mutex;
  std::condition_variable progress;
  uint64_t next_seq = 1;
  std::vector<std::unique_ptr<Stream>> all;  // kept to the end: marks may name a dead stream
  std::set<const Stream*> live;
  std::vector<Stream*> legacy;  // by device, created on first use
  const bool eager = [] {
    const char* mode = std::getenv("DSTRAIN_CUDA_EMU_STREAMS");
    return mode != nullptr && std::strcmp(mode, "eager") == 0;
  }();
};

Engine& engine() {
  static Engine* instance = new Engine;  // outlives static destructors that free memory
  return *instance;
}

bool is_default_handle(cudaStream_t handle) {
  return handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread;
}

Stream* legacy_stream(Engine& e, int device) {
  if (device >= static_cast<int>(e.legacy.size())) e.legacy.resize(device + 1, nullptr);
  if (e.legacy[device] == nullptr) {
    auto stream = std::make_unique<Stream>();
    stream->device = device;
    stream->legacy = true;
    e.legacy[device] = stream.get();
    e.live.insert(stream.get());
    e.all.push_back(std::move(stream));
  }
  return e.legacy[device];
}

Stream* resolve(Engine& e, cudaStream_t handle) {
  if (is_default_handle(handle)) return legacy_stream(e, current_device());
  auto* stream = reinterpret_cast<Stream*>(handle);
  DSTRAIN_CHECK(e.live.count(stream)) << "CUDA emulator: work queued on an invalid stream handle";
  return stream;
}

bool finished(const Dependency& d) {
  return d.stream == nullptr || d.stream->queue.empty() || d.stream->queue.front().seq > d.seq;
}

// The ops `op` of `stream` must follow besides its stream's earlier ones.
std::vector<Dependency> dependencies(Engine& e, const Stream& stream, const Op& op) {
  std::vector<Dependency> deps;
  if (op.wait.stream != nullptr) deps.push_back(op.wait);
  if (stream.legacy) {
    for (const Stream* other : e.live) {
      if (!other->legacy && other->blocking && other->device == stream.device)
        deps.push_back({const_cast<Stream*>(other), op.seq - 1});
    }
  } else if (stream.blocking && stream.device < static_cast<int>(e.legacy.size()) &&
             e.legacy[stream.device] != nullptr) {
    deps.push_back({e.legacy[stream.device], op.seq - 1});
  }
  return deps;
}

bool run_until(Engine& e, Stream* stream, uint64_t limit, bool block, Lock& lock);

// One host thread's wait on gated work: how long it has waited for which op.
struct GateWait {
  uint64_t seq = 0;
  Clock::time_point since;
};
thread_local GateWait t_gate_wait;

// Lets every stream run what it can (as a GPU would while the host waits), then sleeps until
// something changes.
void wait_for_progress(Engine& e, uint64_t seq, Lock& lock) {
  if (t_gate_wait.seq != seq) t_gate_wait = {seq, Clock::now()};
  for (size_t i = 0; i < e.all.size(); ++i) {
    Stream* stream = e.all[i].get();
    if (e.live.count(stream) || !stream->queue.empty()) run_until(e, stream, kEnd, false, lock);
  }
  const double waited = std::chrono::duration<double>(Clock::now() - t_gate_wait.since).count();
  DSTRAIN_CHECK(waited < kHangSeconds)
      << "CUDA emulator: stream work has waited " << waited
      << " s for a condition that never came (an emulated collective whose peers never "
         "joined?)";
  e.progress.wait_for(lock, std::chrono::milliseconds(20));
}

// When the op of `seq` on `stream` ended in model time (long ago when no longer kept).
Clock::time_point model_end_of(const Dependency& d) {
  if (d.stream == nullptr) return {};
  const auto& ends = d.stream->ends;
  auto after = std::upper_bound(ends.begin(), ends.end(), d.seq,
                                [](uint64_t seq, const auto& end) { return seq < end.first; });
  return after == ends.begin() ? Clock::time_point{} : std::prev(after)->second;
}

// Runs `work` as the op `seq` of `stream`, in model time: it starts once it was issued, its
// stream's previous op ended and every op it waits for ended, and lasts as long as it takes.
void run_in_model_time(Stream* stream, uint64_t seq, Clock::time_point issued,
                       const std::vector<Dependency>& deps, const std::function<void()>& work) {
  Clock::time_point start = std::max(issued, stream->model_end);
  for (const Dependency& d : deps) start = std::max(start, model_end_of(d));
  t_model_now = start;
  const Clock::time_point began = Clock::now();
  if (work) work();
  stream->model_end = start + (Clock::now() - began);
  stream->ends.emplace_back(seq, stream->model_end);
  if (stream->ends.size() > kEndsKept) stream->ends.pop_front();
}

// Tries to run the stream's first op. Returns false only when !block and it cannot run now;
// true when it ran, or when the queue changed while the lock was released (the caller looks
// again).
bool run_front(Engine& e, Stream* stream, bool block, Lock& lock) {
  const uint64_t seq = stream->queue.front().seq;
  const std::vector<Dependency> deps = dependencies(e, *stream, stream->queue.front());
  for (const Dependency& d : deps) {
    if (!run_until(e, d.stream, d.seq + 1, block, lock)) return false;
  }
  if (stream->queue.empty() || stream->queue.front().seq != seq) return true;
  for (const Dependency& d : deps) {
    if (!finished(d)) return true;
  }
  Op& op = stream->queue.front();
  if (op.ready && !op.ready()) {
    if (!block) return false;
    wait_for_progress(e, seq, lock);
    return true;
  }
  std::function<void()> work = std::move(op.work);
  const Clock::time_point issued = op.issued;
  stream->queue.pop_front();
  // Popped first: work that throws is not run again, and the queue stays consistent.
  e.progress.notify_all();
  run_in_model_time(stream, seq, issued, deps, work);
  return true;
}

// Runs the stream's ops with seq < limit (block: waiting for gated work; else stopping there).
bool run_until(Engine& e, Stream* stream, uint64_t limit, bool block, Lock& lock) {
  while (!stream->queue.empty() && stream->queue.front().seq < limit) {
    if (!run_front(e, stream, block, lock)) return false;
  }
  return true;
}

StreamMark push(Engine& e, Stream* stream, Op op, Lock& lock) {
  op.seq = e.next_seq++;
  op.issued = Clock::now();
  const uint64_t seq = op.seq;
  stream->queue.push_back(std::move(op));
  e.progress.notify_all();
  if (e.eager) run_until(e, stream, kEnd, false, lock);
  return {stream, seq};
}

}  // namespace

void enqueue(cudaStream_t stream, std::function<void()> work, std::function<bool()> ready) {
  enqueue_work(stream, std::move(work), std::move(ready));
}

void notify_progress() { engine().progress.notify_all(); }

std::chrono::steady_clock::time_point model_now() { return t_model_now; }

cudaStream_t create_stream(int device, bool blocking) {
  Engine& e = engine();
  Lock lock(e.mutex);
  auto stream = std::make_unique<Stream>();
  stream->device = device;
  stream->blocking = blocking;
  Stream* raw = stream.get();
  e.all.push_back(std::move(stream));
  e.live.insert(raw);
  return reinterpret_cast<cudaStream_t>(raw);
}

bool is_stream(cudaStream_t handle) {
  if (is_default_handle(handle)) return true;
  Engine& e = engine();
  Lock lock(e.mutex);
  return e.live.count(reinterpret_cast<const Stream*>(handle)) > 0;
}

bool destroy_stream(cudaStream_t handle) {
  if (is_default_handle(handle)) return false;
  Engine& e = engine();
  Lock lock(e.mutex);
  auto* stream = reinterpret_cast<Stream*>(handle);
  if (!e.live.count(stream)) return false;
  // CUDA lets the queued work finish after the call; running it now is one such schedule.
  run_until(e, stream, kEnd, true, lock);
  e.live.erase(stream);
  return true;
}

StreamMark enqueue_work(cudaStream_t handle, std::function<void()> work,
                        std::function<bool()> ready) {
  Engine& e = engine();
  Lock lock(e.mutex);
  Op op;
  op.work = std::move(work);
  op.ready = std::move(ready);
  return push(e, resolve(e, handle), std::move(op), lock);
}

void enqueue_wait(cudaStream_t handle, StreamMark mark) {
  Engine& e = engine();
  Lock lock(e.mutex);
  Op op;
  op.wait = {static_cast<Stream*>(const_cast<void*>(mark.stream)), mark.seq};
  push(e, resolve(e, handle), std::move(op), lock);
}

HostCounters& this_thread_counters() {
  thread_local HostCounters counters;
  return counters;
}

void synchronize_stream(cudaStream_t handle) {
  ++this_thread_counters().host_waits;
  Engine& e = engine();
  Lock lock(e.mutex);
  run_until(e, resolve(e, handle), kEnd, true, lock);
}

bool query_stream(cudaStream_t handle) {
  Engine& e = engine();
  Lock lock(e.mutex);
  return run_until(e, resolve(e, handle), kEnd, false, lock);
}

void synchronize_mark(StreamMark mark) {
  if (mark.stream == nullptr) return;
  ++this_thread_counters().host_waits;
  Engine& e = engine();
  Lock lock(e.mutex);
  run_until(e, static_cast<Stream*>(const_cast<void*>(mark.stream)), mark.seq + 1, true, lock);
}

bool query_mark(StreamMark mark) {
  if (mark.stream == nullptr) return true;
  Engine& e = engine();
  Lock lock(e.mutex);
  return run_until(e, static_cast<Stream*>(const_cast<void*>(mark.stream)), mark.seq + 1, false,
                   lock);
}

void synchronize_device(int device) {
  ++this_thread_counters().host_waits;
  Engine& e = engine();
  Lock lock(e.mutex);
  // Up to the last op issued now: work queued meanwhile by other threads is not waited for.
  const uint64_t limit = e.next_seq;
  for (size_t i = 0; i < e.all.size(); ++i) {
    Stream* stream = e.all[i].get();
    if (stream->device == device) run_until(e, stream, limit, true, lock);
  }
}

}  // namespace dstrain::emu
