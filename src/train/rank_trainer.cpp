#include "train/rank_trainer.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>

#include "comm/gather_values.h"
#include "data/tokenizer.h"
#include "optim/schedule.h"
#include "parallel/model_flops.h"
#include "parallel/pipeline_split.h"
#include "train/cluster.h"
#include "train/run_start.h"
#include "train/sample.h"

namespace dstrain {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<double> gather_doubles(Communicator& comm, const std::vector<double>& mine) {
  return all_gather_values(comm, mine);
}

// The sum over ranks, in rank order in fp64: the same bits on every rank.
double sum_over_ranks(Communicator& comm, double value) {
  double sum = 0.0;
  for (double v : gather_doubles(comm, {value})) sum += v;
  return sum;
}

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

// This rank's peak bytes by category of one allocator.
std::array<size_t, kNumMemCategories> allocator_peaks(const Allocator& allocator) {
  return allocator.stats().peak;
}

// This rank's peak bytes by category, device and host allocators together.
std::array<size_t, kNumMemCategories> peak_bytes(const RankDevices& devices) {
  std::array<size_t, kNumMemCategories> mine{};
  for (const Allocator* allocator : {devices.device.get(), devices.host.get()}) {
    const std::array<size_t, kNumMemCategories> peaks = allocator_peaks(*allocator);
    for (int c = 0; c < kNumMemCategories; ++c) mine[c] += peaks[c];
  }
  return mine;
}

using MemoryBytes = std::array<size_t, kNumMemCategories>;

// Every rank's counts, in rank order (all ranks get them).
std::vector<MemoryBytes> over_ranks(Communicator& comm, const MemoryBytes& mine) {
  std::vector<double> values(mine.begin(), mine.end());  // exact below 2^53 bytes
  const std::vector<double> all = gather_doubles(comm, values);
  std::vector<MemoryBytes> ranks(static_cast<size_t>(comm.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    ranks[i / kNumMemCategories][i % kNumMemCategories] = static_cast<size_t>(all[i]);
  }
  return ranks;
}

// Per category, the largest count of any rank.
MemoryBytes max_of(const std::vector<MemoryBytes>& ranks) {
  MemoryBytes result{};
  for (const MemoryBytes& rank : ranks) {
    for (size_t c = 0; c < result.size(); ++c) result[c] = std::max(result[c], rank[c]);
  }
  return result;
}

nlohmann::json memory_json(const MemoryBytes& bytes) {
  nlohmann::json record = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c) {
    record[mem_category_name(static_cast<MemCategory>(c))] = bytes[static_cast<size_t>(c)];
  }
  return record;
}

int cpu_threads_per_rank(const TrainOptions& options, int world) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, (options.threads > 0 ? options.threads : cores) / world);
}

}  // namespace

