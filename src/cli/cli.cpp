#include "cli/cli.h"

#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "cli/commands.h"
#include "cli/config_file.h"
#include "cli/deepspeed_config.h"
#include "core/check.h"
#include "data/prepare.h"
#include "model/config.h"
#include "topology/cluster.h"
#include "train/cluster.h"
#include "train/trainer.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

constexpr const char* kVersion = "0.1.0";

std::string preset_list() {
  std::string list;
  for (const std::string& name : model_preset_names()) list += (list.empty() ? "" : ", ") + name;
  return list;
}

po::options_description train_flags(TrainOptions& o) {
  po::options_description model("Model and data");
  model.add_options()
      ("config", po::value<std::string>()->value_name("FILE"),
       "read flags from FILE: JSON with the flag names as keys (as OUT/run_config.json, which every "
       "run with --out writes), or `flag = value` lines; flags on the command line win")
      ("deepspeed-config", po::value<std::string>()->value_name("FILE"),
       "a DeepSpeed ds_config.json: its batch, ZeRO, offload, fp16/bf16, clipping, AdamW and "
       "WarmupLR/WarmupCosineLR settings as dstrain flags (printed); what dstrain cannot do is "
       "named; --config and command-line flags win")
      ("model", po::value(&o.model)->value_name("NAME|PATH"),
       ("a preset, or a Hugging Face config.json (gpt2, llama or qwen2) or the model directory holding it (default tiny; presets: " + preset_list() + ")").c_str())
      ("data", po::value(&o.data)->value_name("FILE|GLOB"),
       "token shards (llm.c .bin, raw .u16/.u32); default: the built-in synthetic corpus")
      ("val-data", po::value(&o.val_data)->value_name("FILE|GLOB"),
       "validation shards (default: the last 10% of --data)")
      ("shuffle", po::bool_switch(&o.shuffle), "shuffle the windows each epoch (seeded)")
      ("init-from", po::value(&o.init_from)->value_name("DIR|FILE"),
       "start from Hugging Face weights: a model directory (model.safetensors, or shards with "
       "model.safetensors.index.json), or one of those files; fp32/fp16/bf16 on disk");
  po::options_description optim("Batch and optimization");
  optim.add_options()
      ("batch", po::value(&o.batch)->default_value(o.batch)->value_name("B"), "sequences per micro-batch per data-parallel rank")
      ("seq-len", po::value(&o.seq_len)->default_value(o.seq_len)->value_name("T"), "tokens per sequence")
      ("grad-accum", po::value(&o.grad_accum)->default_value(o.grad_accum)->value_name("N"), "micro-batches per optimizer step")
      ("steps", po::value(&o.steps)->default_value(o.steps)->value_name("N"), "total optimizer steps of the run (a resume continues up to it)")
      ("lr", po::value(&o.lr)->default_value(o.lr, "0.003")->value_name("LR"), "peak learning rate")
      ("lr-schedule", po::value(&o.lr_schedule)->default_value(o.lr_schedule)->value_name("KIND"), "constant | cosine (both after a linear warmup)")
      ("warmup", po::value(&o.warmup)->default_value(o.warmup)->value_name("N"), "linear warmup steps")
      ("min-lr", po::value(&o.min_lr)->value_name("LR"), "floor of the cosine schedule (default lr/10)")
      ("weight-decay", po::value(&o.weight_decay)->default_value(o.weight_decay, "0.1"), "AdamW decoupled weight decay (matrices and embeddings only)")
      ("beta1", po::value(&o.beta1)->default_value(o.beta1, "0.9"), "AdamW beta1")
      ("beta2", po::value(&o.beta2)->default_value(o.beta2, "0.95"), "AdamW beta2")
      ("eps", po::value(&o.eps)->default_value(o.eps, "1e-8"), "AdamW epsilon")
      ("grad-clip", po::value(&o.grad_clip)->default_value(o.grad_clip, "1.0"), "clip the global gradient norm to this (0 disables)")
      ("seed", po::value(&o.seed)->default_value(o.seed), "seed of initialization, shuffling and sampling")
      ("precision", po::value(&o.precision)->default_value(o.precision), "fp32 | fp16 (with dynamic loss scaling) | bf16")
      ("loss-scale-init", po::value(&o.loss_scaling.initial_scale)->default_value(o.loss_scaling.initial_scale, "65536")->value_name("S"), "fp16: the first loss scale")
      ("loss-scale-window", po::value(&o.loss_scaling.growth_interval)->default_value(o.loss_scaling.growth_interval)->value_name("N"), "fp16: clean steps in a row before the scale doubles")
      ("loss-scale-hysteresis", po::value(&o.loss_scaling.hysteresis)->default_value(o.loss_scaling.hysteresis)->value_name("N"), "fp16: overflows until the scale halves (DeepSpeed's hysteresis; every overflow skips its step)")
      ("min-loss-scale", po::value(&o.loss_scaling.min_scale)->default_value(o.loss_scaling.min_scale, "0")->value_name("S"), "fp16: the scale never halves below S (0: no floor)");
  po::options_description hardware("Hardware");
  hardware.add_options()
      ("device", po::value(&o.device)->default_value(o.device), "auto | cpu | cuda")
      ("gpus", po::value(&o.gpus)->default_value(o.gpus)->value_name("N"), "number of ranks (dp x pp): GPUs, or on the CPU backend threads that act as ranks")
      ("threads", po::value(&o.threads)->default_value(o.threads)->value_name("N"), "CPU backend threads in all, shared by the ranks (0: all cores)")
      ("zero", po::value(&o.zero)->default_value(o.zero)->value_name("STAGE"), "ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters")
      ("recompute", po::value(&o.recompute)->default_value(o.recompute)->value_name("MODE"), "activation checkpointing: none | selective (layernorm, GELU) | full (whole layers)")
      ("offload", po::bool_switch(&o.offload), "keep fp32 master weights and Adam moments in host memory and step there")
      ("dp", po::value(&o.dp)->value_name("N"), "data parallel degree (the planner's; --gpus = dp x tp x pp)")
      ("micro-batch", po::value<int64_t>()->value_name("B"), "the same as --batch: sequences per micro-batch per rank")
      ("tp", po::value(&o.tp)->default_value(o.tp)->value_name("N"), "tensor parallel degree: Megatron-style splits of each layer over N consecutive ranks (default: the planner's; 1 without a GPU)")
      ("sequence-parallel", po::value(&o.sequence_parallel)->default_value(o.sequence_parallel)->value_name("BOOL"), "with --tp > 1: split the activations outside the tensor-parallel regions along the tokens (less memory, the same numbers)")
      ("pp", po::value(&o.pp)->default_value(o.pp)->value_name("N"), "pipeline stages (--gpus = dp x pp; --pp alone: one rank per stage)")
      ("pp-schedule", po::value(&o.pp_schedule)->default_value(o.pp_schedule)->value_name("KIND"), "pipeline schedule: 1f1b (at most pp micro-batches in flight) | gpipe (all forwards, then all backwards)")
      ("pp-split", po::value(&o.pp_split)->value_name("N,N,..."), "layers per pipeline stage, e.g. 7,7,7,7 (default: balanced, counting the embedding and the head)")
      ("global-batch-tokens", po::value(&o.global_batch_tokens)->value_name("K"), "tokens per optimizer step, for the planner (default: batch x seq-len x grad-accum x gpus, or 524288)")
      ("topology", po::value(&o.topology_file)->value_name("FILE"), "plan for the machine this file describes (`dstrain topo --json`, or `nvidia-smi topo -m` text)")
      ("from-nvidia-smi", po::value(&o.nvidia_smi_file)->value_name("FILE|-"), "plan for the machine of this `nvidia-smi topo -m` text")
      ("gpu", po::value(&o.gpu_model)->value_name("NAME"), "the GPU model, for what the topology source does not say")
      ("host-memory", po::value(&o.host_memory)->value_name("SIZE"), "host RAM for the planner, e.g. 256G")
      ("comm-timeout", po::value(&o.comm_timeout)->default_value(o.comm_timeout, "600")->value_name("SECONDS"), "fail a rank stuck in a collective after this long");
  po::options_description output("Output");
  output.add_options()
      ("log", po::value(&o.log)->value_name("FILE"), "JSONL log: one record per step and per eval (plot it with `dstrain report FILE`)")
      ("eval-every", po::value(&o.eval_every)->default_value(o.eval_every)->value_name("N"), "evaluate every N steps and at the end (0 disables)")
      ("eval-batches", po::value(&o.eval_batches)->default_value(o.eval_batches)->value_name("N"), "validation micro-batches per evaluation")
      ("out", po::value(&o.out)->value_name("DIR"), "checkpoint directory (a final checkpoint is written there)")
      ("save-every", po::value(&o.save_every)->default_value(o.save_every)->value_name("N"), "also checkpoint every N steps")
      ("save-shard-size", po::value(&o.save_shard_size)->default_value(o.save_shard_size)->value_name("SIZE"), "checkpoint weights above SIZE go into shards with model.safetensors.index.json, as transformers writes them (0: one file)")
      ("resume", po::value(&o.resume)->value_name("DIR"), "continue from a checkpoint (a run directory or a step-NNNNNN in it)")
      ("tokenizer", po::value(&o.tokenizer)->value_name("FILE"), "a Hugging Face tokenizer.json (the one `dstrain prepare --tokenizer` used): the sample at the end is decoded with it")
      ("sample", po::value(&o.sample_tokens)->default_value(o.sample_tokens)->value_name("N"), "tokens to sample at the end (0: none)")
      ("print-every", po::value(&o.print_every)->default_value(o.print_every)->value_name("N"), "keep a progress line every N steps (a terminal also shows every step in place; 0: about 25 per run)")
      ("quiet", po::bool_switch(&o.quiet), "no progress lines")
      ("trace", po::value(&o.trace)->value_name("FILE"), "write a timeline of --trace-steps to FILE: Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing), a track per rank and stream")
      ("trace-steps", po::value(&o.trace_steps)->default_value(o.trace_steps)->value_name("A:B"), "the steps --trace records (1-based, inclusive)")
      ("check-replicas", po::value(&o.check_replicas)->default_value(o.check_replicas)->value_name("N"), "every N steps, the ranks that must hold the same weights compare checksums; a difference stops the run naming the tensor, the step and the ranks (0: never)");
  po::options_description nodes("Several machines (one dstrain per node, the same flags on every one; see README)");
  nodes.add_options()
      ("nnodes", po::value<std::string>()->value_name("N"), "nodes in the run (default: NNODES, else WORLD_SIZE, else 1); --gpus counts one node's ranks")
      ("node-rank", po::value<std::string>()->value_name("R"), "this node's number, 0 to N-1 (default: NODE_RANK)")
      ("master-addr", po::value<std::string>()->value_name("HOST"), "node 0's address, where the rendezvous runs (default: MASTER_ADDR)")
      ("master-port", po::value<std::string>()->value_name("PORT"), "the rendezvous port on node 0 (default: MASTER_PORT, else 29500)")
      ("rendezvous-timeout", po::value<std::string>()->value_name("SECONDS"), "how long nodes wait for each other to join (default 900)")
      (kInterNodeBandwidthFlag, po::value(&o.inter_node_bandwidth)->value_name("RATE"), kInterNodeBandwidthHelp);
  po::options_description all;
  all.add(model).add(optim).add(hardware).add(nodes).add(output);
  return all;
}

