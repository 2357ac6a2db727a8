#include "train/run_start.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <set>

#include "core/format.h"
#include "core/fs.h"
#include "train/checksums.h"
#include "train/cluster.h"
#include "train/plan_run.h"
#include "train/run_directory.h"

namespace dstrain {

namespace {

// What names each fingerprint entry in a sentence.
std::string fingerprint_name(const std::string& key) {
  if (key == "global_batch") return "a global batch of";
  if (key == "seq_len") return "--seq-len";
  if (key == "vocab_size") return "vocab_size";
  return "--" + key;
}

// The directory of --init-from (its weights' directory for a file).
std::filesystem::path init_directory(const std::string& init_from) {
  std::error_code error;
  const std::filesystem::path path(init_from);
  return std::filesystem::is_directory(path, error) ? path : path.parent_path();
}

// A resumed checkpoint is read back against its checksums before it loads (one written before
// dstrain recorded them loads unchecked). Damaged: one sentence naming the file, and the run's
// newest whole checkpoint to resume from instead: in --out, or --mirror's copy (the same step
// or an older one) to copy back.
void verify_resumed(const CheckpointInfo& info, const std::string& mirror) {
  const Verification v = verify_checkpoint(info.dir);
  if (v.damage.empty()) return;
  const int64_t step = info.trainer_state["step"].get<int64_t>();
  std::vector<CheckpointEntry> candidates;
  for (const CheckpointEntry& entry : list_checkpoints(run_directory_of(info.dir))) {
    if (entry.step < step) candidates.push_back(entry);
  }
  if (!mirror.empty()) {
    for (const CheckpointEntry& entry : list_checkpoints(std::filesystem::absolute(mirror))) {
      if (entry.step <= step && !same_directory(entry.dir, info.dir)) candidates.push_back(entry);
    }
  }
  // Newest first; of one step, --out's before the mirror's (stable).
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step > b.step; });
  const std::filesystem::path run = run_directory_of(info.dir);
  for (const CheckpointEntry& entry : candidates) {
    const Verification older = verify_checkpoint(entry.dir);
    if (!older.has_checksums || !older.damage.empty()) continue;
    if (same_directory(run_directory_of(entry.dir), run)) {
      DSTRAIN_USER_ERROR() << "checkpoint " << info.dir << " is damaged: " << v.damage
                           << "; the newest whole one is " << entry.dir.string()
                           << ": remove the damaged one and continue with --resume "
                           << entry.dir.string();
    }
    const std::filesystem::path back = run / entry.dir.filename();
    DSTRAIN_USER_ERROR() << "checkpoint " << info.dir << " is damaged: " << v.damage
                         << "; the newest whole one is --mirror's copy " << entry.dir.string()
                         << ": remove the damaged one, copy that back (cp -r "
                         << entry.dir.string() << " " << run.string()
                         << "/) and continue with --resume " << back.string();
  }
  DSTRAIN_USER_ERROR() << "checkpoint " << info.dir << " is damaged: " << v.damage
                       << "; no earlier checkpoint of the run is whole";
}

// --resume DIR|auto: the checkpoint it finds, or none yet (a job's first start: the run begins
// in that directory, as the same command restarted by a scheduler needs).
std::optional<CheckpointInfo> find_resumed_checkpoint(TrainOptions& options, std::ostream& out) {
  const bool automatic = options.resume == "auto";
  DSTRAIN_USER_CHECK(!automatic || !options.out.empty())
      << "--resume auto continues the run in --out: give --out DIR";
  DSTRAIN_USER_CHECK(!options.overwrite)
      << "--overwrite starts the run over and --resume continues it: give one of them";
  const std::string where = automatic ? options.out : options.resume;
  if (const std::optional<std::filesystem::path> found = find_checkpoint(where)) {
    CheckpointInfo info = open_checkpoint(found->string());
    verify_resumed(info, options.mirror);
    return info;
  }
  DSTRAIN_USER_CHECK(!std::filesystem::path(where).filename().string().starts_with("step-"))
      << "--resume " << where << ": there is no such checkpoint";
  DSTRAIN_USER_CHECK(options.out.empty() || same_directory(options.out, where))
      << "--resume " << where << " holds no checkpoint (and --out is " << options.out
      << "): give the run directory to continue, or --resume auto with --out";
  options.out = where;
  out << "dstrain: no checkpoint in " << where << " yet: the run starts there\n";
  return std::nullopt;
}

