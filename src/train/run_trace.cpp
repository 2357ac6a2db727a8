#include "train/run_trace.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "comm/traced_communicator.h"
#include "core/fs.h"

namespace dstrain {

namespace {

int64_t parse_step(const std::string& text, const std::string& whole) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  DSTRAIN_USER_CHECK(!text.empty() && end == text.c_str() + text.size() && errno == 0 && value >= 1)
      << "--trace-steps takes A:B, the first and the last step to trace (1-based, e.g. 3:5), "
         "not '" << whole << "'";
  return value;
}

}  // namespace

TraceWindow parse_trace_steps(const std::string& text) {
  const size_t colon = text.find(':');
  TraceWindow window;
  window.first = parse_step(text.substr(0, colon), text);
  window.last = colon == std::string::npos ? window.first : parse_step(text.substr(colon + 1), text);
  DSTRAIN_USER_CHECK(window.first <= window.last)
      << "--trace-steps " << text << " ends before it begins";
  return window;
}

EventTimer::EventTimer(Backend& backend, Stream base, std::chrono::steady_clock::time_point origin)
    : backend_(backend), base_stream_(base), origin_(origin) {}

EventTimer::~EventTimer() {
  for (Event e : pool_) backend_.destroy_event(e);
}

Event EventTimer::event(size_t i) {
  while (pool_.size() <= i) pool_.push_back(backend_.create_timing_event());
  return pool_[i];
}

void EventTimer::rebase() {
  backend_.synchronize(base_stream_);
  Event base = event(0);
  backend_.record_event(base, base_stream_);
  backend_.synchronize_event(base);
  // The stream was idle: the event's time is (within a launch) the host's now.
  base_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
  used_ = 0;
}

int EventTimer::mark(void* stream) {
  Event e = event(used_ + 1);
  backend_.record_event(e, stream);
  return static_cast<int>(used_++);
}

std::vector<double> EventTimer::resolve() {
  std::vector<double> seconds(used_);
  for (size_t i = 0; i < used_; ++i) {
    Event e = pool_[i + 1];
    backend_.synchronize_event(e);
    seconds[i] = base_seconds_ + backend_.elapsed_seconds(pool_[0], e);
  }
  used_ = 0;
  return seconds;
}

void TraceCollector::add(int rank, const std::string& rank_label, int64_t step,
                         std::vector<TraceSpanRecord> spans) {
  std::lock_guard<std::mutex> lock(mutex_);
  parts_.push_back(RankSpans{rank, rank_label, step, std::move(spans)});
}

namespace {

nlohmann::json span_event(const TraceSpanRecord& s, int rank, int64_t step) {
  nlohmann::json args{{"step", step}};
  if (s.args.bytes >= 0) args["bytes"] = s.args.bytes;
  if (s.args.peer >= 0) args["peer"] = s.args.peer;
  if (s.args.group != nullptr) args["group"] = s.args.group;
  return {{"ph", "X"},
          {"name", s.name},
          {"cat", trace_kind_name(s.kind)},
          {"pid", rank},
          {"tid", static_cast<int>(s.track)},
          {"ts", s.begin * 1e6},
          {"dur", std::max(0.0, s.end - s.begin) * 1e6},
          {"args", args}};
}

nlohmann::json metadata(const char* what, int pid, int tid, nlohmann::json args) {
  nlohmann::json event{{"ph", "M"}, {"name", what}, {"pid", pid}, {"args", std::move(args)}};
  if (tid >= 0) event["tid"] = tid;
  return event;
}

}  // namespace

