// --trace: the Chrome trace file of a window of steps, and the time split of every step record.
// Runs the small model (tests/train/small_model.h, 4 heads here so that tp 2 splits it) under
// plans that exercise every kind of span: ZeRO-3 collectives, pipeline sends and receives,
// offload copies and the host optimizer, tensor-parallel collectives inside the layers,
// recomputation. The file is parsed back; spans of a track must nest, every computation must lie
// in its step, the collectives must say their bytes. On the emulated GPU (NCCL between two
// emulated GPUs, spans timed with CUDA events) the ZeRO-3 gathers run on their own stream and
// overlap the layers' computation: the trace shows it and the time split counts it as hidden.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/temp_dir.h"
#include "tests/train/expect_user_error.h"
#include "tests/train/small_model.h"
#include "parallel/cost_model.h"
#include "topology/probe.h"
#include "train/devices.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

struct Span {
  std::string name, cat, group;
  int rank = 0, track = 0, step = 0, peer = -1;
  double ts = 0, dur = 0;
  long long bytes = -1;
  double end() const { return ts + dur; }
  bool inside(const Span& outer) const { return ts >= outer.ts && end() <= outer.end(); }
  bool overlaps(const Span& other) const { return ts < other.end() && other.ts < end(); }
};

constexpr int kCompute = 0, kCommunication = 1, kPipeline = 2, kHostOptimizer = 3;

std::vector<Span> read_trace(const std::string& path) {
  std::ifstream file(path);
  EXPECT_TRUE(file) << path;
  const nlohmann::json trace = nlohmann::json::parse(file);
  std::vector<Span> spans;
  std::set<std::pair<int, int>> named_threads;
  for (const nlohmann::json& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M") {
      if (e.at("name") == "thread_name") {
        named_threads.insert({e.at("pid").get<int>(), e.at("tid").get<int>()});
      }
      continue;
    }
    EXPECT_EQ(e.at("ph"), "X");
    Span s;
    s.name = e.at("name");
    s.cat = e.at("cat");
    s.rank = e.at("pid");
    s.track = e.at("tid");
    s.ts = e.at("ts");
    s.dur = e.at("dur");
    const nlohmann::json& args = e.at("args");
    s.step = args.at("step");
    s.bytes = args.value("bytes", -1LL);
    s.peer = args.value("peer", -1);
    s.group = args.value("group", "");
    EXPECT_GE(s.dur, 0.0) << s.name;
    EXPECT_TRUE(named_threads.count({s.rank, s.track})) << "track " << s.track << " has no name";
    spans.push_back(s);
  }
  return spans;
}

// Spans of one rank and track either nest or are disjoint (Chrome's rule for complete events;
// a tolerance of 1 ns for times rounded to microseconds in the file).
void expect_nested(const std::vector<Span>& spans) {
  constexpr double kSlack = 1e-3;
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size(); ++j) {
      const Span& a = spans[i];
      const Span& b = spans[j];
      if (a.rank != b.rank || a.track != b.track) continue;
      const bool disjoint = a.end() <= b.ts + kSlack || b.end() <= a.ts + kSlack;
      const bool nested = (a.ts >= b.ts - kSlack && a.end() <= b.end() + kSlack) ||
                          (b.ts >= a.ts - kSlack && b.end() <= a.end() + kSlack);
      EXPECT_TRUE(disjoint || nested) << "rank " << a.rank << " track " << a.track << ": '"
                                      << a.name << "' [" << a.ts << ", " << a.end() << ") and '"
                                      << b.name << "' [" << b.ts << ", " << b.end() << ") cross";
    }
  }
}