// Whether this run's machine is the one the checkpoint's plan was made for (its record in
// trainer.json; a checkpoint of an earlier version: the same rank count).
bool same_machine(const RunContext& ctx, const RunMachine& machine, const nlohmann::json& saved) {
  const TrainOptions& options = ctx.options;
  const int nnodes = options.rendezvous.nnodes;
  const int saved_ranks = saved.value("gpus", 1);
  int ranks = saved_ranks;
  if (given_flag(options, "gpus")) {
    ranks = options.gpus;
  } else if (machine.topology) {
    ranks = machine.topology->gpu_count() * nnodes;
  }
  const nlohmann::json& trainer = ctx.resume->trainer_state;
  const bool cpu = !machine.topology || options.device == "cpu";
  if (!trainer.contains("machine")) return ranks == saved_ranks;
  const nlohmann::json now = machine_record(machine, cpu, ranks, nnodes);
  const nlohmann::json& then = trainer["machine"];
  // CPU ranks are threads of the processes: only their count makes the plan.
  if (cpu && then.value("device", "") == "cpu") return now["ranks"] == then.value("ranks", -1);
  return now == then;
}

// What the resumed run took from its checkpoint and what it plans anew, in a few lines.
void say_resumed_settings(const RunContext& ctx, const ResumedSettings& taken, std::ostream& out) {
  const TrainOptions& options = ctx.options;
  out << "dstrain: resuming " << ctx.resume->dir << ": from the checkpoint the global batch ("
      << taken.global_batch << " sequences of " << options.seq_len
      << " tokens), the data position, the optimizer and the schedule ("
      << options.lr_schedule << " to step " << options.lr_decay_steps << ")";
  if (taken.plan_taken) {
    out << " and the plan (the same machine)\n";
  } else {
    const nlohmann::json& trainer = ctx.resume->trainer_state;
    const int64_t ranks = trainer.contains("machine")
                              ? trainer["machine"].value("ranks", int64_t{0})
                              : trainer.value("options", nlohmann::json::object()).value("gpus", int64_t{0});
    out << "; the plan is made anew for this machine (the checkpoint's was for "
        << count_of(ranks, "rank") << ")\n";
  }
  for (const std::string& change : taken.changed) {
    out << "dstrain: " << change << " from step " << ctx.resume->trainer_state["step"].get<int64_t>() + 1
        << " on, as given\n";
  }
}

void check_fingerprint(const RunContext& ctx) {
  const nlohmann::json& trainer = ctx.resume->trainer_state;
  if (!trainer.contains("run")) return;
  nlohmann::json saved = trainer["run"];
  if (!saved.contains("global_batch") && saved.contains("batch") &&
      saved.contains("micro_batches_per_step")) {  // a checkpoint of an earlier version
    saved["global_batch"] =
        saved["batch"].get<int64_t>() * saved["micro_batches_per_step"].get<int64_t>();
  }
  for (const auto& [key, value] : ctx.fingerprint.items()) {
    if (!saved.contains(key)) continue;
    const bool batch = key == "global_batch";
    DSTRAIN_USER_CHECK(saved[key] == value)
        << "checkpoint " << ctx.resume->dir << " was trained with " << fingerprint_name(key)
        << " " << saved[key].dump() << (batch ? " sequences per step" : "") << ", this run has "
        << value.dump() << "; " << (batch ? "the global batch" : fingerprint_name(key))
        << " is part of the run: resume with the same, or start a new run from its weights "
        << "with --init-from " << ctx.resume->dir;
  }
}

// "loaded 291 tensors, 2.47 GB bf16, from 3 shards of DIR".
void say_loaded(const LoadedWeights& loaded, const std::string& from, std::ostream& out) {
  // Decimal units, as the hub lists model sizes.
  const double bytes = static_cast<double>(loaded.bytes);
  char size[32];
  if (bytes >= 1e9) {
    std::snprintf(size, sizeof size, "%.2f GB", bytes / 1e9);
  } else if (bytes >= 1e6) {
    std::snprintf(size, sizeof size, "%.1f MB", bytes / 1e6);
  } else {
    std::snprintf(size, sizeof size, "%.1f kB", bytes / 1e3);
  }
  out << "dstrain: loaded " << count_of(static_cast<long long>(loaded.tensors), "tensor") << ", "
      << size << " " << loaded.dtypes << ", from "
      << (loaded.files == 1 ? std::string("one file") : count_of(static_cast<long long>(loaded.files), "shard"))
      << " of " << from << "\n";
  if (loaded.skipped > 0) {
    out << "dstrain: skipped " << count_of(static_cast<long long>(loaded.skipped), "tensor")
        << " of the multi-token prediction layers (num_nextn_predict_layers), which dstrain does "
           "not train; checkpoints leave them out\n";
  }
}

