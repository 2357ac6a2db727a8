#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <thread>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/rng.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "optim/schedule.h"
#include "parallel/sharded_model.h"
#include "train/checkpoint.h"
#include "train/datasets.h"
#include "train/devices.h"
#include "train/jsonl_log.h"
#include "train/plan_run.h"
#include "train/progress.h"

namespace dstrain {

namespace {

using Clock = std::chrono::steady_clock;

// SIGINT / SIGTERM: the first asks the run to stop after the current step (with a checkpoint
// when --out is set); a second one exits at once. A checkpoint directory only appears whole
// (renamed from its temp name), so exiting at once never corrupts the last good one.
std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int signal) {
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
nlohmann::json run_fingerprint(const TrainOptions& options, const ModelConfig& config) {
  // Ranks and accumulation may change on resume as long as their product does: the same
  // micro-batches (windows of batch x seq_len tokens) make each step.
  return nlohmann::json{{"batch", options.batch},         {"seq_len", options.seq_len},
                        {"micro_batches_per_step", options.grad_accum * options.gpus},
                        {"shuffle", options.shuffle},
                        {"seed", options.seed},           {"precision", options.precision},
                        {"data", options.data.empty() ? "synthetic" : options.data},
                        {"vocab_size", config.vocab_size}};
}

// A ParamProvider over full host copies: for sampling after training (no gradients).
class HostParams : public ParamProvider {
 public:
  explicit HostParams(const HostBlocks& blocks) : blocks_(blocks) {}
  Tensor acquire_params(int block) override { return blocks_.block(block); }
  Tensor acquire_grads(int block) override {
    DSTRAIN_CHECK(false) << "HostParams has no gradients";
    return Tensor();
  }

 private:
  const HostBlocks& blocks_;
};

// Samples `count` tokens after `prompt` with temperature 1, seeded: the model in action.
std::vector<int32_t> sample_tokens(const ModelConfig& config, Backend& backend,
                                   Allocator& allocator, ParamProvider& state,
                                   std::vector<int32_t> prompt, int64_t count, int64_t T,
                                   uint64_t seed) {
  Gpt2 model(config, backend, allocator, 1, T, DType::F32, false);
  Rng rng(seed, 0x73616d706c65ull);  // "sample"
  std::vector<int32_t> tokens = std::move(prompt);
  const int64_t V = config.vocab_size, Vp = config.padded_vocab();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(tokens.size()), T);
    std::vector<int32_t> context(tokens.end() - t, tokens.end());
    Tensor input(context.data(), DType::I32, {1, t});
    model.forward(state, input, Tensor(), 0.0f, nullptr);
    const float* logits = model.logits().f32() + (t - 1) * Vp;
    const float max_logit = *std::max_element(logits, logits + V);
    std::vector<double> probs(static_cast<size_t>(V));
    double total = 0.0;
    for (int64_t v = 0; v < V; ++v) total += probs[v] = std::exp(double(logits[v]) - max_logit);
    double u = rng.uniform() * total;
    int32_t chosen = static_cast<int32_t>(V - 1);
    for (int64_t v = 0; v < V; ++v) {
      if ((u -= probs[v]) < 0) {
        chosen = static_cast<int32_t>(v);
        break;
      }
    }
    tokens.push_back(chosen);
  }
  return tokens;
}

}  // namespace

