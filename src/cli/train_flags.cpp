#include "cli/train_flags.h"

#include <string>

#include "model/config.h"
#include "topology/cluster.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

constexpr const char* kVersionLine =
    "trains GPT-2, LLaMA-family (Llama, DeepSeek, Qwen2) and Mixtral-style mixture-of-experts "
    "transformers on the GPUs (or CPU) "
    "of one machine or several";

std::string preset_list() {
  std::string list;
  for (const std::string& name : model_preset_names()) list += (list.empty() ? "" : ", ") + name;
  return list;
}

po::options_description model_flags(TrainOptions& o) {
  po::options_description flags("Model and data");
  flags.add_options()
      ("config", po::value<std::string>()->value_name("FILE"),
       "read flags from FILE: JSON with the flag names as keys (as OUT/run_config.json, which every "
       "run with --out writes), or `flag = value` lines; flags on the command line win")
      ("deepspeed-config", po::value<std::string>()->value_name("FILE"),
       "a DeepSpeed ds_config.json: its batch, ZeRO, offload, fp16/bf16, clipping, AdamW and "
       "WarmupLR/WarmupCosineLR/WarmupDecayLR settings as dstrain flags (printed); what dstrain "
       "cannot do is named; --config and command-line flags win")
      ("model", po::value(&o.model)->value_name("NAME|PATH"),
       ("a preset, or a Hugging Face config.json (gpt2, llama, qwen2 or mixtral) or the model directory "
        "holding it (default: the --init-from directory's model, else tiny; presets: " +
        preset_list() + ")").c_str())
      ("init-from", po::value(&o.init_from)->value_name("DIR|FILE"),
       "start from Hugging Face weights: a model directory (model.safetensors, or shards with "
       "model.safetensors.index.json), or one of those files; fp32/fp16/bf16 on disk. A directory "
       "with config.json is also the model (unless --model is given), and its tokenizer and "
       "generation_config.json go into every checkpoint")
      ("data", po::value(&o.data)->value_name("FILE|GLOB"),
       "token shards (llm.c .bin, raw .u16/.u32; text goes through `dstrain prepare` first); "
       "default: the built-in synthetic corpus")
      ("val-data", po::value(&o.val_data)->value_name("FILE|GLOB"),
       "validation shards (default: the last 10% of --data)")
      ("shuffle", po::bool_switch(&o.shuffle), "shuffle the sequences each epoch (seeded)")
      ("packing", po::value(&o.packing)->default_value(o.packing)->value_name("auto|on|off"),
       "chat data (prepare --chat): pack several conversations into each row of --seq-len, "
       "attention and positions restarting at each (auto: on, unless --batch-tokens)")
      ("tokenizer", po::value(&o.tokenizer)->value_name("FILE"),
       "a Hugging Face tokenizer.json (the one `dstrain prepare --tokenizer` used): the sample at "
       "the end is decoded with it, and it goes into every checkpoint with the "
       "tokenizer_config.json and special_tokens_map.json beside it (default: --init-from's)");
  return flags;
}