// Every span of a rank lies in that rank's step span of its step, on the host clock's CPU.
void expect_inside_steps(const std::vector<Span>& spans) {
  std::map<std::pair<int, int>, Span> steps;
  for (const Span& s : spans) {
    if (s.cat == "step") steps[{s.rank, s.step}] = s;
  }
  for (const Span& s : spans) {
    if (s.cat == "step") continue;
    const auto step = steps.find({s.rank, s.step});
    ASSERT_NE(step, steps.end()) << "rank " << s.rank << " has no span of step " << s.step;
    EXPECT_TRUE(s.inside(step->second)) << s.name << " of step " << s.step << " outside it";
  }
}

size_t count(const std::vector<Span>& spans, int track, const std::string& name_prefix) {
  return std::count_if(spans.begin(), spans.end(), [&](const Span& s) {
    return s.track == track && s.name.rfind(name_prefix, 0) == 0;
  });
}

// The steps' time records: the parts add up to the step; returns them.
std::vector<nlohmann::json> time_records(const std::string& log) {
  std::ifstream file(log);
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(file, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (!record.contains("loss")) continue;
    const nlohmann::json& t = record.at("time");
    const double parts = t.at("compute_s").get<double>() + t.at("optimizer_s").get<double>() +
                         t.at("comm_exposed_s").get<double>() + t.at("bubble_s").get<double>() +
                         t.at("other_s").get<double>();
    EXPECT_NEAR(parts, t.at("step_s").get<double>(), 1e-9 * t.at("step_s").get<double>() + 1e-12);
    EXPECT_GT(t.at("compute_s").get<double>(), 0.0);
    EXPECT_LE(t.at("comm_exposed_s").get<double>(), t.at("comm_total_s").get<double>() + 1e-12);
    records.push_back(t);
  }
  return records;
}

class TraceTest : public ::testing::Test {
 protected:
  TrainOptions options(const std::string& name, int ranks) {
    TrainOptions o = test::small_run_options(dir_.path(), name, ranks);
    o.model = test::write_small_model_config(dir_.path(), 2, 4);
    o.steps = 6;
    o.out.clear();
    o.threads = ranks;
    o.trace = (dir_.path() / (name + ".trace.json")).string();
    return o;
  }
  std::vector<Span> run(const TrainOptions& o) {
    std::ostringstream out;
    train(o, out);
    EXPECT_NE(out.str().find("wrote the trace of steps 3-5"), std::string::npos) << out.str();
    std::vector<Span> spans = read_trace(o.trace);
    std::set<std::pair<int, int>> rank_steps;
    for (const Span& s : spans) rank_steps.insert({s.rank, s.step});
    EXPECT_EQ(rank_steps.size(), static_cast<size_t>(3 * o.gpus)) << "every rank, steps 3-5";
    for (const auto& [rank, step] : rank_steps) {
      EXPECT_TRUE(step >= 3 && step <= 5) << step;
      EXPECT_LT(rank, o.gpus);
    }
    expect_nested(spans);
    return spans;
  }
  dstrain::testing::TempDir dir_;
};

TEST_F(TraceTest, ZeroThreeGathersAndScattersEveryLayerWithItsBytes) {
  TrainOptions o = options("zero3", 2);
  o.zero = 3;
  const std::vector<Span> spans = run(o);
  expect_inside_steps(spans);
  // 2 ranks x 3 steps x 4 micro-batches (8 over 2 ranks) x 2 layers.
  EXPECT_EQ(count(spans, kCompute, "forward layer"), 2u * 3 * 4 * 2);
  EXPECT_EQ(count(spans, kCompute, "backward layer"), 2u * 3 * 4 * 2);
  EXPECT_GT(count(spans, kCommunication, "all_gather"), 0u);
  EXPECT_GT(count(spans, kCommunication, "reduce_scatter"), 0u);
  EXPECT_EQ(count(spans, kCompute, "adamw"), 2u * 3) << "one multi-tensor AdamW a rank and step";
  for (const Span& s : spans) {
    if (s.track != kCommunication) continue;
    EXPECT_GT(s.bytes, 0) << s.name;
    EXPECT_FALSE(s.group.empty()) << s.name;
    if (s.name == "all_gather" && s.group == "data") {
      EXPECT_EQ(s.bytes % 2, 0) << "a gathered block is 2 equal fp32 shards";
    }
  }
  // On the CPU backend every collective blocks the rank: none hides behind computation.
  for (const nlohmann::json& t : time_records(o.log)) {
    EXPECT_GT(t.at("comm_total_s").get<double>(), 0.0);
    EXPECT_NEAR(t.at("comm_exposed_s").get<double>(), t.at("comm_total_s").get<double>(), 1e-9);
  }
}

