// How a run starts, before its ranks do: what --resume continues and what it takes from the
// checkpoint, what a new run's --init-from means, what --out and --log may hold, how long the
// run is, and the starting state on the host. Used by train() (train/trainer.cpp).
#pragma once

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/run_context.h"

namespace dstrain {

struct RunMachine;

// The hyper-parameters a resumed run must share with the run it continues: the global batch
// (sequences per step, whatever splits them), sequence length, shuffle, seed, precision, data,
// vocabulary.
nlohmann::json run_fingerprint(const TrainOptions& options, const Plan& plan,
                               const ModelConfig& config);

// --resume DIR|auto: the checkpoint it finds (ctx.resume; none: the run starts in that
// directory, as a job scheduler restarting the same command needs), the settings the run takes
// from it (train/options.h's apply_resumable_options; the plan's too on `machine` when it is
// the one the checkpoint's plan was made for), said on `out`. Checkpoints go on beside the one
// resumed unless --out is given. UserError for --resume auto without --out, --overwrite with
// --resume, a step directory that does not exist.
void open_resumed_run(RunContext& ctx, const RunMachine& machine, std::ostream& out);

// A new run: --init-from DIR with a config.json is that model unless --model says otherwise
// (UserError when there is none), and its tokenizer.json decodes the sample unless --tokenizer
// does.
void start_fresh_run(TrainOptions& options);

// Fine-tuning (--init-from): a learning rate for it unless --lr is given (kFineTuneLr*), and a
// given one above what the model family is usually fine-tuned at is a warning on `out`.
void fine_tuning_lr(TrainOptions& options, const ModelConfig& config, std::ostream& out);

// The model of a resumed run: its checkpoint's (a different --model is a UserError).
void take_resumed_run(RunContext& ctx);

// Node 0, before it writes anything: --out and --log hold no earlier run that this one would
// destroy (a new run, or a resumed one writing somewhere new), unless --overwrite says so
// (train/run_directory.h).
void claim_outputs(const RunContext& ctx, std::ostream& out);

// OUT/run_config.json: the run's settings as flags (the planner's choices included), so that
// `dstrain --config OUT/run_config.json` repeats it.
void write_run_config(const TrainOptions& options, const ModelConfig& config);

// The training data's loader for data-parallel rank `rank` of the plan (every stage's): B rows
// of T, rows of packed conversations, or one micro-batch of --batch-tokens a round.
LoaderOptions train_loader_options(const Plan& plan, int rank, bool shuffle, uint64_t seed);

// --packing auto resolved (on for chat data without --batch-tokens; plan.packed_sequences and
// plan.batch_tokens), then --epochs as --steps
// (whole steps of the training data, ctx.steps_per_epoch), the schedule's
// horizon (--lr-decay-steps: the run's --steps when not given), and on a resume past the
// horizon a line saying the learning rate holds at its floor.
void settle_run_length(RunContext& ctx, const Datasets& data, std::ostream& out);

// The files copied into every checkpoint, as (source, name there): the tokenizer the run was
// given (--tokenizer, as tokenizer.json, and the tokenizer files beside it), else the
// --init-from directory's, else (a resume) the resumed checkpoint's; generation_config.json
// from the same places.
std::vector<std::pair<std::string, std::string>> files_beside_weights(const RunContext& ctx);

// The starting point, on the host: a checkpoint (its fingerprint checked, the data position,
// the scaler), Hugging Face weights (what was loaded said on `out`), or a fresh init; resolves
// --save-dtype source to the weights' dtype.
void load_initial_state(RunContext& ctx, const ParamLayout& layout, FullTrainingState& initial,
                        std::ostream& out);

}  // namespace dstrain