RankTrainer::RankTrainer(const RunContext& ctx, Communicator& world)
    : ctx_(ctx),
      options_(ctx.options),
      config_(ctx.config),
      plan_(ctx.plan),
      world_(world),
      rank_(world.rank()),
      B_(ctx.plan.micro_batch),
      T_(ctx.plan.seq_len),
      accum_(ctx.plan.grad_accum),
      threads_(cpu_threads_per_rank(ctx.options, ctx.devices.ranks)),
      devices_(make_rank_devices(ctx.devices, world, threads_)),
      timer_(make_event_timer(devices_, ctx.origin)),
      tracer_(ctx.origin, timer_.get()),
      full_layout_(ctx.config),
      groups_(
          traced_groups(make_rank_groups(*devices_.comm, ctx.plan, full_layout_.tied_embedding()),
                        traced_groups_)),
      aux_loss_(make_aux_loss(ctx.config, groups_.data)),
      arch_(make_architecture(
          ctx.config,
          TensorParallel{ctx.plan.tp, groups_.tensor_index, ctx.plan.uses_sequence_parallel(),
                         groups_.tensor, &tp_stats_},
          ExpertParallel{ctx.plan.ep, groups_.expert_index, groups_.expert, &expert_load_,
                         aux_loss_.get(), ctx.plan.moe_capacity_factor, &selection_biases_},
          fp8_options(ctx.plan))),
      split_(pipeline_split(ctx.config, ctx.plan)),
      scaler_(ctx.plan.param_dtype == DType::F16, ctx.options.loss_scaling),
      adam_{ctx.options.beta1, ctx.options.beta2, ctx.options.eps, ctx.options.weight_decay,
            ctx.options.grad_clip},
      adam_step_(ctx.first_adam_step) {
  range_ = stage_of_split(split_, groups_.stage);
  ShardingConfig sharding{plan_.zero, plan_.offload, plan_.param_dtype, threads_,
                          pipeline_stage_blocks(arch_->layout(), range_),
                          plan_.pp > 1 && last_stage() && full_layout_.tied_embedding(), plan_.tp,
                          plan_.uses_sequence_parallel(), plan_.ep, groups_.expert_index,
                          plan_.offload_params, plan_.bf16_optimizer_states};
  // The model and the optimizer run on the rank's compute stream; ShardedModel's collectives
  // and offload copies, and the pipeline's transfers, on streams of their own.
  const Stream compute = devices_.compute.get();
  state_ = std::make_unique<ShardedModel>(
      config_, sharding,
      StateGroups{groups_.data, groups_.all, groups_.tied, groups_.tensor, groups_.expert_data},
      *devices_.backend,
      *devices_.device, *devices_.host, compute);
  const int slots = activation_slots(plan_.pp_schedule, plan_.pp, groups_.stage,
                                     static_cast<int>(accum_));
  stage_ = std::make_unique<ModelStage>(*arch_, range_, *devices_.backend, *devices_.device, B_,
                                        T_, plan_.param_dtype, true, plan_.recompute, slots);
  runner_ = std::make_unique<PipelineRunner>(*stage_, *state_, groups_.pipe, groups_.stage,
                                             plan_.pp, rank_, *devices_.backend, compute);
  if (aux_loss_) {
    aux_loss_->set_stage(groups_.stage == 0, last_stage());
    runner_->set_aux_loss(aux_loss_.get());
  }
  schedule_ = make_pipeline_schedule(plan_.pp_schedule, plan_.pp,
                                     static_cast<int>(accum_))[static_cast<size_t>(groups_.stage)];
  if (options_.test.fail_stage == groups_.stage &&
      (options_.test.fail_tensor_index < 0 || options_.test.fail_tensor_index == groups_.tensor_index)) {
    runner_->set_before_action([this](const PipelineAction& action) {
      if (!training_ || action.kind != ActionKind::Forward ||
          action.micro_batch != options_.test.fail_micro_batch || step_ + 1 != options_.test.fail_step) {
        return;
      }
      if (options_.test.fail_hang) {
        std::this_thread::sleep_for(std::chrono::duration<double>(3 * options_.comm_timeout));
        return;
      }
      DSTRAIN_CHECK(false) << "injected failure (testing)";
    });
  }
  tracer_.set_stream_track(compute, TraceTrack::Compute);
  tracer_.set_stream_track(state_->comm_stream(), TraceTrack::Communication);
  tracer_.set_stream_track(runner_->comm_stream(), TraceTrack::Pipeline);
  make_token_buffers();
  const int dp = plan_.dp, d = groups_.data_index;
  const bool packing = options_.packing == "on";
  val_loader_.emplace(ctx.data->val, LoaderOptions{B_, T_, dp, d, false, 0, 0, packing});
  if (reads_data()) {
    // Epochs are whole steps, whatever the split of a step's sequences (data/loader.h).
    loader_.emplace(ctx.data->train,
                    train_loader_options(plan_, d, options_.shuffle, options_.seed));
    if (!ctx.data_state.is_null()) loader_->restore(ctx.data_state);
  }
  if (!ctx.scaler_state.is_null()) scaler_.restore(ctx.scaler_state);
  if (options_.check_replicas > 0) replicas_.emplace(groups_, rank_);
}

// One token batch per activation slot on the first and last stage (the memory model counts
// them: token_batch_bytes per slot). The loader writes host memory: on a GPU it fills a
// pinned host copy per slot that then goes up on the compute stream, so that a copy still in
// flight never has its source overwritten (the next use of a slot comes after its micro-batch's
// work, which the runner has waited for).
void RankTrainer::make_token_buffers() {
  if (!reads_data()) return;
  const size_t bytes = token_batch_bytes(B_, T_);
  for (int s = 0; s < stage_->slots(); ++s) {
    token_buffers_.push_back(devices_.device->allocate(MemCategory::Data, bytes));
    if (!token_buffers_.back().device().is_cpu()) {
      host_token_buffers_.push_back(devices_.host->allocate(MemCategory::Data, bytes));
    }
  }
}