TEST_F(TraceTest, PipelineTransfersOnThePipelineTrackWithPeerAndBytes) {
  TrainOptions o = options("pp2", 2);
  o.pp = 2;
  o.grad_accum = 4;
  const std::vector<Span> spans = run(o);
  expect_inside_steps(spans);
  size_t transfers = 0;
  for (const Span& s : spans) {
    if (s.track != kPipeline) continue;
    ++transfers;
    EXPECT_EQ(s.group, "pipe");
    EXPECT_EQ(s.cat, "pipeline");
    // One (B*T, C) fp32 activation or gradient each way: 2 x 16 x 24 x 4 bytes.
    EXPECT_EQ(s.bytes % (2 * 16 * 24 * 4), 0) << s.name;
    if (s.name == "send" || s.name == "recv") {
      EXPECT_EQ(s.peer, 1 - s.rank) << s.name;
    }
  }
  EXPECT_GE(transfers, 2u * 3 * 4);  // each rank sends and receives for every micro-batch
  EXPECT_EQ(count(spans, kCompute, "forward embedding"), 3u * 4);  // stage 0 only
  EXPECT_EQ(count(spans, kCompute, "head, loss and their backward"), 3u * 4);  // stage 1 only
  bool waited = false;
  for (const nlohmann::json& t : time_records(o.log)) waited |= t.at("bubble_s").get<double>() > 0;
  EXPECT_TRUE(waited) << "a pipeline of 2 stages waits";
}

TEST_F(TraceTest, OffloadCopiesAndTheHostOptimizerHaveTracksOfTheirOwn) {
  TrainOptions o = options("offload", 2);
  o.zero = 2;
  o.offload = true;
  const std::vector<Span> spans = run(o);
  expect_inside_steps(spans);
  EXPECT_GT(count(spans, kHostOptimizer, "host adamw block"), 0u);
  EXPECT_GT(count(spans, kCommunication, "offload gradients down"), 0u);
  EXPECT_GT(count(spans, kCommunication, "offload weights up"), 0u);
  EXPECT_EQ(count(spans, kCompute, "adamw"), 0u) << "the device takes no step";
  for (const nlohmann::json& t : time_records(o.log)) {
    EXPECT_GT(t.at("optimizer_s").get<double>(), 0.0);
  }
}

// Parameter offload at ZeRO-3 with the optimizer on the host: each rank's shard of every block
// comes up (then is gathered) for the forward and again for the backward, and each block's
// reduced gradient shard goes down once a micro-batch (its sum so far up first, but in the first
// micro-batch); the host takes the step, with nothing to copy.
TEST_F(TraceTest, ParameterOffloadBringsBlocksUpAndGradientsDown) {
  TrainOptions o = options("offload_params", 2);
  o.zero = 3;
  o.offload = o.offload_params = true;
  const std::vector<Span> spans = run(o);
  expect_inside_steps(spans);
  const size_t blocks = 4, layers = 2, micro_batches = 4;  // embedding, 2 layers, final norm
  for (int rank = 0; rank < 2; ++rank) {
    for (int step = 3; step <= 5; ++step) {
      size_t up = 0, down = 0, sums_up = 0;
      for (const Span& s : spans) {
        if (s.rank != rank || s.step != step || s.track != kCommunication) continue;
        if (s.name.rfind("offload", 0) == 0) {
          EXPECT_GT(s.bytes, 0) << s.name;
          EXPECT_EQ(s.group, "host") << s.name;
        }
        up += s.name.rfind("offload parameters up, block", 0) == 0;
        down += s.name.rfind("offload gradients down, block", 0) == 0;
        sums_up += s.name.rfind("offload gradients up, block", 0) == 0;
      }
      EXPECT_GE(up, 2 * layers * micro_batches) << "rank " << rank << " step " << step;
      EXPECT_EQ(down, blocks * micro_batches) << "rank " << rank << " step " << step;
      EXPECT_EQ(sums_up, blocks * (micro_batches - 1)) << "rank " << rank << " step " << step;
    }
  }
  EXPECT_GT(count(spans, kHostOptimizer, "host adamw block"), 0u);
  EXPECT_EQ(count(spans, kCompute, "adamw"), 0u) << "the device takes no step";
  EXPECT_EQ(count(spans, kCommunication, "offload weights up"), 0u) << "nothing to copy up";
}