po::options_description batch_flags(TrainOptions& o) {
  po::options_description flags("Batch and schedule");
  flags.add_options()
      ("batch", po::value(&o.batch)->value_name("B"),
       "sequences per micro-batch per data-parallel rank (default 16 on CPU ranks; on GPUs the "
       "planner's)")
      ("micro-batch", po::value<int64_t>()->value_name("B"), "the same as --batch")
      ("batch-tokens", po::value(&o.batch_tokens)->default_value(o.batch_tokens)->value_name("N"),
       "chat data, one conversation per row: micro-batches of whole conversations up to N "
       "positions each (rows x the longest's length, rounded up to 8), as DeepSpeed's "
       "DynamicBatchSampler max_tokens; the micro-batch is planned as ceil(N / --seq-len) rows "
       "(0: --batch rows)")
      ("seq-len", po::value(&o.seq_len)->value_name("T"),
       "tokens per sequence (default: a Hugging Face model's context, as long as it fits, else "
       "64 on CPU ranks and min(1024, n_positions) on GPUs)")
      ("grad-accum", po::value(&o.grad_accum)->value_name("N"),
       "micro-batches per optimizer step (default 1 on CPU ranks; on GPUs the planner's)")
      ("steps", po::value(&o.steps)->value_name("N"),
       "total optimizer steps of the run, a resume continuing up to it (default 1500)")
      ("epochs", po::value(&o.epochs)->value_name("N"),
       "instead of --steps: N passes over --data (may be fractional, e.g. 0.5)")
      ("lr", po::value(&o.lr)->value_name("LR"),
       "peak learning rate (default 0.003 from scratch; fine-tuning with --init-from: 5e-05 "
       "for GPT-2, 2e-05 for the LLaMA family)")
      ("lr-schedule", po::value(&o.lr_schedule)->default_value(o.lr_schedule)->value_name("KIND"),
       "constant | cosine (both after a linear warmup), or DeepSpeed's schedulers step for step: "
       "warmup-lr (WarmupLR), warmup-decay-lr (WarmupDecayLR), warmup-cosine-lr (WarmupCosineLR)")
      ("warmup", po::value(&o.warmup)->default_value(o.warmup)->value_name("N"),
       "warmup steps (DeepSpeed's warmup_num_steps)")
      ("warmup-type", po::value(&o.warmup_type)->default_value(o.warmup_type)->value_name("KIND"),
       "linear | log (DeepSpeed's warmup_type; log with its schedules only)")
      ("warmup-min-lr", po::value(&o.warmup_min_lr)->default_value(o.warmup_min_lr, "0")->value_name("LR"),
       "the learning rate the warmup starts from (DeepSpeed's warmup_min_lr)")
      ("min-lr", po::value(&o.min_lr)->value_name("LR"),
       "the floor the decay ends at (default lr/10; DeepSpeed's cos_min_ratio x lr)")
      ("lr-decay-steps", po::value(&o.lr_decay_steps)->value_name("N"),
       "the step where the decay reaches --min-lr, which then holds (DeepSpeed's total_num_steps; "
       "default: --steps of the run's first start, kept when a resume raises --steps)");
  return flags;
}

po::options_description optimizer_flags(TrainOptions& o) {
  po::options_description flags("Optimizer and precision");
  flags.add_options()
      ("weight-decay", po::value(&o.weight_decay)->default_value(o.weight_decay, "0.1")->value_name("W"),
       "AdamW decoupled weight decay (matrices and embeddings only)")
      ("beta1", po::value(&o.beta1)->default_value(o.beta1, "0.9")->value_name("B"), "AdamW beta1")
      ("beta2", po::value(&o.beta2)->default_value(o.beta2, "0.95")->value_name("B"), "AdamW beta2")
      ("eps", po::value(&o.eps)->default_value(o.eps, "1e-8")->value_name("E"), "AdamW epsilon")
      ("grad-clip", po::value(&o.grad_clip)->default_value(o.grad_clip, "1.0")->value_name("NORM"),
       "clip the global gradient norm to this (0 disables)")
      ("moe-expert-capacity-factor", po::value(&o.moe_capacity_factor)->default_value(o.moe_capacity_factor, "0")->value_name("F"),
       "mixture-of-experts models: each expert runs at most F x its even share of a "
       "micro-batch's token copies (the first in token order), the others are dropped and "
       "counted in the step records (Megatron's flag; 0: dropless, every token reaches its k "
       "experts)")
      ("moe-router-bias-update-rate",
       po::value(&o.moe_bias_update_rate)->default_value(o.moe_bias_update_rate, "0")->value_name("R"),
       "models whose router has a selection bias (DeepSeek-V3's e_score_correction_bias): after "
       "each step, move each expert's bias by R x sign(the mean load - its load), the load "
       "counted over the step's micro-batches and every data-parallel rank (DeepSeek-V3's "
       "auxiliary-loss-free balancing; Megatron's flag, whose default is 1e-3; 0: the bias "
       "stays as loaded)")
      ("seed", po::value(&o.seed)->default_value(o.seed)->value_name("N"),
       "seed of initialization, shuffling and sampling")
      ("precision", po::value(&o.precision)->value_name("DTYPE"),
       "fp32 | fp16 (with dynamic loss scaling) | bf16 | fp8 (default fp32 on CPU ranks; on GPUs "
       "the planner's: bf16 from compute capability 8.0, else fp16). fp8: bf16, with the "
       "projections of attention and of the dense MLPs on FP8 tensor cores (e4m3 activations and "
       "weights, e5m2 gradients, per-tensor scales from the current amax; compute capability "
       "8.9+), Transformer Engine's hybrid recipe")
      ("loss-scale-init", po::value(&o.loss_scaling.initial_scale)->default_value(o.loss_scaling.initial_scale, "65536")->value_name("S"),
       "fp16: the first loss scale")
      ("loss-scale-window", po::value(&o.loss_scaling.growth_interval)->default_value(o.loss_scaling.growth_interval)->value_name("N"),
       "fp16: clean steps in a row before the scale doubles")
      ("loss-scale-hysteresis", po::value(&o.loss_scaling.hysteresis)->default_value(o.loss_scaling.hysteresis)->value_name("N"),
       "fp16: overflows until the scale halves (DeepSpeed's hysteresis; every overflow skips its step)")
      ("min-loss-scale", po::value(&o.loss_scaling.min_scale)->default_value(o.loss_scaling.min_scale, "0")->value_name("S"),
       "fp16: the scale never halves below S (0: no floor)");
  return flags;
}

