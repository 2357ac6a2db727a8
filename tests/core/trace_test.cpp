// core/trace.h: the tracer's spans (depth per track, host clock or device marks, what take()
// returns) and the time split's rules, on spans made by hand, and on random spans against a
// brute-force reading of the same rules at many sample points.
#include "core/trace.h"

#include <gtest/gtest.h>

#include <random>
#include <thread>

namespace dstrain {
namespace {

TraceSpanRecord span(TraceTrack track, TraceKind kind, double begin, double end, int depth = 0,
                     bool host = false) {
  TraceSpanRecord s;
  s.track = track;
  s.kind = kind;
  s.begin = begin;
  s.end = end;
  s.depth = depth;
  s.host = host;
  return s;
}

void expect_sums(const TimeSplit& t) {
  EXPECT_NEAR(t.compute + t.optimizer + t.comm_exposed + t.bubble + t.other, t.step, 1e-12);
}

TEST(TimeSplit, CommunicationOnItsOwnStreamHidesBehindCompute) {
  const std::vector<TraceSpanRecord> spans{
      span(TraceTrack::Compute, TraceKind::Compute, 0, 10),
      span(TraceTrack::Communication, TraceKind::Communication, 5, 15)};
  const TimeSplit t = split_step_time(spans, 0, 20);
  EXPECT_DOUBLE_EQ(t.step, 20);
  EXPECT_DOUBLE_EQ(t.compute, 10);
  EXPECT_DOUBLE_EQ(t.comm_exposed, 5);  // [10, 15): nothing computes
  EXPECT_DOUBLE_EQ(t.comm_total, 10);
  EXPECT_DOUBLE_EQ(t.other, 5);
  expect_sums(t);
}

TEST(TimeSplit, ACollectiveInsideALayerOnTheSameStreamIsExposed) {
  // A tensor-parallel all-reduce nested in a forward on the compute stream.
  const std::vector<TraceSpanRecord> spans{
      span(TraceTrack::Compute, TraceKind::Step, 0, 12, 0),
      span(TraceTrack::Compute, TraceKind::Compute, 1, 10, 1),
      span(TraceTrack::Compute, TraceKind::Communication, 3, 5, 2),
      span(TraceTrack::Compute, TraceKind::Optimizer, 10, 11, 1)};
  const TimeSplit t = split_step_time(spans, 0, 12);
  EXPECT_DOUBLE_EQ(t.compute, 7);
  EXPECT_DOUBLE_EQ(t.comm_exposed, 2);
  EXPECT_DOUBLE_EQ(t.optimizer, 1);
  EXPECT_DOUBLE_EQ(t.other, 2);  // the step span itself says nothing
  expect_sums(t);
}

TEST(TimeSplit, TheHostDoesOneThingAtATimeTheLastOpened) {
  // CPU backend: a gather inside an embedding's forward (another track, host clock) blocks it.
  const std::vector<TraceSpanRecord> spans{
      span(TraceTrack::Compute, TraceKind::Compute, 0, 10, 0, true),
      span(TraceTrack::Communication, TraceKind::Communication, 2, 4, 0, true),
      span(TraceTrack::Pipeline, TraceKind::Pipeline, 10, 13, 0, true),
      span(TraceTrack::HostOptimizer, TraceKind::Optimizer, 13, 14, 0, true)};
  const TimeSplit t = split_step_time(spans, 0, 15);
  EXPECT_DOUBLE_EQ(t.compute, 8);
  EXPECT_DOUBLE_EQ(t.comm_exposed, 2);
  EXPECT_DOUBLE_EQ(t.comm_total, 2);
  EXPECT_DOUBLE_EQ(t.bubble, 3);
  EXPECT_DOUBLE_EQ(t.optimizer, 1);
  EXPECT_DOUBLE_EQ(t.other, 1);
  expect_sums(t);
}

TEST(TimeSplit, SpansOutsideTheWindowAreCut) {
  const std::vector<TraceSpanRecord> spans{span(TraceTrack::Compute, TraceKind::Compute, -5, 5)};
  const TimeSplit t = split_step_time(spans, 0, 10);
  EXPECT_DOUBLE_EQ(t.compute, 5);
  EXPECT_DOUBLE_EQ(t.other, 5);
}

// The rules read directly at sample points (not through the cut list).
TimeSplit sampled(const std::vector<TraceSpanRecord>& spans, double end, int samples) {
  TimeSplit t;
  t.step = end;
  const double dt = end / samples;
  for (int i = 0; i < samples; ++i) {
    const double at = (i + 0.5) * dt;
    int best[5] = {-1, -1, -1, -1, -1};  // per track, and the host
    for (size_t k = 0; k < spans.size(); ++k) {
      const TraceSpanRecord& s = spans[k];
      if (s.kind == TraceKind::Step || at < s.begin || at >= s.end) continue;
      const int slot = s.host ? 4 : static_cast<int>(s.track);
      if (best[slot] < 0) {
        best[slot] = static_cast<int>(k);
        continue;
      }
      const TraceSpanRecord& b = spans[static_cast<size_t>(best[slot])];
      if (s.host ? s.begin >= b.begin : s.depth >= b.depth) best[slot] = static_cast<int>(k);
    }
    bool computes = false, optimizes = false, communicates = false, waits = false;
    for (int slot : best) {
      if (slot < 0) continue;
      const TraceKind kind = spans[static_cast<size_t>(slot)].kind;
      computes |= kind == TraceKind::Compute;
      optimizes |= kind == TraceKind::Optimizer;
      communicates |= kind == TraceKind::Communication;
      waits |= kind == TraceKind::Pipeline;
    }
    if (communicates) t.comm_total += dt;
    (computes ? t.compute : optimizes ? t.optimizer : communicates ? t.comm_exposed
                                                    : waits ? t.bubble : t.other) += dt;
  }
  return t;
}

TEST(TimeSplit, RandomSpansAgreeWithSamplingTheRules) {
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<TraceSpanRecord> spans;
    const int n = 2 + round % 7;
    for (int i = 0; i < n; ++i) {
      // Times on a grid of 1/8 so that samples at cell centres see every boundary exactly.
      const double a = static_cast<double>(rng() % 160) / 8, b = a + 1 + static_cast<double>(rng() % 40) / 8;
      spans.push_back(span(static_cast<TraceTrack>(rng() % 4), static_cast<TraceKind>(rng() % 5),
                           a, b, static_cast<int>(rng() % 3), rng() % 2 == 0));
    }
    const TimeSplit t = split_step_time(spans, 0, 20), s = sampled(spans, 20, 160);
    expect_sums(t);
    EXPECT_NEAR(t.compute, s.compute, 1e-9) << round;
    EXPECT_NEAR(t.optimizer, s.optimizer, 1e-9) << round;
    EXPECT_NEAR(t.comm_exposed, s.comm_exposed, 1e-9) << round;
    EXPECT_NEAR(t.comm_total, s.comm_total, 1e-9) << round;
    EXPECT_NEAR(t.bubble, s.bubble, 1e-9) << round;
    EXPECT_NEAR(t.other, s.other, 1e-9) << round;
  }
}

// Device marks: numbered in order, resolved to given times.
class FakeTimer : public DeviceTimer {
 public:
  void rebase() override { ++rebases; }
  int mark(void* stream) override {
    streams.push_back(stream);
    return static_cast<int>(streams.size()) - 1;
  }
  std::vector<double> resolve() override {
    std::vector<double> times;
    for (size_t i = 0; i < streams.size(); ++i) times.push_back(100.0 + static_cast<double>(i));
    streams.clear();
    return times;
  }
  std::vector<void*> streams;
  int rebases = 0;
};

TEST(Tracer, SpansNestPerTrackAndTakeTheirTimesFromTheirClock) {
  FakeTimer timer;
  Tracer tracer(Tracer::Clock::now(), &timer);
  int stream = 0;
  {
    const ScopedTracer scope(&tracer);
    EXPECT_EQ(current_tracer(), &tracer);
    tracer.rebase();
    const TraceSpan outer(TraceTrack::Compute, TraceKind::Compute, "forward layer", 3);
    {
      const TraceSpan inner(TraceTrack::Compute, TraceKind::Communication, "all_reduce", -1,
                            &stream, TraceArgs{64, -1, "tensor"});
      const TraceSpan other(TraceTrack::Communication, TraceKind::Communication, "all_gather");
    }
  }
  EXPECT_EQ(current_tracer(), nullptr);
  EXPECT_EQ(timer.rebases, 1);
  ASSERT_EQ(timer.streams.size(), 2u);  // the device span's begin and end
  const std::vector<TraceSpanRecord> spans = tracer.take();
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].name, "forward layer 3");
  EXPECT_EQ(spans[0].depth, 0);
  EXPECT_TRUE(spans[0].host);
  EXPECT_EQ(spans[1].name, "all_reduce");
  EXPECT_EQ(spans[1].depth, 1);
  EXPECT_FALSE(spans[1].host);
  EXPECT_EQ(spans[1].begin, 100.0);
  EXPECT_EQ(spans[1].end, 101.0);
  EXPECT_EQ(spans[1].args.bytes, 64);
  EXPECT_STREQ(spans[1].args.group, "tensor");
  EXPECT_EQ(spans[2].depth, 0) << "depth counts per track";
  EXPECT_LE(spans[0].begin, spans[2].begin);
  EXPECT_LE(spans[2].end, spans[0].end);
  EXPECT_TRUE(tracer.take().empty());
}

TEST(Tracer, OpenSpansAreDroppedAndAThreadWithoutATracerRecordsNothing) {
  Tracer tracer(Tracer::Clock::now());
  const int open = tracer.begin(TraceTrack::Compute, TraceKind::Compute, "open", nullptr, {});
  EXPECT_TRUE(tracer.take().empty());
  tracer.end(open, nullptr);  // taken meanwhile: ignored
  std::thread([] {
    const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "nobody");
    EXPECT_EQ(current_tracer(), nullptr);
  }).join();
  EXPECT_TRUE(tracer.take().empty());
}

TEST(Tracer, StreamsMapToTheirTracks) {
  Tracer tracer(Tracer::Clock::now());
  int comm = 0;
  tracer.set_stream_track(&comm, TraceTrack::Communication);
  tracer.set_stream_track(nullptr, TraceTrack::Pipeline);  // ignored: the CPU has no streams
  EXPECT_EQ(tracer.track_of(&comm, TraceTrack::Compute), TraceTrack::Communication);
  EXPECT_EQ(tracer.track_of(nullptr, TraceTrack::Compute), TraceTrack::Compute);
}

}  // namespace
}  // namespace dstrain