TEST_F(TraceTest, TensorParallelCollectivesNestInTheirLayers) {
  TrainOptions o = options("tp2", 2);
  o.tp = 2;
  o.grad_accum = 8;
  o.recompute = "full";
  const std::vector<Span> spans = run(o);
  expect_inside_steps(spans);
  EXPECT_GT(count(spans, kCompute, "recompute layer"), 0u);
  // Each layer's forward, recompute and backward run the tp collectives of its matrices (the
  // sequence-parallel norms' gradients are summed later, in the optimizer's phase).
  std::map<std::string, size_t> in_layers;
  for (const Span& s : spans) {
    if (s.group != "tensor") continue;
    EXPECT_EQ(s.cat, "comm");
    EXPECT_EQ(s.track, kCompute) << "the CPU backend's collectives block the compute stream";
    for (const Span& l : spans) {
      if (l.rank == s.rank && l.track == kCompute && l.cat == "compute" && s.inside(l)) {
        ++in_layers[l.name.substr(0, l.name.find(" layer"))];
      }
    }
  }
  for (const char* phase : {"forward", "recompute", "backward"}) {
    EXPECT_GT(in_layers[phase], 0u) << "no tensor-parallel collective inside a layer's " << phase;
  }
}

TEST_F(TraceTest, TraceStepsOutsideTheRunOrMalformedAreRefused) {
  TrainOptions o = options("bad", 1);
  o.trace_steps = "7:9";
  test::expect_user_error(o, "--trace-steps 7:9 starts after the run's last step (--steps 6)");
  o.trace_steps = "4:2";
  test::expect_user_error(o, "ends before it begins");
  o.trace_steps = "x";
  test::expect_user_error(o, "--trace-steps takes A:B");
  EXPECT_FALSE(fs::exists(o.trace));
}

TEST_F(TraceTest, AnInterruptedWindowIsWrittenAtTheRunsEnd) {
  TrainOptions o = options("short", 1);
  o.steps = 4;
  o.trace_steps = "3:10";
  std::ostringstream out;
  train(o, out);
  EXPECT_NE(out.str().find("wrote the trace of steps 3-4"), std::string::npos) << out.str();
  std::set<int> steps;
  for (const Span& s : read_trace(o.trace)) steps.insert(s.step);
  EXPECT_EQ(steps, (std::set<int>{3, 4}));
}

