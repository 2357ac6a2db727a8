#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <memory>
#include <optional>

#include "optim/schedule.h"
#include "parallel/cost_model.h"
#include "parallel/cpu_plan.h"
#include "parallel/machine.h"
#include "parallel/pipeline_split.h"
#include "topology/host_memory.h"
#include "topology/probe.h"
#include "train/cluster.h"
#include "train/plan_run.h"
#include "train/run_start.h"
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
  RunDevices devices = choose_devices(options.device, plan.world() / nnodes, options.test.max_gpus);
  devices.first_rank = cluster.first_rank(devices.ranks);
  if (!options.gpu_memory.empty()) {
    devices.memory_limit = parse_gpu_memory(options.gpu_memory);
    devices.memory_limit_flag = "--gpu-memory " + options.gpu_memory;
  }
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
  // settings not given again; the plan's too on the machine the checkpoint's was made for.
  const RunMachine machine = find_run_machine(options);
  open_resumed_run(ctx, machine, out);
  if (!ctx.resume) start_fresh_run(options);
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
    fine_tuning_lr(options, ctx.config, out);
  }
  const ModelConfig& config = ctx.config;
  ctx.plan = plan_run(options, config, machine, out);
  if (options.device == "cpu") {  // CPU ranks: all of it in this process, checked before any is
    check_cpu_memory(MemoryModel(config), ctx.plan, options.sample_tokens > 0,
                     available_host_memory());
  }
  DSTRAIN_USER_CHECK(options.seq_len <= config.n_positions)
      << "--seq-len " << options.seq_len << " is longer than the model's n_positions "
      << config.n_positions;
  if (options.min_lr < 0) options.min_lr = options.lr / 10;
  ctx.devices = choose_node_devices(options, ctx.plan, cluster);
  Datasets data = open_datasets(options, config, ctx.plan.micro_batch, ctx.plan.seq_len, ctx.plan.dp);
  ctx.data = &data;
  settle_run_length(ctx, data, out);
  ctx.schedule = LrScheduleConfig{parse_lr_schedule(options.lr_schedule), options.lr,
                                  options.min_lr, options.warmup, options.lr_decay_steps,
                                  parse_warmup_type(options.warmup_type), options.warmup_min_lr};
  ctx.fingerprint = run_fingerprint(options, ctx.plan, config);
  ctx.machine = machine_record(machine, options.device == "cpu", ctx.plan.world(),
                               options.rendezvous.nnodes);
  const bool node0 = cluster.node_rank() == 0;
  const ParamLayout layout(config);
  FullTrainingState initial(layout);
  load_initial_state(ctx, layout, initial, out);
  // Only a start that got this far touches --out and --log: one that failed (a bad
  // --init-from, a broken checkpoint) leaves them as they were.
  if (node0) claim_outputs(ctx, out);
  if (!options.out.empty() && node0) write_run_config(options, config);
  ctx.checkpoint_format.max_shard_bytes = save_shard_bytes(options);
  ctx.checkpoint_format.extra_files = files_beside_weights(ctx);
  cluster.agree(node_settings(ctx));

  std::optional<TraceCollector> trace = make_trace_collector(options, ctx.first_step, cluster, out);
  if (trace) ctx.trace = &*trace;
  if (ctx.devices.cuda) ctx.peak_flops = gpu_peak_flops(ctx.plan.param_dtype);
  JsonlLog log;
  if (!options.log.empty() && node0) {
    log = JsonlLog(options.log, ctx.resume_asked && !options.overwrite);
  }
  if (!options.tensorboard.empty() && node0) log.add_tensorboard(options.tensorboard, ctx.first_step);
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