po::options_description hardware_flags(TrainOptions& o) {
  po::options_description flags("Hardware and plan (what is not given, the planner chooses on GPUs)");
  flags.add_options()
      ("device", po::value(&o.device)->default_value(o.device)->value_name("KIND"), "auto | cpu | cuda")
      ("gpus", po::value(&o.gpus)->value_name("N"),
       "ranks on this node (dp x tp x pp): GPUs, or on the CPU backend threads that act as ranks "
       "(default: every GPU found; 1 on CPU ranks)")
      ("threads", po::value(&o.threads)->default_value(o.threads)->value_name("N"),
       "CPU backend threads in all, shared by the ranks (0: all cores)")
      ("zero", po::value(&o.zero)->value_name("STAGE"),
       "ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters "
       "(default 0 on CPU ranks)")
      ("recompute", po::value(&o.recompute)->value_name("MODE"),
       "activation checkpointing: none | selective (layernorm, GELU) | full (whole layers) "
       "(default none on CPU ranks)")
      ("offload", po::value<std::string>()->implicit_value("optimizer")->value_name("WHAT"),
       "what lives in pinned host memory: optimizer (the fp32 master weights and Adam moments, "
       "and the step runs there; what a bare --offload means), params (the 16-bit parameters "
       "and gradients of every block, brought to the GPU block by block ahead of use), all "
       "(both), none. Default: none on CPU ranks; on GPUs the planner's choice (the parameters "
       "only where nothing else fits)")
      ("bf16-optimizer-states", po::bool_switch(&o.bf16_optimizer_states),
       "keep the Adam moments in bf16 (4 bytes a parameter instead of 8; the step itself in "
       "fp32), DeepSpeed's bf16.bf16_optimizer_states; needs --offload optimizer or all. It "
       "changes the numbers: not chosen by the planner")
      ("dp", po::value(&o.dp)->value_name("N"), "data parallel degree (--gpus = dp x tp x pp)")
      ("tp", po::value(&o.tp)->value_name("N"),
       "tensor parallel degree: Megatron-style splits of each layer over N consecutive ranks "
       "(default 1 on CPU ranks)")
      ("ep", po::value(&o.ep)->value_name("N"),
       "expert parallel degree for mixture-of-experts models: each MoE layer's experts split "
       "over N data-parallel ranks, tokens exchanged by all-to-all (DeepSpeed's ep_size, "
       "Megatron's --expert-model-parallel-size; N divides dp; default 1 on CPU ranks)")
      ("sequence-parallel", po::value(&o.sequence_parallel)->default_value(o.sequence_parallel, "true")->value_name("BOOL"),
       "with --tp > 1: split the activations outside the tensor-parallel regions along the "
       "tokens (less memory, the same numbers)")
      ("pp", po::value(&o.pp)->value_name("N"),
       "pipeline stages (--pp alone: one rank per stage; default 1 on CPU ranks)")
      ("pp-schedule", po::value(&o.pp_schedule)->default_value(o.pp_schedule)->value_name("KIND"),
       "pipeline schedule: 1f1b (at most pp micro-batches in flight) | gpipe (all forwards, then "
       "all backwards)")
      ("pp-split", po::value(&o.pp_split)->value_name("N,N,..."),
       "layers per pipeline stage, e.g. 7,7,7,7 (default: balanced, counting the embedding and "
       "the head)")
      ("global-batch-tokens", po::value(&o.global_batch_tokens)->value_name("K"),
       "tokens per optimizer step, for the planner (default: batch x seq-len x grad-accum x "
       "data-parallel ranks when given, else 524288)")
      ("topology", po::value(&o.topology_file)->value_name("FILE"),
       "plan for the machine this file describes (`dstrain topo --json`, or `nvidia-smi topo -m` text)")
      ("from-nvidia-smi", po::value(&o.nvidia_smi_file)->value_name("FILE|-"),
       "plan for the machine of this `nvidia-smi topo -m` text")
      ("gpu", po::value(&o.gpu_model)->value_name("NAME"), "the GPU model, for what the topology source does not say")
      ("host-memory", po::value(&o.host_memory)->value_name("SIZE"), "host RAM for the planner, e.g. 256G")
      ("gpu-memory", po::value(&o.gpu_memory)->value_name("SIZE"),
       "plan and run as if every GPU had only SIZE of memory, e.g. 24G: the planner plans for it "
       "and each rank's allocator refuses past it, naming what it was for (on CPU ranks: each "
       "rank's memory; default: what the GPU has)")
      ("comm-timeout", po::value(&o.comm_timeout)->default_value(o.comm_timeout, "600")->value_name("SECONDS"),
       "fail a rank stuck in a collective after this long");
  return flags;
}

