// The timeline of one rank: spans (a name, a track, a begin and an end) recorded where the work
// is issued, timed with the host clock or -- for work queued on a device stream -- with marks
// on that stream (DeviceTimer: CUDA events on a GPU), resolved once the work has run.
//
// Recording is always on (the step's time split, split_step_time, comes from the same spans as
// the trace file): a rank's thread installs its Tracer with ScopedTracer, and code anywhere
// below opens a TraceSpan, which does nothing on a thread without a tracer.
//
// Tracks are the rank's streams of work: compute (the model's stream), communication (the
// model state's collectives and offload copies), pipeline (point-to-point transfers) and the
// host optimizer. Spans of one track nest (an inner span opens after and closes before its
// outer one, in the track's issue order): a tensor-parallel all-reduce inside a layer's forward.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dstrain {

enum class TraceTrack : uint8_t { Compute, Communication, Pipeline, HostOptimizer };
constexpr int kNumTraceTracks = 4;
const char* trace_track_name(TraceTrack track);  // "compute", "communication", ...

// What a span's time counts as in the time split.
enum class TraceKind : uint8_t { Compute, Communication, Pipeline, Optimizer, Step };
const char* trace_kind_name(TraceKind kind);  // "compute", "comm", "pipeline", "optimizer", "step"

// What a span says besides its name (absent: < 0 / nullptr).
struct TraceArgs {
  int64_t bytes = -1;          // a collective's or a copy's payload on this rank
  int peer = -1;               // a send's or receive's other rank (in its group)
  const char* group = nullptr; // the communicator's group: "data", "tensor", "pipe", ...
};

struct TraceSpanRecord {
  std::string name;
  TraceTrack track = TraceTrack::Compute;
  TraceKind kind = TraceKind::Compute;
  int depth = 0;            // spans of the same track open around it when it opened
  bool host = true;         // timed with the host clock (else with device marks)
  double begin = 0, end = 0;  // seconds since the tracer's origin
  TraceArgs args;
};

// Device time: marks queued on streams, resolved to seconds on the tracer's clock once the work
// before them has run.
class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  // Before a step's first mark, with the device idle: lines the device's clock up with the
  // host's (the tracer's origin, which the timer was made with).
  virtual void rebase() = 0;
  // A mark queued on `stream` now; its number (0, 1, ... since the last resolve).
  virtual int mark(void* stream) = 0;
  // Waits for every mark and returns their times in order (seconds on the tracer's clock).
  virtual std::vector<double> resolve() = 0;
};

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;
  // device: times spans whose stream is not null (nullptr: every span on the host clock).
  explicit Tracer(Clock::time_point origin, DeviceTimer* device = nullptr);

  double now() const;  // seconds since the origin
  // Lines up the device's clock (call at a step's start, between steps).
  void rebase();
  // Spans on `stream` (not null) go to `track`, whatever their code says: a collective runs on
  // the stream its caller gives (track_of).
  void set_stream_track(void* stream, TraceTrack track);
  TraceTrack track_of(void* stream, TraceTrack otherwise) const;
  // A span opened now on `stream` (nullptr: the host, timed with the clock); its handle.
  int begin(TraceTrack track, TraceKind kind, std::string name, void* stream, TraceArgs args);
  void end(int span, void* stream);
  // The spans since the last take(), with their times resolved; spans still open are dropped.
  std::vector<TraceSpanRecord> take();

 private:
  struct Open {
    TraceSpanRecord record;
    int begin_mark = -1, end_mark = -1;  // device marks (-1: clock times in record)
    bool closed = false;
  };
  Clock::time_point origin_;
  DeviceTimer* device_;
  std::vector<Open> spans_;
  std::vector<std::pair<void*, TraceTrack>> stream_tracks_;
  int open_depth_[kNumTraceTracks] = {};
};

// The calling thread's tracer (nullptr: none; spans do nothing).
Tracer* current_tracer();

// Installs `tracer` as the calling thread's for its lifetime.
class ScopedTracer {
 public:
  explicit ScopedTracer(Tracer* tracer);
  ~ScopedTracer();
  ScopedTracer(const ScopedTracer&) = delete;
  ScopedTracer& operator=(const ScopedTracer&) = delete;

 private:
  Tracer* previous_;
};

// A span of the current thread's tracer from construction to destruction. The name is built
// only when a tracer records it: `name` and, when index >= 0, " <index>".
class TraceSpan {
 public:
  TraceSpan(TraceTrack track, TraceKind kind, const char* name, int64_t index = -1,
            void* stream = nullptr, TraceArgs args = {});
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  int span_ = -1;
  void* stream_ = nullptr;
};

// Where a rank's time in [begin, end] went. At each moment the innermost open span of each
// track says what that track does -- except for spans timed on the host: the host does one
// thing at a time, the last of them opened (a synchronous collective inside a layer's forward on
// the CPU backend is communication, not compute). The moment counts as compute when some track computes,
// else optimizer, else communication (exposed: hidden behind no computation), else pipeline
// (waiting for or moving the neighbours' activations: the bubble), else other (the host: data,
// bookkeeping). The five sum to end - begin.
struct TimeSplit {
  double step = 0, compute = 0, optimizer = 0, comm_exposed = 0, bubble = 0, other = 0;
  double comm_total = 0;  // every moment some track communicates, hidden or not
};
TimeSplit split_step_time(const std::vector<TraceSpanRecord>& spans, double begin, double end);

}  // namespace dstrain