void print_usage(std::ostream& out, const po::options_description& flags) {
  out << "dstrain " << kVersion << ": trains GPT-2 and LLaMA-family (Llama, DeepSeek, Qwen2) transformers on the GPUs (or CPU) of one machine or several\n\n"
      << "Usage:\n"
      << "  dstrain [train] [flags]                 train (the default command)\n"
      << "  dstrain prepare --input FILE.txt --out DIR [--tokenizer tokenizer.json]   tokenize text into shards\n"
      << "  dstrain topo [--json] [--from-nvidia-smi FILE --gpu NAME]   how the GPUs are wired\n"
      << "  dstrain plan --model M [--gpus N] [...]   choose a parallel plan (dstrain plan --help)\n"
      << "  dstrain bench comm [--gpus N] [--sizes 1K:256M] [...]   time the collectives (dstrain bench comm --help)\n"
      << "  dstrain report RUN.jsonl [MORE.jsonl ...] [--out report.html]   plot training logs (--log) as one HTML page\n"
      << "  dstrain --help | --version\n\n"
      << "With no flags, dstrain trains the tiny model on its built-in synthetic corpus.\n"
      << flags << "\n";
}

// Parses argv into `flags`; Boost's errors become one sentence.
po::variables_map parse(const std::vector<std::string>& args, const po::options_description& flags) {
  po::variables_map values;
  try {
    po::store(po::command_line_parser(args).options(flags).run(), values);
    po::notify(values);
  } catch (const po::unknown_option& error) {
    DSTRAIN_USER_ERROR() << "unknown flag " << error.get_option_name() << " (see dstrain --help)";
  } catch (const po::invalid_option_value& error) {
    DSTRAIN_USER_ERROR() << error.what() << " (see dstrain --help)";
  } catch (const po::error& error) {
    DSTRAIN_USER_ERROR() << error.what() << " (see dstrain --help)";
  }
  return values;
}