namespace {

// What every rank shares, read-only, plus the outputs only rank 0 writes.
struct RunContext {
  TrainOptions options;
  ModelConfig config;
  LrScheduleConfig schedule;
  RunDevices devices;  // the backend, memory and communicator of every rank
  ShardingConfig sharding;
  Recompute recompute = Recompute::None;
  Datasets* data = nullptr;
  const FullTrainingState* initial = nullptr;  // the starting weights (and moments on resume)
  bool have_moments = false;
  int64_t first_step = 0;
  int64_t first_adam_step = 0;                 // optimizer steps applied before (skips excluded)
  nlohmann::json scaler_state;                 // on resume, else null
  nlohmann::json data_state;                   // loader position on resume, else null
  nlohmann::json fingerprint;
  std::optional<CheckpointInfo> resume;
  JsonlLog* log = nullptr;
  ProgressPrinter* progress = nullptr;
  TrainSummary* summary = nullptr;
  std::ostream* out = nullptr;
  // The checkpoint being written: made by rank 0, filled by every rank (between barriers).
  std::unique_ptr<CheckpointWriter>* checkpoint = nullptr;
};

std::string memory_line(const std::array<size_t, kNumMemCategories>& bytes) {
  std::ostringstream text;
  size_t total = 0;
  for (int c = 0; c < kNumMemCategories; ++c) {
    total += bytes[c];
    if (bytes[c] == 0) continue;
    text << " " << mem_category_name(static_cast<MemCategory>(c)) << " " << format_bytes(bytes[c])
         << ";";
  }
  text << " total " << format_bytes(total);
  return text.str();
}

// Per category, the largest count any rank reports (all ranks get it).
std::array<size_t, kNumMemCategories> max_over_ranks(Communicator& comm,
                                                     const std::array<size_t, kNumMemCategories>& mine) {
  // Exact 64-bit values through an I32 all-gather: each value as two 31-bit halves.
  constexpr int kWords = 2 * kNumMemCategories;
  std::vector<int32_t> local(kWords), all(static_cast<size_t>(kWords * comm.size()));
  for (int c = 0; c < kNumMemCategories; ++c) {
    local[2 * c] = static_cast<int32_t>(mine[c] >> 31);
    local[2 * c + 1] = static_cast<int32_t>(mine[c] & 0x7fffffff);
  }
  comm.all_gather(Tensor(all.data(), DType::I32, {int64_t(all.size())}),
                  Tensor(local.data(), DType::I32, {kWords}), nullptr);
  std::array<size_t, kNumMemCategories> result{};
  for (int r = 0; r < comm.size(); ++r) {
    for (int c = 0; c < kNumMemCategories; ++c) {
      const size_t value = (static_cast<size_t>(all[r * kWords + 2 * c]) << 31) |
                           static_cast<size_t>(all[r * kWords + 2 * c + 1]);
      result[c] = std::max(result[c], value);
    }
  }
  return result;
}

// The mean over ranks of a per-rank value (identity on one rank: keeps fp64).
double mean_over_ranks(Communicator& comm, double value) {
  if (comm.size() == 1) return value;
  float local = static_cast<float>(value);
  comm.all_reduce(Tensor(&local, DType::F32, {1}), ReduceOp::Sum, nullptr);
  return static_cast<double>(local) / comm.size();
}

void run_rank(const RunContext& ctx, Communicator& launched) {
  const TrainOptions& options = ctx.options;
  const ModelConfig& config = ctx.config;
  const int rank = launched.rank(), world = launched.size();
  const bool leader = rank == 0;
  const int64_t B = options.batch, T = options.seq_len, accum = options.grad_accum;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, (options.threads > 0 ? options.threads : cores) / world);

  DataLoader loader(ctx.data->train,
                    LoaderOptions{B, T, world, rank, options.shuffle, options.seed});
  DataLoader val_loader(ctx.data->val, LoaderOptions{B, T, world, rank, false, 0});
  if (!ctx.data_state.is_null()) loader.restore(rebase_loader_state(ctx.data_state, world));

  RankDevices rank_devices = make_rank_devices(ctx.devices, launched, threads);
  Backend* backend = rank_devices.backend.get();
  Allocator* device = rank_devices.device.get();
  Allocator* host = rank_devices.host.get();
  Communicator& comm = *rank_devices.comm;
  ShardingConfig sharding = ctx.sharding;
  sharding.host_threads = threads;
  // The model and the optimizer run on the rank's compute stream; ShardedModel's collectives and
  // offload copies on a stream of its own.
  const Stream compute = rank_devices.compute.get();
  ShardedModel state(config, sharding, comm, *backend, *device, *host, compute);
  const DType dtype = ctx.sharding.param_dtype;
  Gpt2 model(config, *backend, *device, B, T, dtype, true, ctx.recompute);
  // The token batch the model reads (B, T) inputs + (B, T) targets, I32, in device memory. The
  // loader writes host memory: on a GPU it fills a host copy that then goes up.
  const size_t batch_bytes = 2 * B * T * sizeof(int32_t);
  Buffer batch_buffer = device->allocate(MemCategory::Data, batch_bytes);
  Buffer host_batch_buffer;
  if (!batch_buffer.device().is_cpu()) {
    host_batch_buffer = host->allocate(MemCategory::Data, batch_bytes);
  }
  const Buffer& loaded_buffer = host_batch_buffer.empty() ? batch_buffer : host_batch_buffer;
  Tensor inputs = batch_buffer.view(DType::I32, {B, T});
  Tensor targets = inputs;
  targets.data = static_cast<int32_t*>(batch_buffer.data()) + B * T;
  Tensor host_inputs = loaded_buffer.view(DType::I32, {B, T});
  Tensor host_targets(static_cast<int32_t*>(loaded_buffer.data()) + B * T, DType::I32, {B, T});
  // Reads the next batch into host memory and, on a GPU, copies it up on the stream the model
  // runs on. No wait is needed before the host copy is overwritten by the next call: every
  // Gpt2::forward waits for the stream before it returns (it reads the losses back).
  auto next_batch = [&](DataLoader& from) {
    from.next_batch(host_inputs, host_targets);
    if (loaded_buffer.data() != batch_buffer.data()) {
      backend->copy_bytes(batch_buffer.data(), loaded_buffer.data(), batch_bytes, compute);
    }
  };