// The loader's next micro-batch in the slot's token buffer: inputs, targets and (packed rows)
// positions, each at its third of the buffer, (b, t) = (B, T) or a --batch-tokens micro-batch's.
MicroBatch RankTrainer::load_micro_batch(DataLoader& loader, int micro_batch) {
  const size_t slot = static_cast<size_t>(micro_batch % stage_->slots());
  const Buffer& device = token_buffers_[slot];
  const Buffer& host = host_token_buffers_.empty() ? device : host_token_buffers_[slot];
  const auto part = [this](const Buffer& buffer, int index) {
    return static_cast<int32_t*>(buffer.data()) + index * B_ * T_;
  };
  const bool packed = loader.packed();
  const BatchShape shape =
      loader.next_batch(part(host, 0), part(host, 1), packed ? part(host, 2) : nullptr);
  if (host.data() != device.data()) {
    devices_.backend->copy_bytes(device.data(), host.data(), device.bytes(),
                                 devices_.compute.get());
  }
  const auto view = [&](int index) {
    Tensor t = device.view(DType::I32, {shape.rows, shape.positions});
    t.data = part(device, index);
    return t;
  };
  MicroBatch batch{view(0), view(1), packed ? view(2) : Tensor()};
  batch.b = shape.rows;
  batch.t = shape.positions;
  return batch;
}

int RankTrainer::owner_stage(int block) const {
  if (block == ParamLayout::embedding_block()) return 0;
  if (block == arch_->layout().final_block()) return plan_.pp - 1;
  const int expert_layer = arch_->layout().expert_layer(block);
  const int64_t layer =
      expert_layer >= 0 ? expert_layer : block - ParamLayout::layer_block(0);
  for (int s = 0; s < plan_.pp; ++s) {
    const StageRange r = stage_of_split(split_, s);
    if (layer >= r.first_layer && layer < r.end_layer) return s;
  }
  DSTRAIN_CHECK(false) << "block " << block << " is in no stage";
  return -1;
}

void RankTrainer::announce(const std::vector<std::array<size_t, kNumMemCategories>>& ranks,
                           const std::array<size_t, kNumMemCategories>& device,
                           const std::array<size_t, kNumMemCategories>& host) const {
  const MemoryBytes memory = max_of(ranks);
  const TrainOptions& o = options_;
  const int world = world_.size();
  std::ostringstream text;
  text << "dstrain: model " << config_.name << " (" << config_.n_layer << " layers, "
       << config_.n_embd << " channels, " << config_.n_head << " heads, vocab "
       << config_.vocab_size << ", " << std::fixed;
  text.precision(2);
  text << config_.num_parameters() / 1e6 << "M parameters)\n";
  text << "  data: " << ctx_.data->description << "\n";
  char lr_text[32];
  std::snprintf(lr_text, sizeof lr_text, "%.3g", o.lr);
  text << "  batch " << B_ << " x " << T_ << " tokens x " << accum_ << " accumulation x "
       << plan_.dp << " data-parallel" << (plan_.dp == 1 ? " rank" : " ranks") << " = "
       << B_ * T_ * accum_ * plan_.dp << " tokens per step";
  if (plan_.batch_tokens > 0) {
    text << " at most (micro-batches of up to " << plan_.batch_tokens << " positions)";
  }
  text << "; " << count_of(o.steps, "step") << ", lr "
       << lr_text << " (" << o.lr_schedule << ", warmup " << o.warmup << ")\n";
  text << "  " << epoch_line() << "\n";
  text << "  plan: " << world << (world == 1 ? " rank" : " ranks") << " on "
       << ctx_.devices.describe() << " (" << devices_.backend->name() << (world > 1 ? " each" : "")
       << "), " << describe(plan_)
       << (plan_.param_dtype == DType::F16 ? ", dynamic loss scaling" : "") << "\n";
  if (plan_.pp > 1) {
    text << "  pipeline: " << plan_.pp << " stages of " << pipeline_split_text(split_)
         << " layers (embedding on the first, head on the last), "
         << pipeline_schedule_name(plan_.pp_schedule) << " schedule\n";
  }
  if (plan_.tp > 1) {
    text << "  tensor parallel: each layer split over " << plan_.tp << " ranks ("
         << config_.n_head / plan_.tp << " of " << config_.n_head << " heads, 1/" << plan_.tp
         << " of the MLP and of the vocabulary each)"
         << (plan_.uses_sequence_parallel() ? ", sequence parallel" : "") << "\n";
  }
  text << "  memory per rank (peak, largest over ranks):" << memory_line(memory);
  size_t device_total = 0, host_total = 0;
  for (int c = 0; c < kNumMemCategories; ++c) {
    device_total += device[static_cast<size_t>(c)];
    host_total += host[static_cast<size_t>(c)];
  }
  if (host_total > 0) {
    text << " (the device's allocator " << format_bytes(device_total) << ", the host's "
         << format_bytes(host_total) << ")";
  }
  if (ctx_.resume) text << "\n  resuming " << ctx_.resume->dir << " at step " << ctx_.first_step;
  if (ctx_.data->entropy_floor) {
    text.precision(4);
    text << "\n  entropy floor of the corpus: " << *ctx_.data->entropy_floor
         << " nats/token (a model that sees only the previous token cannot go below "
         << *ctx_.data->entropy_previous_only << ")";
  }
  ctx_.progress->message(text.str());
  nlohmann::json memory_record{{"type", "memory"},
                               {"ranks", world},
                               {"peak_bytes", memory_json(memory)},
                               {"device_peak_bytes", memory_json(device)},
                               {"host_peak_bytes", memory_json(host)}};
  for (const MemoryBytes& rank : ranks) memory_record["per_rank_peak_bytes"].push_back(memory_json(rank));
  if (!ctx_.resume) {
    ctx_.log->write({{"type", "config"}, {"model", config_.to_json()}, {"run", ctx_.fingerprint},
                     {"plan", to_json(plan_)}, {"zero", plan_.zero}, {"offload", plan_.offload},
                     {"recompute", recompute_name(plan_.recompute)}, {"steps", o.steps},
                     {"lr", o.lr}, {"min_lr", o.min_lr}, {"warmup", o.warmup},
                     {"lr_schedule", o.lr_schedule}});
    if (ctx_.data->entropy_floor) {
      ctx_.log->write({{"type", "data"}, {"entropy_floor", *ctx_.data->entropy_floor},
                       {"entropy_previous_only", *ctx_.data->entropy_previous_only}});
    }
  }
  ctx_.log->write(memory_record);
}