// --save-dtype source: the dtype the --init-from weights came in (most of their bytes), fp32
// for a model trained from scratch; resolved once, so a resume keeps it.
void resolve_save_dtype(TrainOptions& options, std::optional<DType> source) {
  if (options.save_dtype != "source") return;
  options.save_dtype = source ? precision_name(*source) : "fp32";
}

}  // namespace

// The hyper-parameters a resumed run must share with the run it continues.
nlohmann::json run_fingerprint(const TrainOptions& options, const Plan& plan,
                               const ModelConfig& config) {
  // Ranks, pipeline, micro-batch and accumulation may change on resume as long as the
  // sequences per step do: the same sequences make each step (data/loader.h).
  return nlohmann::json{
      {"global_batch", plan.micro_batch * plan.grad_accum * plan.dp},
      {"seq_len", options.seq_len},
      {"shuffle", options.shuffle},
      {"seed", options.seed},
      {"precision", options.precision},
      {"data", options.data.empty() ? "synthetic" : options.data},
      {"vocab_size", config.vocab_size}};
}

// A new run: --init-from DIR with a config.json is that model unless --model says otherwise,
// and its tokenizer.json decodes the sample unless --tokenizer does.
void start_fresh_run(TrainOptions& options) {
  if (options.init_from.empty()) return;
  const std::filesystem::path dir = init_directory(options.init_from);
  std::error_code error;
  if (options.model.empty()) {
    DSTRAIN_USER_CHECK(std::filesystem::is_regular_file(dir / "config.json", error))
        << "--init-from " << options.init_from << " has no config.json beside its weights: give "
        << "--model (the preset or config.json the weights are for)";
    options.model = dir.string();
  }
  if (options.tokenizer.empty() && std::filesystem::is_regular_file(dir / "tokenizer.json", error)) {
    options.tokenizer = (dir / "tokenizer.json").string();
  }
}

// Fine-tuning (--init-from): a learning rate for it unless --lr is given, and a given one above
// what the model family is usually fine-tuned at is a warning (a toy corpus's default is not).
void fine_tuning_lr(TrainOptions& options, const ModelConfig& config, std::ostream& out) {
  if (options.init_from.empty()) return;
  const bool gpt2 = config.type == ModelType::Gpt2;
  const double usual = gpt2 ? kFineTuneLrGpt2 : kFineTuneLrLlama;
  const double high = gpt2 ? 5e-4 : 1e-4;
  if (!given_flag(options, "lr")) {
    options.lr = usual;
    out << "dstrain: fine-tuning " << (gpt2 ? "GPT-2" : "a LLaMA-family model") << " at --lr "
        << usual << " (give --lr to choose)\n";
  } else if (options.lr > high) {
    out << "dstrain: warning: --lr " << options.lr << " is above what "
        << (gpt2 ? "GPT-2" : "LLaMA-family models (Llama, Qwen2, DeepSeek)")
        << " are usually fine-tuned at (up to " << high << "; dstrain's default for them is "
        << usual << "); a rate this high may wreck the pretrained weights\n";
  }
}

// The Python files config.json's auto_map names (a model whose code ships with its checkpoints,
// trust_remote_code: DeepSeek's "modeling_deepseek.DeepseekV3ForCausalLM"): each value's module,
// a plain name in the same directory (not "other/repo--module.Class", which names another repo).
static std::vector<std::string> auto_map_modules(const nlohmann::json& config) {
  std::vector<std::string> files;
  if (!config.contains("auto_map") || !config["auto_map"].is_object()) return files;
  const auto add = [&](const nlohmann::json& value) {
    if (!value.is_string()) return;
    const std::string target = value.get<std::string>();
    const size_t dot = target.rfind('.');
    if (dot == std::string::npos || dot == 0) return;
    const std::string module = target.substr(0, dot);
    const bool plain = std::all_of(module.begin(), module.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
    });
    if (plain && std::find(files.begin(), files.end(), module + ".py") == files.end()) {
      files.push_back(module + ".py");
    }
  };
  for (const auto& [key, value] : config["auto_map"].items()) {
    if (value.is_array()) {
      for (const nlohmann::json& item : value) add(item);
    } else {
      add(value);
    }
  }
  return files;
}