po::options_description output_flags(TrainOptions& o) {
  po::options_description flags("Output and resume");
  flags.add_options()
      ("out", po::value(&o.out)->value_name("DIR"),
       "checkpoint directory (a final checkpoint is written there); it must be new or empty, "
       "unless --resume continues the run it holds or --overwrite replaces it")
      ("resume", po::value(&o.resume)->value_name("DIR|auto"),
       "continue from a checkpoint: a run directory (its newest checkpoint) or a step-NNNNNN in "
       "it; a directory with none yet starts the run there. auto: --out's newest checkpoint, or "
       "a new run (the same command restarts or continues a job)")
      ("overwrite", po::bool_switch(&o.overwrite),
       "start over in an --out that holds an earlier run (its checkpoints are removed) and "
       "replace an existing --log")
      ("save-every", po::value(&o.save_every)->default_value(o.save_every)->value_name("N"),
       "also checkpoint every N steps")
      ("keep-last", po::value(&o.keep_last)->default_value(o.keep_last)->value_name("N"),
       "keep only the newest N checkpoints of --out (and of --mirror), deleting older ones after "
       "each save once the new one reads back whole (0: all)")
      ("mirror", po::value(&o.mirror)->value_name("DIR"),
       "write each checkpoint to DIR as well (another disk or a network share): copied from "
       "--out, read back and verified, DIR/latest moved to it; a mirror that fails is said and "
       "the run goes on")
      ("save-dtype", po::value(&o.save_dtype)->default_value(o.save_dtype)->value_name("DTYPE"),
       "the checkpoint's model weights: fp32 | bf16 | fp16 | source (the --init-from weights' "
       "dtype; fp32 from scratch); optimizer state and fp32 master weights go to "
       "optimizer.safetensors")
      ("save-shard-size", po::value(&o.save_shard_size)->default_value(o.save_shard_size)->value_name("SIZE"),
       "checkpoint weights above SIZE go into shards with model.safetensors.index.json, as "
       "transformers writes them (0: one file)")
      ("log", po::value(&o.log)->value_name("FILE"),
       "JSONL log: one record per step and per eval (plot it with `dstrain report FILE`); an "
       "existing FILE is appended to by --resume, and refused otherwise (or --overwrite)")
      ("tensorboard", po::value(&o.tensorboard)->value_name("DIR"),
       "TensorBoard event files of every number the --log records hold (loss, eval_loss, lr, "
       "grad_norm, loss_scale, tokens_per_s, mfu, time/..., memory/..., expert_load/...): "
       "`tensorboard --logdir DIR`. A resumed run adds a file; a new one refuses DIR's event "
       "files of another run (or --overwrite removes them)")
      ("eval-every", po::value(&o.eval_every)->default_value(o.eval_every)->value_name("N"),
       "evaluate every N steps and at the end (0 disables)")
      ("eval-batches", po::value(&o.eval_batches)->default_value(o.eval_batches)->value_name("N"),
       "validation micro-batches per evaluation")
      ("sample", po::value(&o.sample_tokens)->default_value(o.sample_tokens)->value_name("N"),
       "tokens to sample at the end (0: none)")
      ("print-every", po::value(&o.print_every)->default_value(o.print_every)->value_name("N"),
       "keep a progress line every N steps (a terminal also shows every step in place; 0: about "
       "25 per run)")
      ("quiet", po::bool_switch(&o.quiet), "no progress lines")
      ("trace", po::value(&o.trace)->value_name("FILE"),
       "write a timeline of --trace-steps to FILE: Chrome trace JSON (open in ui.perfetto.dev or "
       "chrome://tracing), a track per rank and stream")
      ("trace-steps", po::value(&o.trace_steps)->default_value(o.trace_steps)->value_name("A:B"),
       "the steps --trace records (1-based, inclusive)")
      ("check-replicas", po::value(&o.check_replicas)->default_value(o.check_replicas)->value_name("N"),
       "every N steps, the ranks that must hold the same weights compare checksums; a difference "
       "stops the run naming the tensor, the step and the ranks (0: never)");
  return flags;
}