// How the run covers its data: an epoch's steps and tokens, the epochs the run makes and the
// steps after which the data wraps.
std::string RankTrainer::epoch_line() const {
  const int64_t per_epoch = ctx_.steps_per_epoch;
  const int64_t tokens = per_epoch * B_ * accum_ * plan_.dp * T_;
  std::ostringstream text;
  text.precision(3);
  text << "an epoch is " << count_of(per_epoch, "step") << " (" << format_rate(static_cast<double>(tokens))
       << " trained tokens); the run makes "
       << static_cast<double>(options_.steps) / static_cast<double>(std::max<int64_t>(1, per_epoch))
       << " epochs";
  if (per_epoch > 0 && options_.steps > per_epoch) {
    text << ", the data wrapping after step " << per_epoch;
    const int64_t wraps = (options_.steps - 1) / per_epoch;
    for (int64_t w = 2; w <= std::min<int64_t>(wraps, 3); ++w) text << ", " << w * per_epoch;
    if (wraps > 3) text << ", ...";
  }
  return text.str();
}

// The targets the loss counts in the next `rounds` rounds of `loader` (every rank's): its trained
// tokens for chat data, B*T*rounds*dp for text and on the ranks that read no data (whose loss
// and dloss are not used).
double RankTrainer::step_trained_targets(std::optional<DataLoader>& loader, int64_t rounds) const {
  const int64_t all = B_ * T_ * rounds * plan_.dp;
  if (!reads_data() || !loader) return static_cast<double>(all);
  return static_cast<double>(
      loader->trained_targets_ahead(loader->options().batch * plan_.dp * rounds));
}

// The positions the next `rounds` rounds of `loader` hold (every rank's), which tokens/s and
// MFU count: B*T*rounds*dp, or the rows x widths of --batch-tokens micro-batches.
double RankTrainer::step_positions(std::optional<DataLoader>& loader, int64_t rounds) const {
  const int64_t all = B_ * T_ * rounds * plan_.dp;
  if (!reads_data() || !loader) return static_cast<double>(all);
  return static_cast<double>(loader->positions_ahead(loader->options().batch * plan_.dp * rounds));
}

// What turns the runner's sum of micro-batch means (each over B*T rows) over `rounds`, divided by
// `rounds` and summed over the data-parallel ranks then divided by dp, into the mean over the
// `trained` targets: exactly 1 for text.
double RankTrainer::mean_to_trained(double trained, int64_t rounds) const {
  return static_cast<double>(B_ * T_ * rounds * plan_.dp) / trained;
}

