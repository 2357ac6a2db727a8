// The end of a run on each rank (RankTrainer, train/rank_trainer.h): the full weights gathered
// on rank 0 for the sample, the summary record and line, and the sample (of chat data: a reply
// to the first validation conversation's prompt).
#include <signal.h>

#include <algorithm>
#include <sstream>

#include "data/tokenizer.h"
#include "train/rank_trainer.h"
#include "train/sample.h"

namespace dstrain {

// Every block's full weights on rank 0, block by block in order: the block's stage gathers it
// over its data-parallel groups (the experts' over the ranks holding the same experts), then
// its ranks of data-parallel index 0 (for the experts' blocks, of each ep rank's index) send
// their tp slices to rank 0, which puts them in place. Off rank 0 a rank holds one block at a
// time.
void RankTrainer::gather_full_weights_on_leader(const HostBlocks& gathered) {
  const ParamLayout& local = arch_->layout();
  const bool sliced = !local.whole();
  const ParamLayout& held_layout = sliced ? local : full_layout_;
  // Each ep rank's layout (which experts its blocks hold), made on rank 0 as needed.
  std::vector<std::unique_ptr<ParamLayout>> ep_layouts(static_cast<size_t>(plan_.ep));
  auto layout_of = [&](int e) -> const ParamLayout& {
    if (plan_.ep == 1 || e == groups_.expert_index) return local;
    auto& layout = ep_layouts[static_cast<size_t>(e)];
    if (!layout) layout = std::make_unique<ParamLayout>(config_, plan_.tp, plan_.ep, e);
    return *layout;
  };
  for (int block = 0; block < state_->num_blocks(); ++block) {
    const int stage = owner_stage(block);
    // This rank's part: rank 0's whole block straight into place, else a buffer of the block.
    std::optional<HostBlocks> mine;
    if (groups_.stage == stage) {
      if (rank_ != 0 || sliced) mine.emplace(held_layout, std::vector<int>{block});
      state_->get_full_param_block(block, (mine ? *mine : gathered).block(block));
    }
    const int holders = local.expert_layer(block) >= 0 ? plan_.ep : 1;
    for (int e = 0; e < holders; ++e) {
      for (int t = 0; t < plan_.tp; ++t) {
        const int owner = world_rank_of(plan_, stage, e, t);
        if (rank_ == owner && owner != 0) world_.send(mine->block(block), 0, nullptr);
        if (rank_ != 0) continue;
        std::optional<HostBlocks> theirs;
        if (owner != 0) {
          if (sliced) theirs.emplace(local, std::vector<int>{block});
          world_.recv((sliced ? *theirs : gathered).block(block), owner, nullptr);
        }
        if (sliced) {
          insert_block_slice(full_layout_, layout_of(e), t, block, owner == 0 ? *mine : *theirs,
                             gathered);
        }
      }
    }
  }
}

// The sample's prompt: the first 8 tokens of the validation data; of chat data, the first
// validation conversation up to where its first trained token (the assistant's reply) begins:
// its turns rendered with the chat template, ending in the assistant's header.
std::vector<int32_t> RankTrainer::sample_prompt() const {
  std::vector<int32_t> inputs(static_cast<size_t>(B_ * T_)), targets(inputs.size());
  DataLoader prompt_loader(ctx_.data->val, LoaderOptions{B_, T_, 1, 0, false, 0});
  prompt_loader.next_batch(Tensor(inputs.data(), DType::I32, {B_, T_}),
                           Tensor(targets.data(), DType::I32, {B_, T_}));
  size_t length = static_cast<size_t>(std::min<int64_t>(8, T_));
  if (prompt_loader.conversations() != nullptr) {
    const auto first_trained = std::find_if(targets.begin(), targets.begin() + T_,
                                            [](int32_t t) { return t != kIgnoreTarget; });
    length = static_cast<size_t>(first_trained - targets.begin()) + 1;
  }
  return std::vector<int32_t>(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(length));
}

void RankTrainer::sample(const HostBlocks& gathered, std::ostream& text) const {
  const Datasets& data = *ctx_.data;
  const std::vector<int32_t> prompt = sample_prompt();
  HostParams weights(gathered);
  // The gathered weights are host memory: the sample runs on a CPU backend.
  std::unique_ptr<Backend> backend = make_cpu_backend(threads_);
  std::unique_ptr<Allocator> allocator = make_cpu_allocator(rank_);
  const std::vector<int32_t> tokens = sample_tokens(config_, *backend, *allocator, weights, prompt,
                                                    options_.sample_tokens, T_, options_.seed);
  text << "\n  sample (" << prompt.size() << " prompt tokens from the validation data"
       << (data.val.masked() ? ", its first conversation up to the reply" : "") << ", then "
       << options_.sample_tokens << " sampled):";
  const auto split = tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size());
  const std::vector<int32_t> given(tokens.begin(), split), sampled(split, tokens.end());
  const auto show = [&](const std::vector<int32_t>& part) {
    if (ctx_.tokenizer) return ctx_.tokenizer->decode(part);
    if (!data.synthetic && config_.vocab_size <= 256) return ByteTokenizer().decode(part);
    std::string ids;
    for (int32_t token : part) ids += (ids.empty() ? "" : " ") + std::to_string(token);
    return ids;
  };
  text << "\n    prompt:  " << show(given) << "\n    sampled: " << show(sampled);
}

