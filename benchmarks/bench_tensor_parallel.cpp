// Tensor parallelism on CPU ranks against the cost model: the measured step time and the
// tensor-parallel collectives (their number, volume and time) of tp 2 and 4, with and without
// sequence parallelism, next to predict_step_cost's prediction for the same Plan.
//
//   bench_tensor_parallel [--layers L] [--n-embd C] [--heads H] [--vocab V] [--batch B]
//                         [--seq-len T] [--micro-batches M] [--steps N] [--warmup N]
//                         [--tp 2,4] [--log-dir DIR]
//
// Each case is a whole training run, train() as `dstrain` runs it: a GPT-2 written as a
// config.json (default 4 layers, n_embd 256, 8 heads, vocabulary 512), fp32, the synthetic
// corpus, dp 1, pp 1, M = 4 micro-batches of B x T = 4 x 64 tokens per step, one CPU thread per
// rank (threads = tp: a rank stands for a GPU), no evaluation, no sample. The step time is the
// median over the timed steps (after the first --warmup) of the log's tokens per step /
// tokens_per_s; the tensor-parallel figures are the log's `tensor_parallel` record of each step
// (model/tensor_parallel.h, TensorParallelStats): the collectives a rank ran, their volume in
// all-reduce equivalents, and the share of the step its ranks spent in them (the mean).
//
// The prediction: the same Plan on tp H100 SXM GPUs joined by 18 NVLinks each (NVSwitch); the
// cost model's tensor-parallel term is tensor_parallel_traffic's count of collectives (each a
// fixed latency) and all-reduce volume (at the NVLink ring's rate). Counts and volume are exact
// statements about what runs, compared as they are; the time is calibrated as bench_pipeline
// does, by one ratio: measured tp 1 / predicted tp 1.
#include <chrono>
#include <cstdio>
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
    "usage: bench_tensor_parallel [--layers L] [--n-embd C] [--heads H] [--vocab V] "
    "[--batch B] [--seq-len T] [--micro-batches M] [--steps N] [--warmup N] [--tp 2,4] "
    "[--log-dir DIR]";

constexpr const char* kHelp =
    "Measures tensor parallelism on CPU ranks (one thread per rank), with and without sequence\n"
    "parallelism, and prints it next to the cost model's prediction (parallel/cost_model.h).\n"
    "\n"
    "  --layers L          transformer layers (default 4)\n"
    "  --n-embd C          width (default 256)\n"
    "  --heads H           attention heads (default 8; every --tp must divide it)\n"
    "  --vocab V           vocabulary (default 512)\n"
    "  --batch B           sequences per micro-batch (default 4)\n"
    "  --seq-len T         tokens per sequence (default 64; n_positions is max(128, T))\n"
    "  --micro-batches M   micro-batches per step (default 4)\n"
    "  --steps N           steps per run (default 8), the first --warmup untimed\n"
    "  --warmup N          untimed steps (default 2)\n"
    "  --tp LIST           tensor-parallel degrees after the tp 1 calibration (default 2,4)\n"
    "  --log-dir DIR       keep each run's JSONL log and the config there (default: a temp\n"
    "                      directory, removed at the end)\n";

struct Options : RunShape {
  std::vector<int> tps = {2, 4};
};

Options parse_options(int argc, char** argv) {
  Options defaults;  // RunShape's defaults are this benchmark's
  return parse_run_flags(
      argc, argv, kUsage, defaults, [](Options& o, const std::string& arg, auto&& value) {
        if (arg != "--tp") return false;
        o.tps.clear();
        for (const std::string& item : split_list(value())) {
          o.tps.push_back(static_cast<int>(parse_int(arg, item, 2)));
        }
        DSTRAIN_USER_CHECK(!o.tps.empty()) << "--tp needs at least one degree, as 2,4";
        return true;
      });
}

struct Case {
  int tp = 1;
  bool sequence_parallel = false;
  Plan plan;
  // Measured, per step (medians and means over the timed steps).
  double step_s = 0;
  double collectives = 0, bytes = 0, comm_share = 0;
  // Predicted: seconds on the reference machine (before calibration), and per step the
  // collectives and their all-reduce volume.
  StepCost cost;
  TensorParallelTraffic traffic;
  std::string error;  // non-empty: the run failed
};