RankTrainer::StepOutcome RankTrainer::train_step(int64_t step) {
  StepOutcome o;
  tracer_.take();  // what evaluation and checkpoints recorded
  tracer_.rebase();
  const double trace_begin = tracer_.now();
  const int step_span = tracer_.begin(TraceTrack::Compute, TraceKind::Step,
                                      "step " + std::to_string(step + 1), nullptr, {});
  // (Host-timed: measure_time stretches it to the step's last span.)
  const auto start = Clock::now();
  step_ = step;
  training_ = true;
  state_->begin_step();
  runner_->reset_times();
  tp_stats_ = {};
  expert_load_.clear();
  o.loss_scale = scaler_.scale();
  if (aux_loss_) aux_loss_->begin_step(o.loss_scale, accum_, plan_.dp);
  // The gradient of the mean loss over the step's trained targets (of every micro-batch and
  // rank, counted before any division; B*T*accum*dp of text), times the loss scale.
  const double trained = step_trained_targets(loader_, accum_);
  o.positions = step_positions(loader_, accum_);
  const float dloss = static_cast<float>(o.loss_scale / trained);
  MicroBatchSource source;
  if (reads_data()) source = [this](int m) { return load_micro_batch(*loader_, m); };
  const double local = runner_->run(schedule_, static_cast<int>(accum_), B_, T_, source, dloss,
                                    [this] { state_->last_micro_batch(); });
  training_ = false;
  if (options_.test.inject_inf_step == step + 1 && options_.test.inject_inf_rank == rank_) {
    state_->inject_inf_gradient();
  }
  const double mean = counts_loss() ? local / static_cast<double>(accum_) : 0.0;
  o.loss = sum_over_ranks(world_, mean * mean_to_trained(trained, accum_)) / plan_.dp;
  if (aux_loss_) {
    // Summed over the stages' layers, the mean over the micro-batches and the data-parallel
    // ranks (transformers': the same on each, its statistics summed over them).
    const double aux = aux_loss_->take_step_sum() / static_cast<double>(accum_);
    o.aux_loss = sum_over_ranks(world_, groups_.tensor_index == 0 ? aux : 0.0) / plan_.dp;
    if (aux_loss_->in_reported_loss()) o.loss += aux_loss_->coef() * o.aux_loss;
  }
  DSTRAIN_USER_CHECK(std::isfinite(o.loss))
      << "the loss became " << o.loss << " at step " << step + 1
      << "; training diverged (try a lower --lr or a --grad-clip)";
  // DeepSpeed's schedulers count the steps applied (an fp16 overflow does not step them).
  o.lr = learning_rate(ctx_.schedule, is_deepspeed_schedule(ctx_.schedule.kind) ? adam_step_ : step);
  o.stats = state_->finish_step(adam_, o.lr, adam_step_ + 1, o.loss_scale);
  DSTRAIN_USER_CHECK(!o.stats.found_inf || scaler_.enabled())
      << "the gradients hold inf or NaN at step " << step + 1
      << "; training diverged (try a lower --lr, a --grad-clip, or --precision fp32)";
  o.skipped = scaler_.update(o.stats.found_inf);
  if (!o.skipped) ++adam_step_;
  o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  tracer_.end(step_span, nullptr);
  measure_time(step, trace_begin, o);
  run_times_ += runner_->times();
  measure_parallelism(o);
  if (config_.moe.enabled()) {
    const SummedExpertLoad load = sum_expert_load(world_, expert_load_, groups_.tensor_index == 0,
                                                  static_cast<int>(config_.n_layer),
                                                  config_.moe.experts);
    o.expert_load = layer_loads(load);
    if (!o.skipped) update_selection_biases(load);
  }
  return o;
}

void RankTrainer::measure_parallelism(StepOutcome& o) {
  if (plan_.pp == 1 && plan_.tp == 1) return;
  const std::vector<double> all = gather_doubles(
      world_, {runner_->times().wait_seconds / o.seconds, static_cast<double>(tp_stats_.collectives),
               tp_stats_.all_reduce_bytes, tp_stats_.seconds / o.seconds});
  const size_t per_stage = static_cast<size_t>(plan_.dp * plan_.tp), values = 4;
  const auto stages = static_cast<size_t>(plan_.pp);
  const double ranks = static_cast<double>(per_stage);
  if (plan_.pp > 1) o.bubble.assign(stages, 0.0);
  if (plan_.tp > 1) {
    o.tp_share.assign(stages, 0.0);
    o.tp_collectives.assign(stages, 0.0);
    o.tp_bytes.assign(stages, 0.0);
  }
  for (size_t r = 0; r < all.size() / values; ++r) {
    const size_t stage = r / per_stage;
    const double* mine = &all[r * values];
    if (plan_.pp > 1) o.bubble[stage] += mine[0] / ranks;  // the mean over the stage's ranks
    if (plan_.tp == 1) continue;
    o.tp_share[stage] += mine[3] / ranks;
    if (r % per_stage == 0) {  // every rank of a stage runs the same collectives
      o.tp_collectives[stage] = mine[1];
      o.tp_bytes[stage] = mine[2];
    }
  }
}