  state.set_full_params(ctx.initial->params.tensors());
  if (ctx.have_moments) {
    state.set_full_moments(0, ctx.initial->exp_avg.tensors());
    state.set_full_moments(1, ctx.initial->exp_avg_sq.tensors());
  }

  // Peak bytes by category, the largest over ranks (device and host allocators together).
  std::array<size_t, kNumMemCategories> mine{};
  for (const Allocator* allocator : {device, host}) {
    const MemoryStats stats = allocator->stats();
    for (int c = 0; c < kNumMemCategories; ++c) mine[c] += stats.peak[c];
  }
  const auto memory = max_over_ranks(comm, mine);

  if (leader) {
    const TrainSummary& summary = *ctx.summary;
    (void)summary;
    std::ostringstream text;
    text << "dstrain: model " << config.name << " (" << config.n_layer << " layers, "
         << config.n_embd << " channels, " << config.n_head << " heads, vocab "
         << config.vocab_size << ", " << std::fixed;
    text.precision(2);
    text << config.num_parameters() / 1e6 << "M parameters)\n";
    text << "  data: " << ctx.data->description << "\n";
    char lr_text[32];
    std::snprintf(lr_text, sizeof lr_text, "%.3g", options.lr);
    text << "  batch " << B << " x " << T << " tokens x " << accum << " accumulation x " << world
         << (world == 1 ? " rank" : " ranks") << " = " << B * T * accum * world
         << " tokens per step; " << options.steps << " steps, lr " << lr_text << " ("
         << options.lr_schedule << ", warmup " << options.warmup << ")\n";
    text << "  plan: " << world << (world == 1 ? " rank" : " ranks") << " on "
         << ctx.devices.describe() << " (" << backend->name() << (world > 1 ? " each" : "")
         << "), ZeRO-" << ctx.sharding.zero
         << (ctx.sharding.offload ? ", optimizer offloaded to host memory" : "")
         << ", recompute " << recompute_name(ctx.recompute) << ", " << options.precision
         << (dtype == DType::F16 ? " with dynamic loss scaling" : "") << "\n";
    text << "  memory per rank (peak, largest over ranks):" << memory_line(memory);
    if (ctx.resume) text << "\n  resuming " << ctx.resume->dir << " at step " << ctx.first_step;
    if (ctx.data->entropy_floor) {
      text.precision(4);
      text << "\n  entropy floor of the corpus: " << *ctx.data->entropy_floor
           << " nats/token (a model that sees only the previous token cannot go below "
           << *ctx.data->entropy_previous_only << ")";
    }
    ctx.progress->message(text.str());
    nlohmann::json memory_record{{"type", "memory"}, {"ranks", world}};
    for (int c = 0; c < kNumMemCategories; ++c) {
      memory_record["peak_bytes"][mem_category_name(static_cast<MemCategory>(c))] = memory[c];
    }
    if (!ctx.resume) {
      ctx.log->write({{"type", "config"}, {"model", config.to_json()}, {"run", ctx.fingerprint},
                      {"zero", ctx.sharding.zero}, {"offload", ctx.sharding.offload},
                      {"recompute", recompute_name(ctx.recompute)},
                      {"steps", options.steps}, {"lr", options.lr}, {"min_lr", options.min_lr},
                      {"warmup", options.warmup}, {"lr_schedule", options.lr_schedule}});
      if (ctx.data->entropy_floor) {
        ctx.log->write({{"type", "data"}, {"entropy_floor", *ctx.data->entropy_floor},
                        {"entropy_previous_only", *ctx.data->entropy_previous_only}});
      }
    }
    ctx.log->write(memory_record);
  }