Plan plan_of(const Options& o, int tp, bool sequence_parallel) {
  Plan plan;
  plan.tp = tp;
  plan.sequence_parallel = sequence_parallel;
  plan.micro_batch = o.batch;
  plan.grad_accum = o.micro_batches;
  plan.seq_len = o.seq_len;
  plan.param_dtype = DType::F32;
  return plan;
}

std::string case_name(const Case& c) {
  if (c.tp == 1) return "tp 1";
  return "tp " + std::to_string(c.tp) + (c.sequence_parallel ? " sp" : " no sp");
}

// Runs the case's training run and reads its log.
void measure(const Options& o, const std::string& model, const fs::path& dir, Case& c) {
  std::string name = case_name(c);
  std::replace(name.begin(), name.end(), ' ', '_');
  TrainOptions t = timed_run_options(o, model, c.tp, dir / (name + ".jsonl"));
  t.tp = c.tp;
  t.sequence_parallel = c.sequence_parallel;
  const TimedSteps steps = train_timed(o, t);
  c.step_s = median(steps.seconds);
  if (c.tp == 1) return;
  std::vector<double> collectives, bytes, shares;
  for (const nlohmann::json& record : steps.records) {
    const nlohmann::json& tp = record.at("tensor_parallel");
    collectives.push_back(tp["collectives"][0]);
    bytes.push_back(tp["all_reduce_bytes"][0]);
    shares.push_back(tp["comm_share"][0]);
  }
  c.collectives = median(collectives);
  c.bytes = median(bytes);
  c.comm_share = mean(shares);
}

std::vector<Case> make_cases(const Options& o, const ModelConfig& config) {
  const MemoryModel memory(config);
  std::vector<Case> cases;
  auto add = [&](int tp, bool sp) {
    Case c;
    c.tp = tp;
    c.sequence_parallel = sp;
    c.plan = plan_of(o, tp, sp);
    c.cost = predict_step_cost(memory, reference_machine(tp, "bench_tensor_parallel"), c.plan);
    const StageRange whole = stage_of_split({config.n_layer}, 0);
    const TensorParallelTraffic one = tensor_parallel_traffic(c.plan, whole);
    const double m = static_cast<double>(o.micro_batches);
    c.traffic = {one.all_reduces * m, one.collectives * m};
    cases.push_back(c);
  };
  add(1, false);
  for (int tp : o.tps) {
    add(tp, true);
    add(tp, false);
  }
  return cases;
}

void print_row(const Case& c, const Case& one, double scale, double activation_mb) {
  // Everything but the tensor-parallel collectives: the compute split over the ranks, and the
  // optimizer. Predicted: the reference machine's seconds, calibrated; and again with the GEMMs
  // at tp 1's efficiency (a GPU's narrower GEMMs fill fewer SMs; a CPU core's do not).
  const double predicted_rest = (c.cost.step_seconds - c.cost.tp_comm_seconds) * scale;
  const double same_efficiency =
      predicted_rest -
      c.cost.gemm_seconds * (1 - c.cost.efficiency / one.cost.efficiency) * scale;
  if (!c.error.empty()) {
    std::printf("| %s | failed: %s | | | %.3f | %.3f | | | | | |\n", case_name(c).c_str(),
                c.error.c_str(), predicted_rest, same_efficiency);
    return;
  }
  const double comm_s = c.comm_share * c.step_s, rest = c.step_s - comm_s;
  const bool tp = c.tp > 1;
  const std::string counts =
      tp ? fixed(c.collectives, 0) + " (" + fixed(c.traffic.collectives, 0) + ")" : "0 (0)";
  const std::string volume =
      tp ? fixed(c.bytes / 1e6, 3) + " (" + fixed(c.traffic.all_reduces * activation_mb, 3) + ")"
         : "0 (0)";
  const std::string per_collective = tp ? fixed(comm_s / c.collectives * 1e6, 0) : "";
  std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %s | %s | %s | %.3f |\n",
              case_name(c).c_str(), c.step_s, comm_s, rest, predicted_rest, same_efficiency,
              rest / same_efficiency, counts.c_str(), volume.c_str(), per_collective.c_str(),
              c.cost.tp_comm_seconds / c.cost.step_seconds);
}

