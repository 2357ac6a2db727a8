// The run's timeline (--trace FILE, --trace-steps A:B): each rank's spans of the steps in the
// window (core/trace.h), written by rank 0 as one Chrome trace (the JSON object format with
// "X" complete events, which Perfetto and chrome://tracing open): one process per rank, one
// thread per track (compute, communication, pipeline, host optimizer), times in microseconds
// since the run began.
//
// Ranks are threads of this process (single node): they hand their spans to one collector.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/trace.h"
#include "kernels/ops.h"
#include "parallel/groups.h"
#include "train/devices.h"

namespace dstrain {

// --trace-steps "A:B" (1-based, inclusive) or "A" (one step). Throws UserError on anything else
// or A > B, A < 1.
struct TraceWindow {
  int64_t first = 3, last = 5;
  bool contains(int64_t step) const { return step >= first && step <= last; }  // 1-based
};
TraceWindow parse_trace_steps(const std::string& text);

// Device time through the backend's timing events (CUDA events on a GPU). Events are kept in a
// pool and reused step after step.
class EventTimer : public DeviceTimer {
 public:
  // base: the stream that is idle at each rebase (the rank's compute stream).
  EventTimer(Backend& backend, Stream base, std::chrono::steady_clock::time_point origin);
  ~EventTimer() override;
  void rebase() override;
  int mark(void* stream) override;
  std::vector<double> resolve() override;

 private:
  Event event(size_t i);
  Backend& backend_;
  Stream base_stream_;
  std::chrono::steady_clock::time_point origin_;
  std::vector<Event> pool_;  // [0] the base
  size_t used_ = 0;          // marks since the last resolve
  double base_seconds_ = 0;  // the base event's time on the host clock
};

class TraceCollector {
 public:
  TraceCollector(std::string path, TraceWindow window) : path_(std::move(path)), window_(window) {}
  const std::string& path() const { return path_; }
  const TraceWindow& window() const { return window_; }
  // Rank `rank`'s spans of 1-based step `step`. Thread-safe.
  void add(int rank, const std::string& rank_label, int64_t step,
           std::vector<TraceSpanRecord> spans);
  // Writes the file (whole or not at all: a temporary file renamed). Returns the spans written.
  size_t write() const;

 private:
  struct RankSpans {
    int rank = 0;
    std::string label;
    int64_t step = 0;
    std::vector<TraceSpanRecord> spans;
  };
  std::string path_;
  TraceWindow window_;
  mutable std::mutex mutex_;
  std::vector<RankSpans> parts_;
};

// The groups' communicators wrapped so that every collective is a span (comm/traced_communicator.h),
// each once (groups may share one); `keep` owns the wrappers.
RankGroups traced_groups(RankGroups groups, std::vector<std::unique_ptr<Communicator>>& keep);
// The rank's device timer: nullptr on the CPU backend (its ops are done on return: the clock).
std::unique_ptr<EventTimer> make_event_timer(const RankDevices& devices,
                                             std::chrono::steady_clock::time_point origin);

// The time split as the log writes it: {"step_s", "compute_s", ...}.
nlohmann::json time_record(const TimeSplit& t);
void add_split(TimeSplit& sum, const TimeSplit& t);
TimeSplit scaled(TimeSplit t, double factor);
// "0.050 s per step: compute 48%, optimizer 1%, exposed communication 1% (communicating 1%), ..."
std::string time_split_line(const TimeSplit& t);

}  // namespace dstrain