  auto evaluate = [&]() {
    val_loader.reset();
    const int64_t batches = std::clamp<int64_t>(options.eval_batches / world, 1,
                                                val_loader.rounds_per_epoch());
    double total = 0.0;
    for (int64_t i = 0; i < batches; ++i) {
      next_batch(val_loader);
      total += model.forward(state, inputs, targets, 0.0f, compute);
    }
    return mean_over_ranks(comm, total / static_cast<double>(batches));
  };
  HostBlocks gathered(state.layout());  // the full weights, for the sample at the end

  TrainSummary& summary = *ctx.summary;
  const AdamWConfig adam{options.beta1, options.beta2, options.eps, options.weight_decay,
                         options.grad_clip};
  GradScaler scaler(dtype == DType::F16);
  if (!ctx.scaler_state.is_null()) scaler.restore(ctx.scaler_state);
  int64_t adam_step = ctx.first_adam_step;
  const double tokens_per_step = static_cast<double>(B * T * accum * world);
  double train_seconds = 0.0, smoothed_step_seconds = 0.0;

  for (int64_t step = ctx.first_step; step < options.steps; ++step) {
    const auto start = Clock::now();
    summary.steps = step + 1;
    state.begin_step();
    double local_loss = 0.0;
    const double loss_scale = scaler.scale();
    // The gradient of the mean loss over the global batch, times the loss scale.
    const float dloss = static_cast<float>(loss_scale / static_cast<double>(B * T * accum * world));
    for (int64_t micro = 0; micro < accum; ++micro) {
      next_batch(loader);
      local_loss += model.forward(state, inputs, targets, dloss, compute);
      if (micro == accum - 1) state.last_micro_batch();  // reduce during this backward
      model.backward(state, inputs, compute);
    }
    if (options.inject_inf_step == step + 1 && options.inject_inf_rank == rank) {
      state.inject_inf_gradient();
    }
    const double loss = mean_over_ranks(comm, local_loss / static_cast<double>(accum));
    DSTRAIN_USER_CHECK(std::isfinite(loss))
        << "the loss became " << loss << " at step " << step + 1
        << "; training diverged (try a lower --lr or a --grad-clip)";
    const double lr = learning_rate(ctx.schedule, step);
    const StepStats stats = state.finish_step(adam, lr, adam_step + 1, loss_scale);
    DSTRAIN_USER_CHECK(!stats.found_inf || scaler.enabled())
        << "the gradients hold inf or NaN at step " << step + 1
        << "; training diverged (try a lower --lr, a --grad-clip, or --precision fp32)";
    const bool skipped = scaler.update(stats.found_inf);
    if (!skipped) ++adam_step;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    train_seconds += seconds;
    smoothed_step_seconds =
        step == ctx.first_step ? seconds : 0.9 * smoothed_step_seconds + 0.1 * seconds;
    const double tokens_per_s = tokens_per_step / seconds;
    if (leader) {
      summary.losses.push_back(loss);
      nlohmann::json record{{"step", step + 1}, {"loss", loss}, {"lr", lr},
                            {"grad_norm", stats.grad_norm}, {"tokens_per_s", tokens_per_s}};
      if (scaler.enabled()) {
        record["loss_scale"] = loss_scale;
        record["skipped"] = skipped;
        if (skipped) ++summary.skipped_steps;
      }
      ctx.log->write(record);
      if (skipped) {
        std::ostringstream text;
        text << "step " << step + 1 << ": gradients overflowed in fp16, step skipped; loss scale "
             << loss_scale << " -> " << scaler.scale();
        ctx.progress->message(text.str());
      }
      ctx.progress->step(step, loss, lr, stats.grad_norm, tokens_per_s,
                         smoothed_step_seconds * static_cast<double>(options.steps - step - 1));
    }

    // A stop signal, agreed by every rank (they may see it at different moments).
    float stop = g_stop_signal.load() != 0 ? 1.0f : 0.0f;
    if (world > 1) comm.all_reduce(Tensor(&stop, DType::F32, {1}), ReduceOp::Max, nullptr);
    const bool interrupted = stop != 0.0f && step + 1 < options.steps;
    const bool last = step + 1 == options.steps || interrupted;
    if (options.eval_every > 0 &&
        ((step + 1) % options.eval_every == 0 || step + 1 == options.steps)) {
      const double eval_loss = evaluate();
      if (leader) {
        summary.final_eval_loss = eval_loss;
        ctx.log->write({{"step", step + 1}, {"eval_loss", eval_loss}});
        std::ostringstream text;
        text.precision(4);
        text << std::fixed << "eval step " << step + 1 << ": loss " << eval_loss;
        if (ctx.data->entropy_floor) {
          text << " (" << eval_loss - *ctx.data->entropy_floor << " above the floor)";
        }
        ctx.progress->message(text.str());
      }
    }
    if (!options.out.empty() &&
        ((options.save_every > 0 && (step + 1) % options.save_every == 0) || last)) {
      // Each rank writes its own part of the same files, in parallel.
      if (leader) *ctx.checkpoint = std::make_unique<CheckpointWriter>(options.out, step + 1, config);
      comm.barrier();
      CheckpointWriter::Part part;
      for (int block = 0; block < state.num_blocks(); ++block) {
        part.begin.push_back(state.shard_begin(block));
        part.params.push_back(state.master_part(block));
        part.exp_avg.push_back(state.moment_part(0, block));
        part.exp_avg_sq.push_back(state.moment_part(1, block));
      }
      (*ctx.checkpoint)->write_part(part);
      comm.barrier();
      if (leader) {
        const nlohmann::json trainer{{"step", step + 1},        {"adam_step", adam_step},
                                     {"data", loader.state()},  {"scaler", scaler.state()},
                                     {"run", ctx.fingerprint},  {"seed", options.seed},
                                     {"options", resumable_options(options)}};
        summary.checkpoint = (*ctx.checkpoint)->finish(trainer);
        ctx.checkpoint->reset();
        ctx.progress->message("saved checkpoint " + summary.checkpoint);
      }
      comm.barrier();  // nobody runs ahead of a checkpoint that failed on rank 0
    }
    if (interrupted) {
      summary.interrupted_by = g_stop_signal.load();
      if (summary.interrupted_by == 0) summary.interrupted_by = SIGINT;  // another rank saw it
      break;
    }
  }
  const int64_t steps_run = summary.steps - ctx.first_step;
  if (leader) {
    summary.tokens_per_second =
        train_seconds > 0 ? tokens_per_step * static_cast<double>(steps_run) / train_seconds : 0.0;
  }

