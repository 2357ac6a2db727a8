// Checkpoints on each rank (RankTrainer, train/rank_trainer.h): every rank writes its part of
// the same files, rank 0 commits them, then mirrors (--mirror) and applies --keep-last once the
// checkpoint reads back whole.
#include "core/format.h"
#include "train/checksums.h"
#include "train/checkpoint.h"
#include "train/cluster.h"
#include "train/mirror.h"
#include "train/rank_trainer.h"
#include "train/run_directory.h"

namespace dstrain {

// After checkpoint `written`: --mirror's copy (which reads it back), or with --keep-last its
// verification; --keep-last's removals in --out only once it reads back whole. The line to print.
std::string RankTrainer::after_save(const std::string& written) const {
  std::string line = "saved checkpoint " + written;
  std::optional<MirrorResult> mirrored;
  if (!options_.mirror.empty()) {
    mirrored = mirror_checkpoint(written, options_.mirror, options_.keep_last);
  }
  if (options_.keep_last == 0 && !mirrored) return line;
  const std::string damage = mirrored && mirrored->source_read ? mirrored->source_damage
                                                               : verify_checkpoint(written).damage;
  if (damage.empty()) {
    line += " (verified";
    const std::vector<int64_t> removed =
        keep_last_checkpoints(options_.out, options_.keep_last, written);
    if (!removed.empty()) {
      line += "; --keep-last " + std::to_string(options_.keep_last) + ": removed " +
              count_of(static_cast<long long>(removed.size()), "older checkpoint");
    }
    line += ")";
  } else {
    line += ", but it reads back damaged (" + damage + ")";
    if (options_.keep_last > 0) {
      line += ": --keep-last " + std::to_string(options_.keep_last) + " removed no older checkpoint";
    }
  }
  if (mirrored) line += "; " + describe_mirror(*mirrored);
  return line;
}

void RankTrainer::save_checkpoint(int64_t step) {
  // Each rank writes its own part of the same files, in parallel: its shard of the blocks its
  // stage holds (the last stage's copy of the tied embedding is the first stage's, not written).
  // Rank 0 stages the directory; on other nodes each rank joins it (the same tag: shared storage).
  const bool leader = rank_ == 0;
  const std::string tag = ctx_.cluster != nullptr ? ctx_.cluster->checkpoint_tag() : "";
  if (leader) {
    *ctx_.checkpoint = std::make_unique<CheckpointWriter>(options_.out, step + 1, config_,
                                                          ctx_.checkpoint_format, tag);
  }
  world_.barrier();
  std::unique_ptr<CheckpointWriter> joined;
  if (ctx_.devices.first_rank != 0) {
    joined = CheckpointWriter::join(options_.out, step + 1, config_, ctx_.checkpoint_format, tag);
  }
  const CheckpointWriter& writer = joined ? *joined : **ctx_.checkpoint;
  // Under tp each rank writes its slices where they lie in the full tensors; the replicated
  // tensors (the same on every tp rank) come from tp index 0.
  CheckpointWriter::Part part;
  part.layout = &arch_->layout();
  part.tp_rank = groups_.tensor_index;
  part.replicated = groups_.tensor_index == 0;
  for (int block = 0; block < state_->num_blocks(); ++block) {
    const bool mine = state_->writes(block);
    part.begin.push_back(mine ? state_->shard_begin(block) : 0);
    part.params.push_back(mine ? state_->master_part(block) : Tensor());
    part.exp_avg.push_back(mine ? state_->moment_part(0, block) : Tensor());
    part.exp_avg_sq.push_back(mine ? state_->moment_part(1, block) : Tensor());
  }
  writer.write_part(part);
  world_.barrier();
  if (leader) {
    const nlohmann::json trainer{{"step", step + 1},          {"adam_step", adam_step_},
                                 {"data", loader_->state()},  {"scaler", scaler_.state()},
                                 {"run", ctx_.fingerprint},   {"seed", options_.seed},
                                 {"plan", to_json(plan_)},    {"machine", ctx_.machine},
                                 {"options", resumable_options(options_)}};
    ctx_.summary->checkpoint = (*ctx_.checkpoint)->finish(trainer);
    ctx_.checkpoint->reset();
    ctx_.progress->message(after_save(ctx_.summary->checkpoint));
  }
  world_.barrier();  // nobody runs ahead of a checkpoint that failed on rank 0
}

}  // namespace dstrain
