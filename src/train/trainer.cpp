#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>

#include "core/fs.h"
#include "model/gpt2.h"
#include "optim/schedule.h"
#include "parallel/cost_model.h"
#include "parallel/pipeline_split.h"
#include "topology/probe.h"
#include "train/cluster.h"
#include "train/plan_run.h"
#include "train/run_context.h"

namespace dstrain {

namespace {

// SIGINT / SIGTERM: the first asks the run to stop after the current step (with a checkpoint
// when --out is set); a second one exits at once. The same signal again within a second is the
// first one delivered twice (`timeout` and job schedulers signal the whole process group, and
// a shell forwards it too), not a second. A checkpoint directory only appears whole (renamed
// from its temp name), so exiting at once never corrupts the last good one.
std::atomic<int> g_stop_signal{0};
std::atomic<int64_t> g_stop_signal_ns{0};  // CLOCK_MONOTONIC time of the first signal

int64_t monotonic_ns() {  // async-signal-safe (clock_gettime is)
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
}

extern "C" void on_stop_signal(int signal) {
  const int first = g_stop_signal.load();
  if (first == 0) {
    g_stop_signal_ns = monotonic_ns();
  } else if (first == signal && monotonic_ns() - g_stop_signal_ns.load() < 1000000000) {
    return;  // the same delivery again
  }
  if (g_stop_signal.exchange(signal) != 0) {
    static const char message[] = "\ndstrain: second signal, exiting now\n";
    (void)!::write(STDERR_FILENO, message, sizeof message - 1);
    ::_exit(128 + signal);
  }
}

// Installs the handlers for the life of a run, and restores the previous ones after.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &old_int_);
    ::sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// The hyper-parameters a resumed run must share with the run it continues.
nlohmann::json run_fingerprint(const TrainOptions& options, const Plan& plan,
                               const ModelConfig& config) {
  // Ranks, pipeline and accumulation may change on resume as long as the micro-batches per
  // step do: the same micro-batches (windows of batch x seq_len tokens) make each step.
  return nlohmann::json{{"batch", options.batch},         {"seq_len", options.seq_len},
                        {"micro_batches_per_step", plan.grad_accum * plan.dp},
                        {"shuffle", options.shuffle},
                        {"seed", options.seed},           {"precision", options.precision},
                        {"data", options.data.empty() ? "synthetic" : options.data},
                        {"vocab_size", config.vocab_size}};
}

// The run's settings from its checkpoint: its model (a different --model is an error), the
// flags not given again, and the starting state.
void take_resumed_run(RunContext& ctx) {
  const TrainOptions& options = ctx.options;
  ctx.config = ctx.resume->config;
  if (!options.model.empty()) {
    const ModelConfig asked = load_model_config(options.model);
    DSTRAIN_USER_CHECK(asked.to_json() == ctx.config.to_json())
        << "--model " << options.model << " differs from the model of checkpoint "
        << ctx.resume->dir << "; drop --model to resume it";
  }
}

// OUT/run_config.json: the run's settings as flags (the planner's choices included), so that
// `dstrain --config OUT/run_config.json` repeats it.
void write_run_config(const TrainOptions& options, const ModelConfig& config) {
  nlohmann::json settings = run_config(options);
  if (options.model.empty()) settings["model"] = config.name;  // a resume: the checkpoint's
  settings["gpus"] = options.gpus / options.rendezvous.nnodes;  // --gpus is per node
  std::error_code error;
  std::filesystem::create_directories(options.out, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create --out directory " << options.out << ": "
                             << error.message();
  write_file_atomic(std::filesystem::path(options.out) / "run_config.json", settings.dump(2) + "\n");
}

void check_fingerprint(const RunContext& ctx) {
  const nlohmann::json& trainer = ctx.resume->trainer_state;
  if (!trainer.contains("run")) return;
  for (const auto& [key, value] : ctx.fingerprint.items()) {
    DSTRAIN_USER_CHECK(trainer["run"].contains(key) && trainer["run"][key] == value)
        << "checkpoint " << ctx.resume->dir << " was trained with " << key << " = "
        << (trainer["run"].contains(key) ? trainer["run"][key].dump() : "(unset)")
        << ", this run has " << value.dump()
        << "; resume with the same settings to continue the same run";
  }
}

// The starting point, on the host: a checkpoint, Hugging Face weights, or a fresh init.
void load_initial_state(RunContext& ctx, const ParamLayout& layout, FullTrainingState& initial) {
  const TrainOptions& options = ctx.options;
  if (ctx.resume) {
    check_fingerprint(ctx);
    const nlohmann::json& trainer = ctx.resume->trainer_state;
    load_checkpoint(*ctx.resume, initial);
    ctx.have_moments = true;
    ctx.first_step = trainer["step"].get<int64_t>();
    DSTRAIN_USER_CHECK(trainer.contains("data"))
        << "checkpoint " << ctx.resume->dir << " has no data position in trainer.json";
    ctx.data_state = trainer["data"];
    ctx.first_adam_step = trainer.value("adam_step", ctx.first_step);
    if (trainer.contains("scaler")) ctx.scaler_state = trainer["scaler"];
    DSTRAIN_USER_CHECK(ctx.first_step < options.steps)
        << "checkpoint " << ctx.resume->dir << " is at step " << ctx.first_step
        << ", which already reaches --steps " << options.steps << "; raise --steps to train on";
  } else if (!options.init_from.empty()) {
    load_weights(layout, initial.params, options.init_from);
  } else {
    init_model_parameters(layout, ctx.config, options.seed, initial.params.tensors());
  }
  ctx.initial = &initial;
}

// --trace: the collector of the window's spans. A window that starts after the run's last step
// is a mistake; one wholly before a resumed run's first step traces nothing (said once).
std::optional<TraceCollector> make_trace_collector(const TrainOptions& options, int64_t first_step,
                                                   const Cluster& cluster, std::ostream& out) {
  if (options.trace.empty()) return std::nullopt;
  const TraceWindow window = parse_trace_steps(options.trace_steps);
  DSTRAIN_USER_CHECK(window.first <= options.steps)
      << "--trace-steps " << options.trace_steps << " starts after the run's last step (--steps "
      << options.steps << ")";
  if (window.last <= first_step) {
    out << "dstrain: --trace-steps " << options.trace_steps << " is before step " << first_step + 1
        << ", where the run resumes: no trace is written\n";
    return std::nullopt;
  }
  return std::optional<TraceCollector>(std::in_place, cluster.node_file(options.trace), window);
}

// The dense peak of this machine's GPU 0 at the run's precision, as the planner sees it.
double gpu_peak_flops(DType precision) {
  std::string report;
  const NodeTopology local = probe_local_topology(&report);
  return local.gpus.empty() ? 0.0 : gpu_speed(local, precision).peak_flops;
}

// This process's ranks of the plan, on the devices it will use.
RunDevices choose_node_devices(const TrainOptions& options, const Plan& plan,
                               const Cluster& cluster) {
  const int nnodes = cluster.nnodes();
  DSTRAIN_USER_CHECK(plan.world() % nnodes == 0)
      << "the plan's " << plan.world() << " ranks cannot be shared evenly by " << nnodes
      << " nodes: give --gpus (ranks per node) so that every node runs the same number";
  RunDevices devices = choose_devices(options.device, plan.world() / nnodes, options.max_gpus);
  devices.first_rank = cluster.first_rank(devices.ranks);
  return devices;
}

// What every node must run identically: the plan, the model, the settings, the starting step
// (not --log, which only node 0 writes).
nlohmann::json node_settings(const RunContext& ctx) {
  nlohmann::json options = resumable_options(ctx.options);
  options.erase("log");
  return nlohmann::json{{"plan", to_json(ctx.plan)},
                        {"run", ctx.fingerprint},
                        {"options", options},
                        {"model", ctx.config.to_json()},
                        {"steps", ctx.options.steps},
                        {"first_step", ctx.first_step}};
}

}  // namespace

int stop_signal() { return g_stop_signal.load(); }

TrainSummary train(const TrainOptions& given, std::ostream& out) {
  RunContext ctx;
  ctx.options = given;
  TrainOptions& options = ctx.options;
  // Several nodes: --gpus counts one node's ranks; from here on it is the world's, as a
  // checkpoint remembers it (a resume without --gpus takes the world's from there).
  options.gpus *= options.rendezvous.nnodes;

  // The model: from the checkpoint on resume (a different --model is an error), and the run's
  // settings not given again.
  if (!options.resume.empty()) {
    ctx.resume = open_checkpoint(options.resume);
    if (ctx.resume->trainer_state.contains("options")) {
      apply_resumable_options(options, ctx.resume->trainer_state["options"]);
    }
    // The first run's command line repeated with --resume (DeepSpeed's and the HF Trainer's
    // habit): the checkpoint's weights win.
    if (!options.init_from.empty()) {
      out << "dstrain: --init-from " << options.init_from << " is ignored: the run resumes from "
          << ctx.resume->dir << "\n";
      options.init_from.clear();
    }
  }
  validate_options(options);
  Cluster cluster(options.rendezvous, out);
  ctx.cluster = &cluster;
  if (!options.tokenizer.empty()) {
    ctx.tokenizer =
        std::make_shared<const BpeTokenizer>(BpeTokenizer::from_file(options.tokenizer));
  }
  if (ctx.resume) {
    take_resumed_run(ctx);
  } else {
    ctx.config = load_model_config(options.model.empty() ? "tiny" : options.model);
  }
  const ModelConfig& config = ctx.config;
  if (ctx.resume) {
    ctx.plan = plan_from_options(options, config);  // the remembered settings
    remember_plan(ctx.plan, options);               // with the split filled in
  } else {
    ctx.plan = plan_run(options, config, out);
  }
  DSTRAIN_USER_CHECK(options.seq_len <= config.n_positions)
      << "--seq-len " << options.seq_len << " is longer than the model's n_positions "
      << config.n_positions;
  if (options.min_lr < 0) options.min_lr = options.lr / 10;
  ctx.schedule = LrScheduleConfig{parse_lr_schedule(options.lr_schedule), options.lr,
                                  options.min_lr, options.warmup, options.steps};
  ctx.devices = choose_node_devices(options, ctx.plan, cluster);
  Datasets data = open_datasets(options, config, ctx.plan.micro_batch, ctx.plan.seq_len, ctx.plan.dp);
  ctx.data = &data;
  ctx.fingerprint = run_fingerprint(options, ctx.plan, config);
  const bool node0 = cluster.node_rank() == 0;
  if (!options.out.empty() && node0) write_run_config(options, config);
  const ParamLayout layout(config);
  FullTrainingState initial(layout);
  load_initial_state(ctx, layout, initial);
  cluster.agree(node_settings(ctx));

  std::optional<TraceCollector> trace = make_trace_collector(options, ctx.first_step, cluster, out);
  if (trace) ctx.trace = &*trace;
  if (ctx.devices.cuda) ctx.peak_flops = gpu_peak_flops(ctx.plan.param_dtype);
  JsonlLog log;
  if (!options.log.empty() && node0) log = JsonlLog(options.log, ctx.resume.has_value());
  ProgressPrinter progress(out, options.steps, options.quiet, options.print_every);
  TrainSummary summary;
  summary.first_step = ctx.first_step;
  summary.entropy_floor = data.entropy_floor;
  std::unique_ptr<CheckpointWriter> checkpoint;
  ctx.checkpoint = &checkpoint;
  ctx.log = &log;
  ctx.progress = &progress;
  ctx.summary = &summary;
  ctx.out = &out;
  StopSignals stop_signals;
  ctx.origin = std::chrono::steady_clock::now();
  cluster.launch(ctx.devices, options.comm_timeout,
                 [&ctx](Communicator& world) { run_rank(ctx, world); });
  if (!node0) {
    out << "dstrain: " << cluster.describe_node(cluster.node_rank(), ctx.devices.ranks)
        << " done after step " << summary.steps << " (rank 0 on node 0 reports the run)\n";
  }
  return summary;
}

}  // namespace dstrain