std::string RankTrainer::trace_label() const {
  std::ostringstream text;
  text << "rank " << rank_;
  if (plan_.pp > 1) text << ", stage " << groups_.stage;
  if (plan_.dp > 1) text << ", data " << groups_.data_index;
  if (plan_.tp > 1) text << ", tensor " << groups_.tensor_index;
  return text.str();
}

// The spans are this step's once the device has run its work (take waits for it): the step
// ends with the last of them.
void RankTrainer::measure_time(int64_t step, double begin, StepOutcome& o) {
  std::vector<TraceSpanRecord> spans = tracer_.take();
  double end = begin;
  for (const TraceSpanRecord& s : spans) end = std::max(end, s.end);
  for (TraceSpanRecord& s : spans) {
    if (s.kind == TraceKind::Step) s.end = end;
  }
  const TimeSplit mine = split_step_time(spans, begin, end);
  const std::vector<double> all = gather_doubles(
      world_, {mine.step, mine.compute, mine.optimizer, mine.comm_exposed, mine.bubble, mine.other,
               mine.comm_total});
  const double ranks = world_.size();
  TimeSplit sum;
  for (size_t r = 0; r < all.size(); r += 7) {
    add_split(sum, TimeSplit{all[r], all[r + 1], all[r + 2], all[r + 3], all[r + 4], all[r + 5],
                             all[r + 6]});
  }
  const TimeSplit& t = o.time = scaled(sum, 1.0 / ranks);
  if (ctx_.peak_flops > 0 && t.step > 0) {
    o.mfu = training_flops_per_token(config_, T_) * o.positions /
            (t.step * ranks * ctx_.peak_flops);
  }
  if (ctx_.trace != nullptr && ctx_.trace->window().contains(step + 1)) {
    ctx_.trace->add(rank_, trace_label(), step + 1, std::move(spans));
  }
}

// Rank 0 writes the trace once every rank has handed in the window's last step (or the run's
// last, when it ends inside the window).
void RankTrainer::write_trace(int64_t step, bool last) {
  if (ctx_.trace == nullptr || trace_written_) return;
  const TraceWindow& window = ctx_.trace->window();
  if (step + 1 < window.first || (step + 1 < window.last && !last)) return;
  trace_written_ = true;
  world_.barrier();
  // Each node writes its own ranks' (train/cluster.h's node_file); rank 0 says so.
  if (rank_ != ctx_.devices.first_rank) return;
  const size_t spans = ctx_.trace->write();
  if (rank_ != 0) return;
  const int ranks = ctx_.devices.ranks;
  std::ostringstream text;
  text << "wrote the trace of steps " << window.first << "-" << std::min(window.last, step + 1)
       << " (" << spans << " spans, " << ranks << (ranks == 1 ? " rank" : " ranks") << ") to "
       << ctx_.trace->path()
       << (ranks < world_.size() ? " (the other nodes' ranks: one file per node)" : "")
       << " (open it in ui.perfetto.dev or chrome://tracing)";
  ctx_.progress->message(text.str());
}

void RankTrainer::report_step(int64_t step, const StepOutcome& o) {
  TrainSummary& summary = *ctx_.summary;
  const double tokens_per_s = o.positions / o.seconds;
  positions_run_ += o.positions;
  if (static_cast<int64_t>(summary.losses.size()) < options_.test.summary_losses_kept) {
    summary.losses.push_back(o.loss);
  }
  summary.final_loss = o.loss;
  nlohmann::json record{{"step", step + 1}, {"loss", o.loss}, {"lr", o.lr},
                        {"grad_norm", o.stats.grad_norm}, {"tokens_per_s", tokens_per_s}};
  if (scaler_.enabled()) {
    record["loss_scale"] = o.loss_scale;
    record["skipped"] = o.skipped;
    if (o.skipped) ++summary.skipped_steps;
  }
  double bubble = -1.0;
  if (!o.bubble.empty()) {
    record["pipeline_bubble"] = o.bubble;
    bubble = 0.0;
    for (double b : o.bubble) bubble += b / static_cast<double>(o.bubble.size());
  }
  if (!o.tp_collectives.empty()) {
    record["tensor_parallel"] = {{"collectives", o.tp_collectives},
                                 {"all_reduce_bytes", o.tp_bytes},
                                 {"comm_share", o.tp_share}};
  }
  if (!o.expert_load.empty()) record["expert_load"] = expert_load_json(o.expert_load);
  if (o.aux_loss >= 0) record["aux_loss"] = o.aux_loss;
  record["time"] = time_record(o.time);
  if (o.mfu >= 0) record["mfu"] = o.mfu;
  ctx_.log->write(record);
  if (o.skipped) {
    std::ostringstream text;
    text << "step " << step + 1 << ": gradients overflowed in fp16, step skipped; loss scale "
         << o.loss_scale << " -> " << scaler_.scale();
    ctx_.progress->message(text.str());
  }
  ctx_.progress->step(step, o.loss, o.lr, o.stats.grad_norm, tokens_per_s,
                      o.seconds * static_cast<double>(options_.steps - step - 1), bubble);
}