// The rendezvous flags given (checked, with the environment, by rendezvous_options).
RendezvousFlags rendezvous_flags(const po::variables_map& values) {
  RendezvousFlags flags;
  const auto take = [&values](const char* name, std::optional<std::string>& into) {
    if (values.count(name)) into = values[name].as<std::string>();
  };
  take("master-addr", flags.master_addr);
  take("master-port", flags.master_port);
  take("nnodes", flags.nnodes);
  take("node-rank", flags.node_rank);
  take("rendezvous-timeout", flags.timeout_seconds);
  return flags;
}

int run_train(const std::vector<std::string>& args, std::ostream& out) {
  TrainOptions options;
  options.model.clear();  // empty: tiny, or the checkpoint's model on --resume
  po::options_description flags = train_flags(options);
  flags.add_options()("help,h", "this help");
  po::variables_map values = parse(args, flags);
  if (values.count("help")) {
    print_usage(out, flags);
    return 0;
  }
  if (values.count("config")) store_config_file(values["config"].as<std::string>(), flags, values);
  std::optional<DeepSpeedMapping> deepspeed;
  if (values.count("deepspeed-config")) {
    const std::string path = values["deepspeed-config"].as<std::string>();
    deepspeed = map_deepspeed_config(path);
    out << "deepspeed config " << path << ":\n";
    for (const std::string& line : deepspeed->lines) out << "  " << line << "\n";
    store_flag_json(deepspeed->flags, "deepspeed config " + path, flags, values);
  }
  options.explicit_flags.emplace();
  for (const auto& [name, value] : values) {
    if (!value.defaulted()) options.explicit_flags->insert(name);
  }
  if (deepspeed) apply_train_batch_size(*deepspeed, *options.explicit_flags, options);
  options.rendezvous = rendezvous_options(rendezvous_flags(values), process_environment());
  if (values.count("micro-batch")) {
    DSTRAIN_USER_CHECK(!options.explicit_flags->count("batch"))
        << "--batch and --micro-batch are the same setting: give one";
    options.batch = values["micro-batch"].as<int64_t>();
    options.explicit_flags->insert("batch");
  }
  const TrainSummary summary = train(options, out);
  // Interrupted: the conventional exit code of the signal (the checkpoint, if any, is whole).
  return summary.interrupted_by != 0 ? 128 + summary.interrupted_by : 0;
}

