#include "core/trace.h"

#include <algorithm>
#include <array>

#include "core/check.h"

namespace dstrain {

namespace {

thread_local Tracer* t_tracer = nullptr;

}  // namespace

const char* trace_track_name(TraceTrack track) {
  switch (track) {
    case TraceTrack::Compute: return "compute";
    case TraceTrack::Communication: return "communication";
    case TraceTrack::Pipeline: return "pipeline";
    case TraceTrack::HostOptimizer: return "host optimizer";
  }
  return "?";
}

const char* trace_kind_name(TraceKind kind) {
  switch (kind) {
    case TraceKind::Compute: return "compute";
    case TraceKind::Communication: return "comm";
    case TraceKind::Pipeline: return "pipeline";
    case TraceKind::Optimizer: return "optimizer";
    case TraceKind::Step: return "step";
  }
  return "?";
}

Tracer::Tracer(Clock::time_point origin, DeviceTimer* device) : origin_(origin), device_(device) {}

double Tracer::now() const { return std::chrono::duration<double>(Clock::now() - origin_).count(); }

void Tracer::rebase() {
  if (device_ != nullptr) device_->rebase();
}

void Tracer::set_stream_track(void* stream, TraceTrack track) {
  if (stream != nullptr) stream_tracks_.emplace_back(stream, track);
}

TraceTrack Tracer::track_of(void* stream, TraceTrack otherwise) const {
  for (const auto& [known, track] : stream_tracks_) {
    if (stream != nullptr && known == stream) return track;
  }
  return otherwise;
}

int Tracer::begin(TraceTrack track, TraceKind kind, std::string name, void* stream,
                  TraceArgs args) {
  Open open;
  open.record.name = std::move(name);
  open.record.track = track;
  open.record.kind = kind;
  open.record.args = args;
  open.record.depth = open_depth_[static_cast<int>(track)]++;
  if (stream != nullptr && device_ != nullptr) {
    open.record.host = false;
    open.begin_mark = device_->mark(stream);
  } else {
    open.record.begin = now();
  }
  spans_.push_back(std::move(open));
  return static_cast<int>(spans_.size()) - 1;
}

void Tracer::end(int span, void* stream) {
  if (span < 0 || span >= static_cast<int>(spans_.size())) return;  // taken meanwhile
  Open& open = spans_[static_cast<size_t>(span)];
  --open_depth_[static_cast<int>(open.record.track)];
  open.closed = true;
  if (open.begin_mark >= 0) {
    open.end_mark = device_->mark(stream);
  } else {
    open.record.end = now();
  }
}

std::vector<TraceSpanRecord> Tracer::take() {
  const std::vector<double> marks = device_ != nullptr ? device_->resolve() : std::vector<double>();
  std::vector<TraceSpanRecord> records;
  records.reserve(spans_.size());
  for (Open& open : spans_) {
    if (!open.closed) continue;
    if (open.begin_mark >= 0) {
      DSTRAIN_CHECK(open.end_mark < static_cast<int>(marks.size())) << "unresolved trace mark";
      open.record.begin = marks[static_cast<size_t>(open.begin_mark)];
      open.record.end = marks[static_cast<size_t>(open.end_mark)];
    }
    records.push_back(std::move(open.record));
  }
  spans_.clear();
  std::fill(std::begin(open_depth_), std::end(open_depth_), 0);
  return records;
}

Tracer* current_tracer() { return t_tracer; }

ScopedTracer::ScopedTracer(Tracer* tracer) : previous_(t_tracer) { t_tracer = tracer; }
ScopedTracer::~ScopedTracer() { t_tracer = previous_; }

TraceSpan::TraceSpan(TraceTrack track, TraceKind kind, const char* name, int64_t index,
                     void* stream, TraceArgs args)
    : tracer_(t_tracer), stream_(stream) {
  if (tracer_ == nullptr) return;
  std::string text = name;
  if (index >= 0) text += " " + std::to_string(index);
  span_ = tracer_->begin(track, kind, std::move(text), stream, args);
}

TraceSpan::~TraceSpan() {
  if (tracer_ != nullptr) tracer_->end(span_, stream_);
}

namespace {

// What the moment t is, by the innermost open span of each track (Step spans say nothing).
enum Busy { kIdle = 0, kPipeline, kComm, kOptimizer, kCompute };  // by precedence

Busy busy_of(TraceKind kind) {
  switch (kind) {
    case TraceKind::Compute: return kCompute;
    case TraceKind::Optimizer: return kOptimizer;
    case TraceKind::Communication: return kComm;
    case TraceKind::Pipeline: return kPipeline;
    case TraceKind::Step: return kIdle;
  }
  return kIdle;
}

// Slots: one per track for device-timed spans, the last for the host.
Busy busy_at(const std::vector<TraceSpanRecord>& spans, double t, bool& communicating) {
  constexpr int kHost = kNumTraceTracks;
  std::array<const TraceSpanRecord*, kNumTraceTracks + 1> innermost{};
  for (const TraceSpanRecord& s : spans) {
    if (s.kind == TraceKind::Step || !(s.begin <= t && t < s.end)) continue;
    const int slot = s.host ? kHost : static_cast<int>(s.track);
    const TraceSpanRecord* current = innermost[static_cast<size_t>(slot)];
    // The host: the last opened (spans are in the order they opened); a track: the deepest.
    if (current == nullptr || (s.host ? s.begin >= current->begin : s.depth >= current->depth)) {
      innermost[static_cast<size_t>(slot)] = &s;
    }
  }
  Busy busy = kIdle;
  communicating = false;
  for (const TraceSpanRecord* s : innermost) {
    if (s == nullptr) continue;
    busy = std::max(busy, busy_of(s->kind));
    communicating = communicating || s->kind == TraceKind::Communication;
  }
  return busy;
}

}  // namespace

TimeSplit split_step_time(const std::vector<TraceSpanRecord>& spans, double begin, double end) {
  TimeSplit split;
  split.step = std::max(0.0, end - begin);
  std::vector<double> cuts{begin, end};
  for (const TraceSpanRecord& s : spans) {
    for (double t : {s.begin, s.end}) {
      if (t > begin && t < end) cuts.push_back(t);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const double length = cuts[i + 1] - cuts[i];
    if (length <= 0) continue;
    bool communicating = false;
    const Busy busy = busy_at(spans, 0.5 * (cuts[i] + cuts[i + 1]), communicating);
    if (communicating) split.comm_total += length;
    switch (busy) {
      case kCompute: split.compute += length; break;
      case kOptimizer: split.optimizer += length; break;
      case kComm: split.comm_exposed += length; break;
      case kPipeline: split.bubble += length; break;
      case kIdle: split.other += length; break;
    }
  }
  return split;
}

}  // namespace dstrain