// The files copied into every checkpoint, as (source, name there): the tokenizer the run was
// given (--tokenizer, as tokenizer.json, and the tokenizer files beside it), else the
// --init-from directory's, else (a resume) the resumed checkpoint's; generation_config.json and
// the model code config.json's auto_map names from the same places.
std::vector<std::pair<std::string, std::string>> files_beside_weights(const RunContext& ctx) {
  const TrainOptions& options = ctx.options;
  std::vector<std::filesystem::path> sources;
  if (!options.tokenizer.empty()) {
    sources.push_back(std::filesystem::path(options.tokenizer).parent_path());
  }
  if (!options.init_from.empty()) sources.push_back(init_directory(options.init_from));
  if (ctx.resume) sources.push_back(ctx.resume->dir);
  std::vector<std::pair<std::string, std::string>> files;
  std::set<std::string> names;
  const auto add = [&](const std::filesystem::path& path, const std::string& name) {
    if (names.insert(name).second) files.emplace_back(path.string(), name);
  };
  if (!options.tokenizer.empty()) add(options.tokenizer, "tokenizer.json");
  std::error_code error;
  std::vector<std::string> wanted = {"tokenizer.json",    "tokenizer_config.json",
                                     "special_tokens_map.json", "tokenizer.model",
                                     "vocab.json",        "merges.txt",
                                     "added_tokens.json", "generation_config.json"};
  for (const std::string& module : auto_map_modules(ctx.config.passthrough)) {
    wanted.push_back(module);
  }
  for (const std::string& name : wanted) {
    for (const std::filesystem::path& dir : sources) {
      if (std::filesystem::is_regular_file(dir / name, error)) {
        add(dir / name, name);
        break;
      }
    }
  }
  return files;
}

LoaderOptions train_loader_options(const Plan& plan, int rank, bool shuffle, uint64_t seed) {
  LoaderOptions o;
  o.batch = plan.batch_tokens > 0 ? 1 : plan.micro_batch;
  o.seq_len = plan.seq_len;
  o.ranks = plan.dp;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = seed;
  o.sequences_per_step = o.batch * plan.dp * plan.grad_accum;
  o.packing = plan.packed_sequences;
  o.batch_tokens = plan.batch_tokens;
  o.width_multiple = plan.token_batch_width_multiple();
  return o;
}

// --batch-tokens against the data and the plan (plan.batch_tokens).
void resolve_batch_tokens(const TrainOptions& options, Plan& plan, const Datasets& data,
                          std::ostream& out) {
  if (options.batch_tokens == 0) return;
  DSTRAIN_USER_CHECK(data.train.masked())
      << "--batch-tokens fills micro-batches with whole conversations: it needs chat data "
      << "(prepare --chat), and " << data.description << " is text";
  const int64_t multiple = plan.token_batch_width_multiple();
  DSTRAIN_USER_CHECK(!plan.uses_sequence_parallel() || plan.seq_len % plan.tp == 0)
      << "--batch-tokens with sequence parallelism needs --seq-len " << plan.seq_len
      << " to be a multiple of --tp " << plan.tp;
  plan.batch_tokens = options.batch_tokens;
  out << "dstrain: micro-batches of up to " << plan.batch_tokens << " positions: "
      << count_sequences(data.train, train_loader_options(plan, 0, false, 0))
      << " of one conversation per row, rows as wide as "
      << "their longest (a multiple of " << multiple << ", at most " << plan.seq_len << ")\n";
}

