// Everything a training run is configured with (the flags of `dstrain train`).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/rendezvous.h"
#include "optim/grad_scaler.h"

namespace dstrain {

// The learning rate fine-tuning (--init-from) starts at without --lr: Hugging Face Trainer's
// 5e-5 for GPT-2, and 2e-5, the usual full fine-tuning rate of Llama, Qwen2 and DeepSeek.
constexpr double kFineTuneLrGpt2 = 5e-5;
constexpr double kFineTuneLrLlama = 2e-5;

// What tests plant in a run (no flag sets these): injected faults, divergences and checks.
struct TestHooks {
  // At this 1-based step, rank inject_inf_rank puts +inf into one gradient (0: never).
  int64_t inject_inf_step = 0;
  int inject_inf_rank = 0;
  // On CUDA, use at most this many GPUs (0: as many as the ranks, up to all found);
  // more ranks than GPUs share them, joined by the local communicator through host copies.
  int max_gpus = 0;
  // At step fail_step (1-based), pipeline stage fail_stage throws (fail_hang: sleeps
  // for 3 x comm_timeout instead) at the forward of micro-batch fail_micro_batch; -1: never.
  int fail_stage = -1;
  int fail_tensor_index = -1;      // only the stage's ranks of this tp index fail; -1: all
  int fail_micro_batch = 0;
  int64_t fail_step = 1;
  bool fail_hang = false;
  // After step diverge_step (1-based; 0: never), rank diverge_rank flips the lowest bit
  // of the first element of its working copy of tensor diverge_tensor (a replica divergence
  // --check-replicas must catch).
  int64_t diverge_step = 0;
  int diverge_rank = 0;
  std::string diverge_tensor;
  // At the end, the two copies of the tied embedding (first and last pipeline stage)
  // are compared bit for bit; a difference is an Error.
  bool verify_tied_embedding = false;
  // How many steps' losses TrainSummary::losses keeps (the first ones).
  int64_t summary_losses_kept = int64_t{1} << 16;
};

struct TrainOptions {
  // model and data
  std::string model = "tiny";      // preset name or config.json path
  std::string data;                // file or glob of shards; empty: the synthetic corpus
  std::string val_data;            // empty: a held-out tail of --data (or synthetic val)
  bool shuffle = false;
  // Chat data: several conversations per row (data/loader.h). auto: on for chat data on a plan
  // without pipeline stages; on / off.
  std::string packing = "auto";
  // batch geometry
  int64_t batch = 16;              // B per rank
  // Chat data without packing: micro-batches of whole conversations up to this many positions
  // (rows x their width; 0: B rows of T). The micro-batch becomes ceil(it / T) rows of T.
  int64_t batch_tokens = 0;
  int64_t seq_len = 64;            // T
  int64_t grad_accum = 1;
  // optimization
  int64_t steps = 1500;            // total optimizer steps of the run (a resume continues to it)
  double epochs = 0;               // > 0: instead of --steps, this many passes over --data
  double lr = 3e-3;                // from scratch; fine-tuning (--init-from): kFineTuneLr*
  std::string lr_schedule = "cosine";  // optim/schedule.h: constant, cosine or DeepSpeed's three
  int64_t warmup = 20;
  std::string warmup_type = "linear";  // DeepSpeed's schedules: linear | log
  double warmup_min_lr = 0.0;      // where the warmup starts
  double min_lr = -1.0;            // < 0: lr / 10
  // The cosine's horizon: it reaches min_lr here and stays there (0: --steps of the run's first
  // start; a resume that raises --steps keeps the curve it began with).
  int64_t lr_decay_steps = 0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;          // 0 disables
  // Mixture-of-experts models: each expert's capacity per micro-batch and rank, as a factor of
  // its even share of the token copies (model/expert_parallel.h); 0: dropless.
  double moe_capacity_factor = 0;
  // DeepSeek-V3's auxiliary-loss-free balancing: after each step every MoE layer's selection
  // bias moves by this times sign(the mean load - the expert's load) (train/expert_load.h);
  // 0: the bias stays as loaded.
  double moe_bias_update_rate = 0;
  uint64_t seed = 1337;
  std::string precision = "fp32";
  LossScaling loss_scaling;        // fp16's dynamic loss scaling (optim/grad_scaler.h)
  // hardware
  std::string device = "auto";     // auto | cpu | cuda
  int gpus = 1;
  int threads = 0;                 // CPU backend threads in all; 0: all cores
  int zero = 0;                    // ZeRO stage 0..3
  bool offload = false;            // optimizer state and step on the host
  bool offload_params = false;     // the working parameters and gradients on the host too
  bool bf16_optimizer_states = false;  // the Adam moments in bf16 (needs offload)
  std::string recompute = "none";  // none | selective | full
  double comm_timeout = 600.0;     // seconds a rank may wait in one collective
  // Several nodes (train/cluster.h): --nnodes, --node-rank, --master-addr, --master-port,
  // --rendezvous-timeout or their variables. --gpus counts the ranks of one node; train() makes
  // it the world's (gpus x nnodes) before planning.
  RendezvousOptions rendezvous;
  std::string inter_node_bandwidth;  // for the planner across nodes (topology/cluster.h); "": the NICs'
  // The machine to plan for (parallel/machine.h): --topology, --from-nvidia-smi, --gpu,
  // --host-memory. Without one, the GPUs of this machine (none: the CPU backend, no planning).
  std::string topology_file, nvidia_smi_file, gpu_model, host_memory;
  std::string gpu_memory;  // --gpu-memory SIZE: plan and run as if every GPU had only SIZE
  int64_t global_batch_tokens = 0; // for the planner; 0: batch x seq-len x grad-accum x gpus
  bool exact_global_batch = false; // a resume: the planner reaches global_batch_tokens exactly
  int dp = 0;                      // data parallel degree; 0: gpus / (tp x pp)
  int tp = 1, pp = 1;              // tensor / pipeline parallel degrees
  int ep = 1;                      // expert parallel degree (of the data-parallel ranks)
  bool sequence_parallel = true;   // tp > 1: sequence parallelism outside the tp regions
  std::string pp_schedule = "1f1b";  // 1f1b | gpipe
  std::string pp_split;            // layers per stage, "7,7,7,7"; empty: the balanced split
  // output
  std::string log;                 // JSONL file
  std::string tensorboard;         // TensorBoard event files go into this directory; empty: none
  int64_t eval_every = 250;        // 0 disables
  int64_t eval_batches = 16;
  std::string out;                 // checkpoint directory
  bool overwrite = false;          // --out / --log may hold an earlier run: replace it
  int64_t save_every = 0;          // 0: only the final checkpoint
  int64_t keep_last = 0;           // keep the newest N checkpoints of --out; 0: all
  std::string mirror;              // each checkpoint copied here as well (train/mirror.h)
  // The dtype of the checkpoint's model weights: fp32 | bf16 | fp16 | source (the dtype of the
  // --init-from weights; fp32 for a model trained from scratch). Optimizer state stays fp32.
  std::string save_dtype = "source";
  // Checkpoint weights above this go into shards with model.safetensors.index.json ("0": one
  // file); parse_size's units (topology/units.h).
  std::string save_shard_size = "5GB";
  std::string resume;              // a run or step directory, or "auto" (--out, if it holds one)
  std::string init_from;
  std::string tokenizer;           // a tokenizer.json: the final sample is decoded with it
  int64_t sample_tokens = 64;      // printed at the end; 0 disables
  bool quiet = false;              // no progress lines (the log and the summary remain)
  int64_t print_every = 0;         // progress lines kept every N steps; 0: ~25 per run
  std::string trace;               // Chrome trace file of the steps trace_steps (train/run_trace.h)
  std::string trace_steps = "3:5"; // A:B, 1-based, inclusive
  int64_t check_replicas = 0;      // every N steps the replicas compare checksums; 0: never
  // The flags the user gave (command-line names). On --resume, every setting of the run not
  // given again is taken from the checkpoint. nullopt (a library caller): all are given.
  std::optional<std::set<std::string>> explicit_flags;
  // Fault injection and checks for the tests (never set by a flag).
  TestHooks test;
};

// Whether the user gave `flag` (its command-line name); a library caller gives them all.
bool given_flag(const TrainOptions& options, const char* flag);

// Throws UserError naming the flag when a setting is out of range.
void validate_options(const TrainOptions& options);
// --save-shard-size in bytes (0: no limit). UserError naming the flag on a bad size.
uint64_t save_shard_bytes(const TrainOptions& options);

// The settings a checkpoint remembers (under their flag names): the run's (data, sequence
// length, steps, optimizer and schedule, outputs) and its plan's (ranks, pipeline, tensor
// parallelism, micro-batch, accumulation, ZeRO, offload, recompute).
nlohmann::json resumable_options(const TrainOptions& options);
// Every setting of a run under its flag name (the resumable ones and the model, its weights and
// tokenizer, the device and the output settings): OUT/run_config.json, which --config reads
// back to repeat the run.
nlohmann::json run_config(const TrainOptions& options);
// Sequences per step of the run whose remembered settings these are.
int64_t saved_global_batch(const nlohmann::json& saved);

// What a resume took from its checkpoint.
struct ResumedSettings {
  bool plan_taken = false;   // the checkpoint's plan settings (same machine)
  int64_t global_batch = 0;  // sequences per step, which the run keeps
  // Given optimizer and schedule settings that differ from the run's: "--lr 0.0001 (the run
  // had 0.0003)".
  std::vector<std::string> changed;
};
// Takes back the settings not given again: every run setting, and on the `same_machine` the
// plan's too (marked as given, so that the planner keeps them). A new --gpus, --pp, --tp or
// --batch there splits the same sequences per step anew (the accumulation follows; a new
// --pp drops the remembered --pp-split). On another machine the plan is left to the planner
// (or the flags on CPU ranks) with the global batch fixed (--global-batch-tokens, and a
// micro-batch and accumulation that share it over the ranks given). UserError when the
// ranks cannot share the global batch evenly. A library caller (no explicit_flags) gives
// every setting: nothing is taken.
ResumedSettings apply_resumable_options(TrainOptions& options, const nlohmann::json& saved,
                                        bool same_machine);

// The data-parallel ranks the options give: gpus / (tp x pp).
int data_parallel_ranks(const TrainOptions& options);

}  // namespace dstrain