// Every --check-replicas steps and at the end (a testing divergence planted first).
void RankTrainer::check_replicas(int64_t step, bool last) {
  if (options_.test.diverge_step == step + 1 && options_.test.diverge_rank == rank_) {
    const ParamSpec& spec = arch_->layout().find(options_.test.diverge_tensor);
    state_->flip_param_bit(spec.block, spec.offset);
  }
  if (!replicas_ || ((step + 1) % options_.check_replicas != 0 && !last)) return;
  replicas_->check(*state_, arch_->layout(), step + 1);
}

// A stop signal, agreed by every rank (they may see it at different moments, on other nodes):
// the highest signal number any rank's process has seen, 0: none.
int RankTrainer::agree_to_stop() const {
  float stop = static_cast<float>(stop_signal());
  if (world_.size() > 1) world_.all_reduce(Tensor(&stop, DType::F32, {1}), ReduceOp::Max, nullptr);
  return static_cast<int>(stop);
}

double RankTrainer::evaluate() {
  val_loader_->reset();
  const int batches = static_cast<int>(
      std::clamp<int64_t>(options_.eval_batches / plan_.dp, 1, val_loader_->rounds_per_epoch()));
  MicroBatchSource source;
  if (reads_data()) source = [this](int m) { return load_micro_batch(*val_loader_, m); };
  const StageActions actions =
      make_forward_schedule(plan_.pp, batches)[static_cast<size_t>(groups_.stage)];
  const double trained = step_trained_targets(val_loader_, batches);
  const double total = runner_->run(actions, batches, B_, T_, source, 0.0f);
  const double mean = counts_loss() ? total / static_cast<double>(batches) : 0.0;
  return sum_over_ranks(world_, mean * mean_to_trained(trained, batches)) / plan_.dp;
}

// The starting state (full tensors, as a checkpoint holds them) into this rank's model state:
// its tp slices of them.
void RankTrainer::load_initial_state() {
  const FullTrainingState& initial = *ctx_.initial;
  std::optional<HostBlocks> slices;
  auto local = [&](const HostBlocks& full) -> const std::vector<Tensor>& {
    if (arch_->layout().whole()) return full.tensors();
    slices.emplace(arch_->layout());
    slice_host_blocks(full_layout_, arch_->layout(), groups_.tensor_index, full, *slices);
    return slices->tensors();
  };
  state_->set_full_params(local(initial.params));
  load_selection_biases();
  if (ctx_.have_moments) {
    state_->set_full_moments(0, local(initial.exp_avg));
    state_->set_full_moments(1, local(initial.exp_avg_sq));
  }
}