// --packing auto as on or off: on for chat data without --batch-tokens. `on` with text data is
// one sentence.
void resolve_packing(TrainOptions& options, Plan& plan, const Datasets& data, std::ostream& out) {
  const bool chat = data.train.masked();
  DSTRAIN_USER_CHECK(chat || options.packing != "on")
      << "--packing on packs conversations: it needs chat data (prepare --chat), and "
      << data.description << " is text";
  if (options.packing == "auto") options.packing = chat && options.batch_tokens == 0 ? "on" : "off";
  plan.packed_sequences = options.packing == "on";
  resolve_batch_tokens(options, plan, data, out);
  if (options.packing != "on") return;
  const ConversationIndex& index = *data.train.conversations(plan.seq_len);
  const PackedRows rows = pack_conversations(index, plan.seq_len);
  const int64_t positions = index.tokens - static_cast<int64_t>(index.conversations.size());
  out << "dstrain: packing " << index.conversations.size() << " conversations into "
      << rows.rows() << " rows of " << plan.seq_len << " (" << std::fixed << std::setprecision(1)
      << 100.0 * static_cast<double>(positions) / static_cast<double>(rows.rows() * plan.seq_len)
      << "% of their positions filled)\n"
      << std::defaultfloat;
}

// --epochs as steps, the schedule's horizon, and how the run covers the data, said once.
void settle_run_length(RunContext& ctx, const Datasets& data, std::ostream& out) {
  TrainOptions& options = ctx.options;
  const Plan& plan = ctx.plan;
  resolve_packing(options, ctx.plan, data, out);
  const LoaderOptions geometry = train_loader_options(plan, 0, false, 0);
  ctx.steps_per_epoch = count_sequences(data.train, geometry) / geometry.sequences_per_step;
  if (options.epochs > 0) {
    options.steps = std::max<int64_t>(
        1, std::llround(options.epochs * static_cast<double>(std::max<int64_t>(1, ctx.steps_per_epoch))));
  }
  if (options.lr_decay_steps == 0) options.lr_decay_steps = options.steps;
  if (ctx.resume && options.lr_schedule != "constant" && options.lr_schedule != "warmup-lr" &&
      options.steps > options.lr_decay_steps &&
      options.explicit_flags) {
    out << "dstrain: the learning rate reaches its floor " << options.min_lr << " at step "
        << options.lr_decay_steps << " (--lr-decay-steps, the run's first horizon) and holds "
        << "there to step " << options.steps << "\n";
  }
}

// The checkpoint --resume continues (if any), and the settings the run takes from it.
void open_resumed_run(RunContext& ctx, const RunMachine& machine, std::ostream& out) {
  TrainOptions& options = ctx.options;
  if (options.resume.empty()) return;
  ctx.resume_asked = true;
  ctx.resume = find_resumed_checkpoint(options, out);
  options.resume = ctx.resume ? ctx.resume->dir : "";
  if (!ctx.resume) return;
  const nlohmann::json& trainer = ctx.resume->trainer_state;
  const nlohmann::json saved = trainer.value("options", nlohmann::json::object());
  const ResumedSettings taken =
      apply_resumable_options(options, saved, same_machine(ctx, machine, saved));
  // Checkpoints go on beside the one resumed, unless --out says elsewhere.
  if (!given_flag(options, "out")) options.out = run_directory_of(ctx.resume->dir).string();
  // The first run's command line repeated with --resume (DeepSpeed's and the HF Trainer's
  // habit): the checkpoint's weights win.
  if (!options.init_from.empty()) {
    out << "dstrain: --init-from " << options.init_from << " is ignored: the run resumes from "
        << ctx.resume->dir << "\n";
    options.init_from.clear();
  }
  if (options.explicit_flags) say_resumed_settings(ctx, taken, out);
}

// --mirror DIR (not --out: claim_outputs checked), before anything is written: a run's own
// mirror when it continues (the run resumed in --out, or from a checkpoint in DIR itself after
// --out was lost), its staging left by a kill removed; else claimed like a new --out.
void claim_mirror(const RunContext& ctx, bool continuing_there, std::ostream& out) {
  const TrainOptions& options = ctx.options;
  if (options.mirror.empty()) return;
  const bool from_mirror =
      ctx.resume && same_directory(options.mirror, run_directory_of(ctx.resume->dir));
  if (!(continuing_there || from_mirror)) {
    claim_out_directory(options.mirror, options.overwrite, out, "--mirror");
    return;
  }
  if (ctx.resume) {
    const int64_t step = ctx.resume->trainer_state["step"].get<int64_t>();
    const std::vector<CheckpointEntry> mirrored = list_checkpoints(options.mirror);
    DSTRAIN_USER_CHECK(mirrored.empty() || mirrored.back().step <= step)
        << "--mirror " << options.mirror << " holds " << mirrored.back().dir.filename().string()
        << ", newer than the checkpoint resumed (" << ctx.resume->dir << "), which this run's "
        << "steps would replace: give a new --mirror, or resume the newest";
  }
  remove_stale_staging(options.mirror, out);
}

