// Pipeline parallelism on CPU ranks against the cost model: the measured step time and bubble of
// pp 2 and 4 x {1F1B, GPipe}, next to predict_step_cost's prediction for the same Plan.
//
//   bench_pipeline [--layers L] [--n-embd C] [--heads H] [--vocab V] [--batch B] [--seq-len T]
//                  [--micro-batches M] [--steps N] [--warmup N] [--pp 2,4]
//                  [--schedules 1f1b,gpipe] [--log-dir DIR]
//
// Each case is a whole training run, train() as `dstrain` runs it: a GPT-2 written as a
// config.json (default 8 layers, n_embd 128, 4 heads, vocabulary 512, n_positions 128), fp32,
// the synthetic corpus, dp 1, micro-batches of B x T = 4 x 64 tokens, M = 8 of them per step,
// one CPU thread per rank (threads = pp: a stage stands for a GPU), no evaluation, no sample.
// The step time is the median over the timed steps (after the first --warmup) of the log's
// tokens per step / tokens_per_s; the measured bubble is the log's pipeline_bubble (the share of
// the step each stage waited in pipeline exchanges), the mean over the timed steps.
//
// The prediction: the same Plan on a reference machine of pp H100 SXM GPUs, every pair joined
// by 18 NVLinks, so the link terms are negligible (a stage's send of 128 KiB takes ~0.4 us), as
// the shared-memory copies between CPU ranks are. The cost model's compute is linear in the
// GPU's FLOP rate, and its GEMM efficiency depends only on the micro-batch shape, the same in
// every case here: one ratio, measured pp 1 / predicted pp 1, turns its seconds into this CPU's.
// The predicted bubble, bubble_seconds / step_seconds, needs no calibration.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_main.h"
#include "benchmarks/bench_runs.h"
#include "core/check.h"
#include "model/config.h"
#include "parallel/cost_model.h"
#include "parallel/memory_model.h"
#include "parallel/model_flops.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_split.h"
#include "parallel/plan.h"
#include "topology/gpu_table.h"
#include "topology/topology.h"
#include "train/options.h"
#include "train/trainer.h"

using namespace dstrain;
using namespace dstrain::bench;