void RankTrainer::run() {
  const ScopedTracer tracing(&tracer_);
  load_initial_state();
  const std::vector<MemoryBytes> memory = over_ranks(world_, peak_bytes(devices_));
  // Apart: a category (the parameters, with parameter offload) may be in both.
  const MemoryBytes device = max_of(over_ranks(world_, allocator_peaks(*devices_.device)));
  const MemoryBytes host = max_of(over_ranks(world_, allocator_peaks(*devices_.host)));
  const bool leader = rank_ == 0;
  if (leader) announce(memory, device, host);
  TrainSummary& summary = *ctx_.summary;
  double train_seconds = 0.0;
  // This process's first rank writes the step count and the stopping signal into the summary
  // its process returns (each node's process has its own).
  const bool summary_writer = rank_ == ctx_.devices.first_rank;
  steps_reached_ = ctx_.first_step;
  for (int64_t step = ctx_.first_step; step < options_.steps; ++step) {
    steps_reached_ = step + 1;
    if (summary_writer) summary.steps = steps_reached_;
    const StepOutcome outcome = train_step(step);
    train_seconds += outcome.seconds;
    add_split(run_split_, outcome.time);
    if (leader) report_step(step, outcome);
    const int signal = agree_to_stop();
    const bool interrupted = signal != 0 && step + 1 < options_.steps;
    const bool last = step + 1 == options_.steps || interrupted;
    check_replicas(step, last);
    if (options_.eval_every > 0 &&
        ((step + 1) % options_.eval_every == 0 || step + 1 == options_.steps)) {
      const double eval_loss = evaluate();
      if (leader) {
        summary.final_eval_loss = eval_loss;
        ctx_.log->write({{"step", step + 1}, {"eval_loss", eval_loss}});
        std::ostringstream text;
        text.precision(4);
        text << std::fixed << "eval step " << step + 1 << ": loss " << eval_loss;
        if (ctx_.data->entropy_floor) {
          text << " (" << eval_loss - *ctx_.data->entropy_floor << " above the floor)";
        }
        ctx_.progress->message(text.str());
      }
    }
    write_trace(step, last);
    if (!options_.out.empty() &&
        ((options_.save_every > 0 && (step + 1) % options_.save_every == 0) || last)) {
      save_checkpoint(step);
    }
    if (interrupted) {
      interrupted_by_ = signal;  // this process's, or another node's
      if (summary_writer) summary.interrupted_by = signal;
      break;
    }
  }
  finish(train_seconds);
}

void RankTrainer::verify_tied_embedding() {
  if (groups_.tied == nullptr) return;
  const int block = ParamLayout::embedding_block();
  for (int part = 0; part < 3; ++part) {
    Tensor mine = part == 0 ? state_->master_part(block) : state_->moment_part(part - 1, block);
    if (!first_stage()) {
      groups_.tied->send(mine, 0, nullptr);
      continue;
    }
    std::vector<unsigned char> theirs(mine.nbytes());  // F32, or BF16 moments
    groups_.tied->recv(Tensor(theirs.data(), mine.dtype, {mine.numel()}), 1, nullptr);
    DSTRAIN_CHECK(std::memcmp(theirs.data(), mine.data, mine.nbytes()) == 0)
        << "the two copies of the tied embedding (first and last pipeline stage) differ";
  }
}

void RankTrainer::print_stage_summary(nlohmann::json& summary_record) {
  const auto peaks = peak_bytes(devices_);
  double peak_total = 0;
  for (size_t bytes : peaks) peak_total += static_cast<double>(bytes);
  const std::vector<double> all = gather_doubles(
      world_, {run_times_.compute_seconds, run_times_.wait_seconds, peak_total});
  if (rank_ != 0 || plan_.pp == 1) return;
  const int64_t steps = std::max<int64_t>(1, steps_reached_ - ctx_.first_step);
  std::ostringstream text;
  text << "  pipeline stages (" << pipeline_schedule_name(plan_.pp_schedule) << ", " << accum_
       << (accum_ == 1 ? " micro-batch" : " micro-batches")
       << " per step; per step, mean over the stage's ranks):";
  nlohmann::json stages = nlohmann::json::array();
  for (int s = 0; s < plan_.pp; ++s) {
    double compute = 0, wait = 0, peak = 0;
    const int per_stage = plan_.dp * plan_.tp;
    for (int i = 0; i < per_stage; ++i) {
      const size_t r = static_cast<size_t>(s * per_stage + i) * 3;
      compute += all[r] / per_stage / static_cast<double>(steps);
      wait += all[r + 1] / per_stage / static_cast<double>(steps);
      peak = std::max(peak, all[r + 2]);
    }
    const StageRange r = stage_of_split(split_, s);
    char line[200];
    std::snprintf(line, sizeof line,
                  "\n    stage %d: layers %lld-%lld, compute %.3f s, waiting %.3f s (%.0f%%), "
                  "peak memory %s",
                  s, static_cast<long long>(r.first_layer), static_cast<long long>(r.end_layer - 1),
                  compute, wait, 100.0 * wait / std::max(1e-12, compute + wait),
                  format_bytes(static_cast<size_t>(peak)).c_str());
    text << line;
    stages.push_back({{"stage", s}, {"layers", {r.first_layer, r.end_layer}},
                      {"compute_s_per_step", compute}, {"wait_s_per_step", wait},
                      {"peak_bytes", static_cast<uint64_t>(peak)}});
  }
  summary_record["stages"] = stages;
  ctx_.progress->message(text.str());
}

void run_rank(const RunContext& ctx, Communicator& world) { RankTrainer(ctx, world).run(); }

}  // namespace dstrain