po::options_description node_flags(TrainOptions& o) {
  po::options_description flags(
      "Several machines (one dstrain per node, the same flags on every one; see README)");
  flags.add_options()
      ("nnodes", po::value<std::string>()->value_name("N"),
       "nodes in the run (default: NNODES, else torchrun's WORLD_SIZE: dstrain runs one process "
       "per node; else 1); --gpus counts one node's ranks")
      ("node-rank", po::value<std::string>()->value_name("R"),
       "this node's number, 0 to N-1 (default: NODE_RANK, else torchrun's GROUP_RANK, else RANK "
       "with one process per node)")
      ("master-addr", po::value<std::string>()->value_name("HOST"),
       "node 0's address, where the rendezvous runs (default: MASTER_ADDR)")
      ("master-port", po::value<std::string>()->value_name("PORT"),
       "the rendezvous port on node 0 (default: MASTER_PORT, else 29500)")
      ("rendezvous-timeout", po::value<std::string>()->value_name("SECONDS"),
       "how long nodes wait for each other to join (default 900)")
      (kInterNodeBandwidthFlag, po::value(&o.inter_node_bandwidth)->value_name("RATE"),
       kInterNodeBandwidthHelp)
      ("local_rank", po::value<int>()->value_name("R"),
       "DeepSpeed's launcher passes it: accepted and ignored (dstrain runs one process per node "
       "and starts its own ranks)")
      ("local-rank", po::value<int>()->value_name("R"), "the same as --local_rank (torch.distributed.launch)");
  return flags;
}

}  // namespace

po::options_description train_flags(TrainOptions& o) {
  po::options_description all;
  all.add(model_flags(o)).add(batch_flags(o)).add(optimizer_flags(o)).add(hardware_flags(o));
  all.add(node_flags(o)).add(output_flags(o));
  return all;
}

void print_usage(std::ostream& out, const po::options_description& flags) {
  out << "dstrain " << kDstrainVersion << ": " << kVersionLine << "\n\n"
      << "Usage:\n"
      << "  dstrain [train] [flags]                 train (the default command)\n"
      << "  dstrain prepare --input FILE.txt --out DIR [--tokenizer tokenizer.json]   tokenize text into shards\n"
      << "  dstrain prepare --chat FILE.jsonl --tokenizer DIR --out DIR               conversations into shards with loss masks\n"
      << "  dstrain topo [--json] [--from-nvidia-smi FILE --gpu NAME]   how the GPUs are wired\n"
      << "  dstrain plan --model M [--gpus N] [...]   choose a parallel plan (dstrain plan --help)\n"
      << "  dstrain bench comm [--gpus N] [--sizes 1K:256M] [...]   time the collectives (dstrain bench comm --help)\n"
      << "  dstrain report RUN.jsonl [MORE.jsonl ...] [--out report.html]   plot training logs (--log) as one HTML page\n"
      << "  dstrain verify DIR                      read a checkpoint back against its checksums\n"
      << "  dstrain --help | --version\n\n"
      << "With no flags, dstrain trains the tiny model on its built-in synthetic corpus.\n"
      << flags << "\n";
}

}  // namespace dstrain