int run_prepare(const std::vector<std::string>& args, std::ostream& out) {
  PrepareOptions options;
  po::options_description flags("dstrain prepare");
  flags.add_options()
      ("input", po::value(&options.inputs)->composing()->value_name("FILE.txt"), "text file to tokenize (repeat for several, tokenized in order)")
      ("out", po::value(&options.out_dir)->value_name("DIR"), "where train_*.bin and val_*.bin go")
      ("val-fraction", po::value(&options.val_fraction)->default_value(0.1, "0.1"), "share of the tokens held out for validation (0: train shards only)")
      ("tokenizer", po::value(&options.tokenizer_path)->value_name("tokenizer.json"),
       "a Hugging Face byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, DeepSeek kinds; UTF-8 input); "
       "ids as tokenizers' encode(text, add_special_tokens=False): no post-processor tokens such as "
       "<|begin_of_text|>. Default: bytes (vocabulary 256)")
      ("eot", po::bool_switch(&options.append_eot), "append the tokenizer's end-of-text token after each input file (<|endoftext|>, <|end_of_text|>, DeepSeek's end of sentence)")
      ("eot-token", po::value(&options.eot_token)->value_name("TOKEN"), "the token --eot appends instead (implies --eot)")
      ("help,h", "this help");
  const po::variables_map values = parse(args, flags);
  if (values.count("help")) {
    out << "Usage: dstrain prepare --input FILE.txt [--input ...] --out DIR [--tokenizer tokenizer.json [--eot]]\n"
        << flags << "\n";
    return 0;
  }
  DSTRAIN_USER_CHECK(!options.inputs.empty()) << "dstrain prepare needs --input FILE.txt";
  DSTRAIN_USER_CHECK(!options.out_dir.empty()) << "dstrain prepare needs --out DIR";
  if (!options.eot_token.empty()) options.append_eot = true;
  const PrepareResult result = prepare(options);
  const std::string& out_dir = options.out_dir;
  out << "wrote " << result.train_tokens << " training tokens (" << result.train_files.size()
      << " shard" << (result.train_files.size() == 1 ? "" : "s") << ") and "
      << result.val_tokens << " validation tokens to " << out_dir << " ("
      << (result.uint32_tokens ? "uint32" : "uint16") << " tokens, vocabulary "
      << result.vocab_size << ")\n"
      << "train with: dstrain --data '" << out_dir << "/train_*.bin'";
  if (!result.val_files.empty()) out << " --val-data '" << out_dir << "/val_*.bin'";
  out << "\n";
  return 0;
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && (args[0] == "--version" || args[0] == "version")) {
      out << "dstrain " << kVersion << "\n";
      return 0;
    }
    if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
      TrainOptions defaults;
      print_usage(out, train_flags(defaults));
      return 0;
    }
    std::string command = "train";
    if (!args.empty() && !args[0].starts_with("-")) {
      command = args[0];
      args.erase(args.begin());
    }
    if (command == "train") return run_train(args, out);
    if (command == "prepare") return run_prepare(args, out);
    if (command == "topo") return run_topo_command(args, out);
    if (command == "plan") return run_plan_command(args, out);
    if (command == "bench") return run_bench_command(args, out);
    if (command == "report") return run_report_command(args, out);
    DSTRAIN_USER_ERROR() << "unknown command '" << command
                         << "' (commands: train, prepare, topo, plan, bench, report; see dstrain --help)";
  } catch (const UserError& error) {
    out.flush();
    err << "dstrain: error: " << error.what() << "\n";
    return 2;
  } catch (const RunFailure& error) {
    out.flush();
    err << "dstrain: error: " << error.what() << "\n";
    return 1;
  } catch (const std::exception& error) {
    out.flush();
    err << "dstrain: internal error: " << error.what() << "\n";
    return 1;
  }
  return 1;
}

}  // namespace dstrain