size_t TraceCollector::write() const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  std::vector<int> named;
  size_t spans = 0;
  for (const RankSpans& part : parts_) {
    if (std::find(named.begin(), named.end(), part.rank) == named.end()) {
      named.push_back(part.rank);
      events.push_back(metadata("process_name", part.rank, -1, {{"name", part.label}}));
      events.push_back(metadata("process_sort_index", part.rank, -1, {{"sort_index", part.rank}}));
      for (int t = 0; t < kNumTraceTracks; ++t) {
        events.push_back(metadata("thread_name", part.rank, t,
                                  {{"name", trace_track_name(static_cast<TraceTrack>(t))}}));
        events.push_back(metadata("thread_sort_index", part.rank, t, {{"sort_index", t}}));
      }
    }
    for (const TraceSpanRecord& s : part.spans) events.push_back(span_event(s, part.rank, part.step));
    spans += part.spans.size();
  }
  const nlohmann::json trace{
      {"traceEvents", events},
      {"displayTimeUnit", "ms"},
      {"otherData",
       {{"producer", "dstrain"},
        {"steps", std::to_string(window_.first) + ":" + std::to_string(window_.last)}}}};
  write_file_atomic(path_, trace.dump());
  return spans;
}

// The groups' communicators wrapped so that every collective is a span (each communicator once:
// groups may share one). Tensor-parallel collectives run inline on the compute stream, the
// pipeline's on its own, the rest on the model state's communication stream.
RankGroups traced_groups(RankGroups groups, std::vector<std::unique_ptr<Communicator>>& keep) {
  std::vector<std::pair<Communicator*, Communicator*>> wrapped;
  auto wrap = [&](Communicator*& comm, const char* name, TraceTrack track) {
    if (comm == nullptr) return;
    for (const auto& [inner, traced] : wrapped) {
      if (inner == comm) {
        comm = traced;
        return;
      }
    }
    keep.push_back(make_traced_communicator(*comm, name, track));
    wrapped.emplace_back(comm, keep.back().get());
    comm = keep.back().get();
  };
  wrap(groups.tensor, "tensor", TraceTrack::Compute);
  wrap(groups.pipe, "pipe", TraceTrack::Pipeline);
  wrap(groups.data, "data", TraceTrack::Communication);
  wrap(groups.tied, "tied", TraceTrack::Communication);
  // The experts' token exchange runs inline on the compute stream, like tp's collectives.
  wrap(groups.expert, "expert", TraceTrack::Compute);
  wrap(groups.expert_data, "expert_data", TraceTrack::Communication);
  wrap(groups.all, "world", TraceTrack::Communication);
  return groups;
}

std::unique_ptr<EventTimer> make_event_timer(const RankDevices& devices,
                                             std::chrono::steady_clock::time_point origin) {
  if (devices.backend->device().is_cpu()) return nullptr;  // every op done on return: the clock
  return std::make_unique<EventTimer>(*devices.backend, devices.compute.get(), origin);
}

nlohmann::json time_record(const TimeSplit& t) {
  return {{"step_s", t.step},           {"compute_s", t.compute}, {"optimizer_s", t.optimizer},
          {"comm_exposed_s", t.comm_exposed}, {"bubble_s", t.bubble},   {"other_s", t.other},
          {"comm_total_s", t.comm_total}};
}

void add_split(TimeSplit& sum, const TimeSplit& t) {
  sum.step += t.step;
  sum.compute += t.compute;
  sum.optimizer += t.optimizer;
  sum.comm_exposed += t.comm_exposed;
  sum.bubble += t.bubble;
  sum.other += t.other;
  sum.comm_total += t.comm_total;
}

TimeSplit scaled(TimeSplit t, double factor) {
  for (double* v : {&t.step, &t.compute, &t.optimizer, &t.comm_exposed, &t.bubble, &t.other,
                    &t.comm_total}) {
    *v *= factor;
  }
  return t;
}

// "compute 61%, optimizer 4%, exposed communication 20% (of 35% communicating), ..."
std::string time_split_line(const TimeSplit& t) {
  const double step = std::max(t.step, 1e-12);
  char line[240];
  std::snprintf(line, sizeof line,
                "%.3f s per step: compute %.0f%%, optimizer %.0f%%, exposed communication %.0f%% "
                "(communicating %.0f%%), pipeline bubble %.0f%%, other %.0f%%",
                t.step, 100 * t.compute / step, 100 * t.optimizer / step,
                100 * t.comm_exposed / step, 100 * t.comm_total / step, 100 * t.bubble / step,
                100 * t.other / step);
  return line;
}

}  // namespace dstrain