void RankTrainer::finish(double train_seconds) {
  TrainSummary& summary = *ctx_.summary;  // shared by the process's ranks (rank_trainer.h)
  const bool leader = rank_ == 0;
  const int64_t steps_run = steps_reached_ - ctx_.first_step;
  const double tokens_per_second = train_seconds > 0 ? positions_run_ / train_seconds : 0.0;
  if (leader) summary.tokens_per_second = tokens_per_second;
  if (options_.test.verify_tied_embedding) verify_tied_embedding();
  nlohmann::json summary_record{{"type", "summary"},
                                {"steps", steps_reached_},
                                {"interrupted", interrupted_by_ != 0},
                                {"tokens_per_s", tokens_per_second},
                                {"train_seconds", train_seconds}};
  print_stage_summary(summary_record);
  const TimeSplit per_step =
      scaled(run_split_, 1.0 / static_cast<double>(std::max<int64_t>(1, steps_run)));
  summary_record["time_per_step"] = time_record(per_step);
  const bool want_sample = options_.sample_tokens > 0 && interrupted_by_ == 0;
  std::optional<HostBlocks> gathered;
  if (want_sample) {
    // Rank 0 holds the whole model; the others one block at a time.
    if (leader) {
      gathered.emplace(full_layout_);
    } else {
      gathered.emplace(full_layout_, std::vector<int>{});
    }
    gather_full_weights_on_leader(*gathered);
  }
  if (!leader) return;
  std::ostringstream text;
  text.precision(4);
  text << std::fixed << "done: " << count_of(steps_run, "step") << " in "
       << format_duration(train_seconds) << ", " << format_rate(summary.tokens_per_second)
       << " tokens/s";
  if (summary.final_loss) text << "; final train loss " << *summary.final_loss;
  if (summary.final_eval_loss) text << ", eval loss " << *summary.final_eval_loss;
  if (steps_run > 0) text << "\n  time: " << time_split_line(per_step) << " (mean over ranks)";
  const Datasets& data = *ctx_.data;
  if (data.entropy_floor && summary.final_eval_loss) {
    text << "\n  entropy floor " << *data.entropy_floor << " nats: the model is "
         << *summary.final_eval_loss - *data.entropy_floor << " nats above it";
  }
  if (summary.final_loss) summary_record["final_loss"] = *summary.final_loss;
  if (summary.final_eval_loss) summary_record["final_eval_loss"] = *summary.final_eval_loss;
  ctx_.log->write(summary_record);
  if (summary.interrupted_by != 0) {
    text << "\n  interrupted (" << (summary.interrupted_by == SIGTERM ? "SIGTERM" : "SIGINT")
         << ") after step " << summary.steps;
    if (!summary.checkpoint.empty()) {
      text << "; continue with: dstrain --resume " << options_.out << " --steps " << options_.steps;
    } else {
      text << "; no checkpoint written (no --out)";
    }
  }
  if (want_sample) sample(*gathered, text);
  ctx_.progress->message(text.str());
}

}  // namespace dstrain