// A run resumed in its own --out from an older checkpoint: its next steps would replace the
// newer ones.
void refuse_older_resume(const RunContext& ctx) {
  const TrainOptions& options = ctx.options;
  const int64_t step = ctx.resume->trainer_state["step"].get<int64_t>();
  const std::vector<CheckpointEntry> checkpoints = list_checkpoints(options.out);
  DSTRAIN_USER_CHECK(checkpoints.empty() || checkpoints.back().step <= step)
      << "--resume " << ctx.resume->dir << " is older than the run's newest checkpoint, "
      << checkpoints.back().dir.filename().string() << ", which its steps would replace: give "
      << "a new --out to branch from it, or --resume " << options.out << " to continue the newest";
}

// Node 0, before it writes anything: --out, --mirror, --log and --tensorboard hold no earlier
// run that this one would destroy (a new run, or a resumed one writing somewhere new), unless
// --overwrite says so. Only --overwrite removes anything, after the checks that need none.
void claim_outputs(const RunContext& ctx, std::ostream& out) {
  const TrainOptions& options = ctx.options;
  const bool continuing_there =
      ctx.resume_asked &&
      (!ctx.resume || same_directory(options.out, run_directory_of(ctx.resume->dir)));
  DSTRAIN_USER_CHECK(options.mirror.empty() || !same_directory(options.mirror, options.out))
      << "--mirror " << options.mirror << " is --out itself: give a directory on another disk "
      << "or a network share";
  if (continuing_there && ctx.resume) refuse_older_resume(ctx);
  if (!continuing_there) claim_out_directory(options.out, options.overwrite, out);
  check_log_file(options.log, ctx.resume_asked, options.overwrite);
  claim_mirror(ctx, continuing_there, out);
  claim_tensorboard_directory(options.tensorboard, ctx.resume_asked, options.overwrite);
  if (continuing_there) remove_stale_staging(options.out, out);
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

// The starting point, on the host: a checkpoint, Hugging Face weights, or a fresh init.
void load_initial_state(RunContext& ctx, const ParamLayout& layout, FullTrainingState& initial,
                        std::ostream& out) {
  TrainOptions& options = ctx.options;
  if (ctx.resume) {
    check_fingerprint(ctx);
    const nlohmann::json& trainer = ctx.resume->trainer_state;
    load_checkpoint(*ctx.resume, initial);
    ctx.have_moments = true;
    ctx.first_step = trainer["step"].get<int64_t>();
    DSTRAIN_USER_CHECK(trainer.contains("data"))
        << "checkpoint " << ctx.resume->dir << " has no data position in trainer.json";
    ctx.data_state = trainer["data"];
    DSTRAIN_USER_CHECK(!trainer.contains("adam_step") || trainer["adam_step"].is_number_integer())
        << "checkpoint " << ctx.resume->dir << " has a trainer.json whose adam_step "
        << trainer["adam_step"].dump() << " is not an integer";
    ctx.first_adam_step = trainer.value("adam_step", ctx.first_step);
    if (trainer.contains("scaler")) ctx.scaler_state = trainer["scaler"];
    DSTRAIN_USER_CHECK(ctx.first_step < options.steps)
        << "checkpoint " << ctx.resume->dir << " is at step " << ctx.first_step
        << ", which already reaches --steps " << options.steps << "; raise --steps to train on";
    resolve_save_dtype(options, std::nullopt);
  } else if (!options.init_from.empty()) {
    const LoadedWeights loaded = load_weights(layout, initial.params, options.init_from);
    if (ctx.cluster->node_rank() == 0) say_loaded(loaded, options.init_from, out);
    resolve_save_dtype(options, loaded.dtype);
  } else {
    init_model_parameters(layout, ctx.config, options.seed, initial.params.tensors());
    resolve_save_dtype(options, std::nullopt);
  }
  ctx.initial = &initial;
  ctx.checkpoint_format.weights_dtype = parse_dtype(options.save_dtype);
}

}  // namespace dstrain