void print_table(const Options& o, const std::vector<Case>& cases, double scale) {
  // One all-reduce of the (B*T, C) fp32 activations, in MB.
  const double activation_mb = static_cast<double>(o.batch * o.seq_len * o.n_embd) * 4 / 1e6;
  std::printf(
      "\n| plan | measured s/step | in tp collectives s/step | the rest s/step | predicted rest "
      "s/step | predicted rest at tp 1's GEMM efficiency | rest measured / predicted at tp 1's "
      "efficiency | collectives/step measured (predicted) | all-reduce "
      "MB/step measured (predicted) | measured us per collective | tp comm share on the "
      "reference GPUs (model) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|\n");
  for (const Case& c : cases) print_row(c, cases.front(), scale, activation_mb);
}

int run(const Options& o) {
  WorkDir dir(o.log_dir, "bench_tensor_parallel");
  const std::string model =
      write_gpt2_config(dir.path(), o.layers, o.n_embd, o.heads, o.vocab, o.seq_len);
  const ModelConfig config = load_model_config(model);
  std::vector<Case> cases = make_cases(o, config);
  const auto start = std::chrono::steady_clock::now();
  std::printf(
      "bench_tensor_parallel: GPT-2 L=%lld C=%lld H=%lld V=%lld (%.2fM params), fp32, dp 1, pp "
      "1, %lld micro-batches of %lld x %lld tokens per step, %d steps (%d untimed), CPU ranks "
      "with one thread each, %u cores\n",
      (long long)o.layers, (long long)o.n_embd, (long long)o.heads, (long long)o.vocab,
      double(config.num_parameters()) / 1e6, (long long)o.micro_batches, (long long)o.batch,
      (long long)o.seq_len, o.steps, o.warmup, std::thread::hardware_concurrency());
  std::fflush(stdout);
  for (Case& c : cases) {
    try {
      measure(o, model, dir.path(), c);
    } catch (const std::exception& e) {
      c.error = e.what();
    }
  }
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Case& calibration = cases[0];
  DSTRAIN_USER_CHECK(calibration.error.empty())
      << "the tp 1 calibration run failed: " << calibration.error;
  const double scale = calibration.step_s / calibration.cost.step_seconds;
  print_table(o, cases, scale);
  std::printf(
      "\nmeasured s/step: median over the timed steps of tokens per step / the log's "
      "tokens_per_s. collectives and all-reduce MB: the log's tensor_parallel record (one rank's, "
      "every rank runs the same), median over the timed steps; predicted: tensor_parallel_traffic "
      "x %lld micro-batches (volume in (B*T, C) fp32 all-reduces; the measured volume also holds "
      "the loss's (B*T, 3) statistics). in tp collectives: the log's comm_share (the share of "
      "the step the ranks spent inside them: copies and waits for the slowest rank, mean over "
      "ranks and timed steps) x the step; the rest: the step less that. predicted rest: "
      "predict_step_cost's step_seconds - tp_comm_seconds for the same Plan on tp x %s (%d "
      "NVLinks each), scaled by measured tp 1 / predicted tp 1 = %.4g CPU-rank seconds per "
      "reference-GPU second (compute and the optimizer; at tp 1's GEMM efficiency: the compute "
      "x efficiency / tp 1's, the FLOPs split alone; the model's tensor-parallel term is a "
      "GPU link's latency and rate, not a CPU's: its share on the reference GPUs is the last "
      "column, unscaled).\n"
      "The CPU ranks share %u cores: with more ranks than cores they compete for them, which the "
      "cost model (a GPU per rank) does not model.\n"
      "total %.1f s (%d runs)\n",
      (long long)o.micro_batches, kReferenceGpu, kReferenceNvlinks, scale,
      std::thread::hardware_concurrency(), total_s, static_cast<int>(cases.size()));
  for (const Case& c : cases) {
    if (c.error.empty()) continue;
    std::fprintf(stderr, "bench_tensor_parallel: a case failed; its row above says why\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cases_main("bench_tensor_parallel", argc, argv, kUsage, kHelp, parse_options, run);
}