namespace {

constexpr const char* kUsage =
    "usage: bench_pipeline [--layers L] [--n-embd C] [--heads H] [--vocab V] [--batch B] "
    "[--seq-len T] [--micro-batches M] [--steps N] [--warmup N] [--pp 2,4] "
    "[--schedules 1f1b,gpipe] [--log-dir DIR]";

constexpr const char* kHelp =
    "Measures pipeline parallelism on CPU ranks (one thread per stage) and prints it next to\n"
    "the cost model's prediction (parallel/cost_model.h) for the same plan.\n"
    "\n"
    "  --layers L          transformer layers (default 8; at least the largest --pp)\n"
    "  --n-embd C          width (default 128)\n"
    "  --heads H           attention heads (default 4; must divide C)\n"
    "  --vocab V           vocabulary (default 512)\n"
    "  --batch B           sequences per micro-batch (default 4)\n"
    "  --seq-len T         tokens per sequence (default 64; n_positions is max(128, T))\n"
    "  --micro-batches M   micro-batches per step (default 8)\n"
    "  --steps N           steps per run (default 8), the first --warmup untimed\n"
    "  --warmup N          untimed steps (default 2)\n"
    "  --pp LIST           pipeline depths after the pp 1 calibration (default 2,4)\n"
    "  --schedules LIST    1f1b and/or gpipe (default 1f1b,gpipe)\n"
    "  --log-dir DIR       keep each run's JSONL log and the config there (default: a temp\n"
    "                      directory, removed at the end)\n";

struct Options : RunShape {
  Options() {
    layers = 8;
    n_embd = 128;
    heads = 4;
    micro_batches = 8;
  }
  std::vector<int> pps = {2, 4};
  std::vector<std::string> schedules = {"1f1b", "gpipe"};
};

// --pp and --schedules; false for another flag.
template <class Value>
bool parse_pipeline_flag(Options& o, const std::string& arg, Value&& value) {
  if (arg == "--pp") {
    o.pps.clear();
    for (const std::string& item : split_list(value())) {
      o.pps.push_back(static_cast<int>(parse_int(arg, item, 2)));
    }
    DSTRAIN_USER_CHECK(!o.pps.empty()) << "--pp needs at least one depth, as 2,4";
  } else if (arg == "--schedules") {
    o.schedules = split_list(value());
    DSTRAIN_USER_CHECK(!o.schedules.empty()) << "--schedules needs 1f1b and/or gpipe";
    for (const std::string& s : o.schedules) {
      (void)parse_pipeline_schedule(s);  // a UserError naming the choices
    }
  } else {
    return false;
  }
  return true;
}

Options parse_options(int argc, char** argv) {
  const Options o = parse_run_flags(argc, argv, kUsage, Options{},
                                    [](Options& o, const std::string& arg, auto&& value) {
                                      return parse_pipeline_flag(o, arg, value);
                                    });
  if (o.help) return o;
  for (int pp : o.pps) {
    DSTRAIN_USER_CHECK(pp <= o.layers)
        << "--pp " << pp << " needs at least " << pp << " layers; --layers is " << o.layers;
  }
  return o;
}

std::string write_model_config(const Options& o, const fs::path& dir) {
  return bench::write_gpt2_config(dir, o.layers, o.n_embd, o.heads, o.vocab, o.seq_len);
}

Plan plan_of(const Options& o, int pp, const std::string& schedule) {
  Plan plan;
  plan.dp = 1;
  plan.pp = pp;
  plan.micro_batch = o.batch;
  plan.grad_accum = o.micro_batches;
  plan.seq_len = o.seq_len;
  plan.param_dtype = DType::F32;
  plan.pp_schedule = parse_pipeline_schedule(schedule);
  return plan;
}

struct StageMeasure {
  int64_t first_layer = 0, end_layer = 0;
  double compute_s = 0, wait_s = 0;  // per step, the summary's (every step of the run)
};

struct Case {
  int pp = 1;
  std::string schedule;  // "" for pp 1
  std::vector<int64_t> split;
  // Measured.
  double step_s = 0;
  std::vector<double> bubble;  // per stage, mean over the timed steps
  std::vector<StageMeasure> stages;
  // Predicted (seconds on the reference machine, before calibration).
  StepCost cost;
  std::string error;  // non-empty: the run failed
};

// Runs the case's training run and reads its log.
void measure(const Options& o, const std::string& model, const fs::path& dir, Case& c) {
  const std::string name = "pp" + std::to_string(c.pp) + (c.pp > 1 ? "_" + c.schedule : "");
  TrainOptions t = timed_run_options(o, model, c.pp, dir / (name + ".jsonl"));
  t.pp = c.pp;
  if (c.pp > 1) t.pp_schedule = c.schedule;
  t.pp_split = "";  // the balanced split, which the prediction uses too (checked below)
  const TimedSteps steps = train_timed(o, t);
  c.step_s = median(steps.seconds);
  if (c.pp == 1) return;
  std::vector<std::vector<double>> bubbles(static_cast<size_t>(c.pp));
  for (const nlohmann::json& record : steps.records) {
    const std::vector<double> bubble = record.at("pipeline_bubble").get<std::vector<double>>();
    DSTRAIN_CHECK(bubble.size() == static_cast<size_t>(c.pp)) << record.dump();
    for (size_t s = 0; s < bubble.size(); ++s) bubbles[s].push_back(bubble[s]);
  }
  for (const std::vector<double>& b : bubbles) c.bubble.push_back(mean(b));
  const nlohmann::json& summary = steps.summary;
  DSTRAIN_CHECK(summary.contains("stages")) << "no per-stage summary in " << t.log;
  for (const nlohmann::json& stage : summary["stages"]) {
    StageMeasure m;
    m.first_layer = stage["layers"][0];
    m.end_layer = stage["layers"][1];
    m.compute_s = stage["compute_s_per_step"];
    m.wait_s = stage["wait_s_per_step"];
    c.stages.push_back(m);
  }
  // What ran is what was predicted: the trainer's split is the plan's balanced one.
  std::vector<int64_t> ran;
  for (const StageMeasure& m : c.stages) ran.push_back(m.end_layer - m.first_layer);
  DSTRAIN_CHECK(ran == c.split) << "the trainer ran the split " << pipeline_split_text(ran)
                                << ", the prediction used " << pipeline_split_text(c.split);
}

std::string plan_name(const Case& c) {
  return c.pp == 1 ? "pp 1" : "pp " + std::to_string(c.pp) + " " + c.schedule;
}

int run(const Options& o) {
  WorkDir dir(o.log_dir, "bench_pipeline");
  const std::string model = write_model_config(o, dir.path());
  const ModelConfig config = load_model_config(model);
  const MemoryModel memory(config);

  std::vector<Case> cases(1);
  for (int pp : o.pps) {
    for (const std::string& schedule : o.schedules) {
      Case c;
      c.pp = pp;
      c.schedule = schedule;
      cases.push_back(c);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  std::printf(
      "bench_pipeline: GPT-2 L=%lld C=%lld H=%lld V=%lld (%.2fM params), fp32, dp 1, %lld "
      "micro-batches of %lld x %lld tokens per step, %d steps (%d untimed), CPU ranks with one "
      "thread each, %u cores\n",
      (long long)o.layers, (long long)o.n_embd, (long long)o.heads, (long long)o.vocab,
      double(config.num_parameters()) / 1e6, (long long)o.micro_batches, (long long)o.batch,
      (long long)o.seq_len, o.steps, o.warmup, std::thread::hardware_concurrency());
  std::fflush(stdout);
  for (Case& c : cases) {
    const Plan plan = plan_of(o, c.pp, c.pp > 1 ? c.schedule : "1f1b");
    c.split = pipeline_split(config, plan);
    c.cost = predict_step_cost(memory, reference_machine(c.pp, "bench_pipeline"), plan);
    try {
      measure(o, model, dir.path(), c);
    } catch (const std::exception& e) {
      c.error = e.what();
    }
  }
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const Case& calibration = cases[0];
  const bool calibrated = calibration.error.empty();
  // Seconds of the reference GPU -> seconds of one CPU rank.
  const double scale = calibrated ? calibration.step_s / calibration.cost.step_seconds : 0;
  std::printf(
      "\n| plan | split | measured s/step | predicted s/step | measured bubble: mean (per stage) "
      "| predicted bubble | ideal (pp-1)/(m+pp-1) | measured / predicted step |\n");
  std::printf("|---|---|---:|---:|---|---:|---:|---:|\n");
  bool failed = false;
  for (const Case& c : cases) {
    const double m = static_cast<double>(o.micro_batches);
    const double ideal = (c.pp - 1) / (m + c.pp - 1);
    const double predicted_bubble = c.cost.bubble_seconds / c.cost.step_seconds;
    const std::string predicted_s = calibrated ? fixed(c.cost.step_seconds * scale, 3) : "n/a";
    if (!c.error.empty()) {
      failed = true;
      std::printf("| %s | %s | failed: %s | %s | | %.3f | %.3f | |\n", plan_name(c).c_str(),
                  pipeline_split_text(c.split).c_str(), c.error.c_str(), predicted_s.c_str(),
                  predicted_bubble, ideal);
      continue;
    }
    const std::string bubble = c.pp == 1
                                   ? "0 (no exchanges)"
                                   : fixed(mean(c.bubble), 3) + " (" + list_text(c.bubble, 3) + ")";
    const std::string ratio = calibrated ? fixed(c.step_s / (c.cost.step_seconds * scale), 2) : "";
    std::printf("| %s | %s | %.3f | %s | %s | %.3f | %.3f | %s |\n", plan_name(c).c_str(),
                pipeline_split_text(c.split).c_str(), c.step_s, predicted_s.c_str(), bubble.c_str(),
                predicted_bubble, ideal, ratio.c_str());
  }

  // Per stage: the summary's compute and waiting, against the stage's share of the FLOPs.
  const ModelFlops flops = model_flops(config, o.seq_len);
  std::printf(
      "\n| plan | stage | layers | compute s/step | waiting s/step | idle: 1 - compute / step "
      "| compute share | FLOPs share |\n");
  std::printf("|---|---:|---|---:|---:|---:|---:|---:|\n");
  for (const Case& c : cases) {
    if (c.pp == 1 || !c.error.empty()) continue;
    double compute_total = 0, flops_total = 0;
    std::vector<double> stage_flops;
    for (size_t s = 0; s < c.stages.size(); ++s) {
      const StageMeasure& m = c.stages[s];
      compute_total += m.compute_s;
      const bool last = s + 1 == c.stages.size();
      stage_flops.push_back(static_cast<double>(m.end_layer - m.first_layer) * flops.layer_forward +
                            (last ? flops.head_forward : 0));
      flops_total += stage_flops.back();
    }
    for (size_t s = 0; s < c.stages.size(); ++s) {
      const StageMeasure& m = c.stages[s];
      std::printf("| %s | %zu | %lld-%lld | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
                  plan_name(c).c_str(), s, (long long)m.first_layer, (long long)m.end_layer - 1,
                  m.compute_s, m.wait_s, 1 - m.compute_s / c.step_s, m.compute_s / compute_total,
                  stage_flops[s] / flops_total);
    }
  }

  std::printf(
      "\nmeasured s/step: median over the timed steps of tokens per step / the log's tokens_per_s "
      "(rank 0's step). measured bubble: the log's pipeline_bubble, the share of the step each "
      "stage waited in pipeline exchanges, mean over the timed steps. predicted: "
      "predict_step_cost for the same Plan (the balanced split) on pp x %s, every pair joined "
      "by %d NVLinks (link terms negligible, like CPU ranks' shared-memory copies), its seconds "
      "scaled by measured pp 1 / predicted pp 1 = %.4g CPU-rank seconds per reference-GPU "
      "second; predicted bubble = bubble_seconds / step_seconds (the slowest stage's (pp-1) "
      "micro-batch times), no scaling. Per stage: the log's summary, per step over all %d steps "
      "(untimed ones included); idle: the share of the measured step the stage did not compute, "
      "its waits "
      "outside pipeline exchanges included (the last stage's drain is spent in the step's "
      "collectives, not in an exchange); FLOPs share: layers x (24 C^2 + 4 T C) + the head's 2 C "
      "Vp on the "
      "last stage.\n"
      "The CPU ranks share %u cores: with more stages than cores, stages that are busy at the same "
      "time compete for them, which the cost model (a GPU per stage) does not model.\n"
      "total %.1f s (%d runs)\n",
      kReferenceGpu, kReferenceNvlinks, scale, o.steps, std::thread::hardware_concurrency(),
      total_s, static_cast<int>(cases.size()));
  if (failed) std::fprintf(stderr, "bench_pipeline: a case failed; its row above says why\n");
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cases_main("bench_pipeline", argc, argv, kUsage, kHelp, parse_options, run);
}