  // A sample from the trained model, on rank 0 with the gathered weights.
  const bool sample = options.sample_tokens > 0 && summary.interrupted_by == 0;
  if (sample) state.get_full_params(gathered.tensors());
  if (!leader) return;
  const Datasets& data = *ctx.data;
  std::ostringstream text;
  text.precision(4);
  text << std::fixed << "done: " << steps_run << " steps in " << format_duration(train_seconds)
       << ", " << format_rate(summary.tokens_per_second) << " tokens/s";
  if (!summary.losses.empty()) text << "; final train loss " << summary.losses.back();
  if (summary.final_eval_loss) text << ", eval loss " << *summary.final_eval_loss;
  if (data.entropy_floor && summary.final_eval_loss) {
    text << "\n  entropy floor " << *data.entropy_floor << " nats: the model is "
         << *summary.final_eval_loss - *data.entropy_floor << " nats above it";
  }
  nlohmann::json summary_record{{"type", "summary"}, {"steps", summary.steps},
                                {"interrupted", summary.interrupted_by != 0},
                                {"tokens_per_s", summary.tokens_per_second},
                                {"train_seconds", train_seconds}};
  if (!summary.losses.empty()) summary_record["final_loss"] = summary.losses.back();
  if (summary.final_eval_loss) summary_record["final_eval_loss"] = *summary.final_eval_loss;
  ctx.log->write(summary_record);
  if (summary.interrupted_by != 0) {
    text << "\n  interrupted (" << (summary.interrupted_by == SIGTERM ? "SIGTERM" : "SIGINT")
         << ") after step " << summary.steps;
    if (!summary.checkpoint.empty()) {
      text << "; continue with: dstrain --resume " << options.out << " --steps " << options.steps;
    } else {
      text << "; no checkpoint written (no --out)";
    }
  }
  if (sample) {
    std::vector<int32_t> prompt(static_cast<size_t>(std::min<int64_t>(8, T)));
    DataLoader prompt_loader(data.val, LoaderOptions{B, T, 1, 0, false, 0});
    prompt_loader.next_batch(host_inputs, host_targets);
    std::copy(host_inputs.i32(), host_inputs.i32() + prompt.size(), prompt.begin());
    HostParams weights(gathered);
    // The gathered weights are host memory: the sample runs on a CPU backend (the run's own
    // when it is one).
    std::unique_ptr<Backend> sample_backend;
    std::unique_ptr<Allocator> sample_allocator;
    if (ctx.devices.cuda) {
      sample_backend = make_cpu_backend(threads);
      sample_allocator = make_cpu_allocator(rank);
    }
    const std::vector<int32_t> tokens = sample_tokens(
        config, sample_backend ? *sample_backend : *backend,
        sample_allocator ? *sample_allocator : *device, weights, prompt, options.sample_tokens, T,
        options.seed);
    text << "\n  sample (" << prompt.size() << " prompt tokens, then " << options.sample_tokens
         << " sampled):\n    ";
    if (!data.synthetic && config.vocab_size <= 256) {
      text << ByteTokenizer().decode(tokens);
    } else {
      for (size_t i = 0; i < tokens.size(); ++i) {
        text << (i ? " " : "") << (i == prompt.size() ? "| " : "") << tokens[i];
      }
    }
  }
  ctx.progress->message(text.str());
}

}  // namespace