// NCCL between two emulated GPUs (or real ones): ZeRO-3's prefetched gathers run on the model
// state's communication stream while the compute stream runs the previous layer.
// Parameter offload on a GPU: each block's copy up runs on the communication stream while the
// block before it computes (the emulator runs its streams concurrently, timed with CUDA events),
// so the trace shows copies inside layers' spans and the time split counts them as hidden.
TEST_F(TraceTest, OnAGpuTheParameterCopiesOverlapTheLayers) {
  if (usable_cuda_devices() < 1) GTEST_SKIP() << "needs a GPU (the emulator's)";
  TrainOptions o = options("gpu_offload_params", 1);
  o.device = "cuda";
  o.test.max_gpus = 1;
  o.offload = o.offload_params = true;
  const std::vector<Span> spans = run(o);
  size_t copies = 0, hidden = 0;
  for (const Span& c : spans) {
    if (c.track != kCommunication || c.name.rfind("offload parameters up, block", 0) != 0) continue;
    ++copies;
    hidden += std::any_of(spans.begin(), spans.end(), [&](const Span& l) {
      return l.track == kCompute && l.cat == "compute" &&
             (l.name.rfind("forward layer", 0) == 0 || l.name.rfind("backward layer", 0) == 0) &&
             c.overlaps(l);
    });
  }
  EXPECT_GT(copies, 0u);
  EXPECT_GT(hidden, 0u) << "no copy of " << copies << " overlaps a layer";
  double exposed = 0, total = 0;
  for (const nlohmann::json& t : time_records(o.log)) {
    exposed += t.at("comm_exposed_s").get<double>();
    total += t.at("comm_total_s").get<double>();
  }
  EXPECT_LT(exposed, total) << "some of the copies hide behind computation";
  std::cout << "  " << hidden << " of " << copies << " parameter copies overlap a layer; "
            << "communication " << total << " s, exposed " << exposed << " s (3 steps)\n";
}

TEST_F(TraceTest, OnGpusTheGathersOverlapTheLayers) {
  if (usable_cuda_devices() < 2 || !choose_devices("cuda", 2, 2).nccl) {
    GTEST_SKIP() << "needs 2 GPUs joined by NCCL (the emulator's: DSTRAIN_CUDA_EMU_DEVICES=2)";
  }
  TrainOptions o = options("gpu_zero3", 2);
  o.device = "cuda";
  o.test.max_gpus = 2;
  o.zero = 3;
  const std::vector<Span> spans = run(o);
  size_t hidden = 0;
  for (const Span& c : spans) {
    if (c.track != kCommunication || c.name != "all_gather") continue;
    hidden += std::any_of(spans.begin(), spans.end(), [&](const Span& l) {
      return l.rank == c.rank && l.track == kCompute && l.cat == "compute" &&
             l.name.rfind("forward layer", 0) == 0 && c.overlaps(l);
    });
  }
  EXPECT_GT(hidden, 0u) << "no gather overlaps a layer's forward";
  double exposed = 0, total = 0;
  for (const nlohmann::json& t : time_records(o.log)) {
    exposed += t.at("comm_exposed_s").get<double>();
    total += t.at("comm_total_s").get<double>();
  }
  EXPECT_LT(exposed, total) << "some communication hides behind computation";
  // MFU: PaLM's training FLOPs of the step's tokens over the step and the GPUs' peak at the
  // run's precision, as the planner knows it (the emulated GPU's is an estimate: the number
  // means nothing there, its arithmetic is what is checked).
  std::string report;
  const double peak = gpu_speed(probe_local_topology(&report), DType::F32).peak_flops;
  const double C = 24, L = 2, T = o.seq_len, Vp = 64;  // vocab 37 padded to 64
  const double flops_per_token = 6 * (12 * L * C * C + C * Vp) + 12 * L * T * C;
  const double tokens = static_cast<double>(o.batch * o.seq_len * test::kSmallRunMicroBatches);
  std::ifstream log(o.log);
  size_t steps = 0;
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (!record.contains("loss")) continue;
    ++steps;
    const double step_s = record.at("time").at("step_s").get<double>();
    ASSERT_TRUE(record.contains("mfu")) << line;
    EXPECT_NEAR(record.at("mfu").get<double>(), flops_per_token * tokens / (step_s * 2 * peak),
                1e-9 * record.at("mfu").get<double>());
  }
  EXPECT_EQ(steps, 6u);
}

}  // namespace
}  // namespace dstrain