TrainSummary train(const TrainOptions& given, std::ostream& out) {
  RunContext ctx;
  ctx.options = given;
  TrainOptions& options = ctx.options;

  // The model: from the checkpoint on resume (a different --model is an error), and the run's
  // settings not given again.
  if (!options.resume.empty()) {
    ctx.resume = open_checkpoint(options.resume);
    if (ctx.resume->trainer_state.contains("options")) {
      apply_resumable_options(options, ctx.resume->trainer_state["options"]);
    }
  }
  validate_options(options);
  if (ctx.resume) {
    ctx.config = ctx.resume->config;
    if (!options.model.empty()) {
      const ModelConfig asked = load_model_config(options.model);
      DSTRAIN_USER_CHECK(asked.to_json() == ctx.config.to_json())
          << "--model " << options.model << " differs from the model of checkpoint "
          << ctx.resume->dir << "; drop --model to resume it";
    }
  } else {
    ctx.config = load_model_config(options.model.empty() ? "tiny" : options.model);
  }
  const ModelConfig& config = ctx.config;
  if (!ctx.resume) plan_run(options, config, out);
  const int world = options.gpus;
  DSTRAIN_USER_CHECK(options.seq_len <= config.n_positions)
      << "--seq-len " << options.seq_len << " is longer than the model's n_positions "
      << config.n_positions;
  if (options.min_lr < 0) options.min_lr = options.lr / 10;
  ctx.schedule = LrScheduleConfig{parse_lr_schedule(options.lr_schedule), options.lr,
                                  options.min_lr, options.warmup, options.steps};
  ctx.sharding = ShardingConfig{options.zero, options.offload, parse_dtype(options.precision)};
  ctx.devices = choose_devices(options.device, world, options.max_gpus);
  ctx.recompute = parse_recompute(options.recompute);
  Datasets data = open_datasets(options, config, options.batch, options.seq_len, world);
  ctx.data = &data;
  ctx.fingerprint = run_fingerprint(options, config);

  // The starting point, on the host: a checkpoint, Hugging Face weights, or a fresh init.
  const ParamLayout layout(config);
  FullTrainingState initial(layout);
  if (ctx.resume) {
    const nlohmann::json& trainer = ctx.resume->trainer_state;
    if (trainer.contains("run")) {
      for (const auto& [key, value] : ctx.fingerprint.items()) {
        DSTRAIN_USER_CHECK(trainer["run"].contains(key) && trainer["run"][key] == value)
            << "checkpoint " << ctx.resume->dir << " was trained with " << key << " = "
            << (trainer["run"].contains(key) ? trainer["run"][key].dump() : "(unset)")
            << ", this run has " << value.dump()
            << "; resume with the same settings to continue the same run";
      }
    }
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
    init_gpt2_parameters(layout, config, options.seed, initial.params.tensors());
  }
  ctx.initial = &initial;

  JsonlLog log;
  if (!options.log.empty()) log = JsonlLog(options.log, ctx.resume.has_value());
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
  launch_ranks(ctx.devices, options.comm_timeout,
               [&ctx](Communicator& comm) { run_rank(ctx, comm); });
  return summary;
}

}  // namespace dstrain
