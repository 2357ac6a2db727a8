#include "train/options.h"

#include <cmath>

#include "core/check.h"

namespace dstrain {

void validate_options(const TrainOptions& options) {
  DSTRAIN_USER_CHECK(options.batch >= 1) << "--batch must be at least 1";
  DSTRAIN_USER_CHECK(options.seq_len >= 1) << "--seq-len must be at least 1";
  DSTRAIN_USER_CHECK(options.grad_accum >= 1) << "--grad-accum must be at least 1";
  DSTRAIN_USER_CHECK(options.steps >= 1) << "--steps must be at least 1";
  DSTRAIN_USER_CHECK(options.lr > 0 && std::isfinite(options.lr)) << "--lr must be positive";
  DSTRAIN_USER_CHECK(options.warmup >= 0) << "--warmup must not be negative";
  DSTRAIN_USER_CHECK(options.weight_decay >= 0) << "--weight-decay must not be negative";
  DSTRAIN_USER_CHECK(options.beta1 >= 0 && options.beta1 < 1) << "--beta1 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.beta2 >= 0 && options.beta2 < 1) << "--beta2 must be in [0, 1)";
  DSTRAIN_USER_CHECK(options.eps > 0) << "--eps must be positive";
  DSTRAIN_USER_CHECK(options.grad_clip >= 0) << "--grad-clip must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.eval_every >= 0) << "--eval-every must not be negative (0 disables)";
  DSTRAIN_USER_CHECK(options.eval_batches >= 1) << "--eval-batches must be at least 1";
  DSTRAIN_USER_CHECK(options.save_every >= 0) << "--save-every must not be negative";
  DSTRAIN_USER_CHECK(options.save_every == 0 || !options.out.empty())
      << "--save-every needs --out (the directory checkpoints go to)";
  DSTRAIN_USER_CHECK(options.resume.empty() || options.init_from.empty())
      << "--resume and --init-from exclude each other (a resume restores the weights)";
  DSTRAIN_USER_CHECK(options.gpus >= 1) << "--gpus must be at least 1";
  DSTRAIN_USER_CHECK(options.gpus <= 64)
      << "--gpus " << options.gpus << " is more ranks than one machine holds (at most 64)";
  DSTRAIN_USER_CHECK(options.zero >= 0 && options.zero <= 3)
      << "--zero must be 0, 1, 2 or 3, not " << options.zero;
  DSTRAIN_USER_CHECK(options.comm_timeout > 0) << "--comm-timeout must be positive (seconds)";
  DSTRAIN_USER_CHECK(options.device == "auto" || options.device == "cpu" ||
                     options.device == "cuda")
      << "--device must be auto, cpu or cuda, not '" << options.device << "'";
  DSTRAIN_USER_CHECK(options.precision == "fp32" || options.precision == "fp16" ||
                     options.precision == "bf16")
      << "--precision must be fp32, fp16 or bf16, not '" << options.precision << "'";
  DSTRAIN_USER_CHECK(options.sample_tokens >= 0) << "--sample must not be negative";
}

namespace {

// Each remembered setting: its flag name and the field.
template <class Fn>
void for_each_resumable(TrainOptions& o, Fn&& fn) {
  fn("data", o.data);
  fn("val-data", o.val_data);
  fn("shuffle", o.shuffle);
  fn("batch", o.batch);
  fn("seq-len", o.seq_len);
  fn("grad-accum", o.grad_accum);
  fn("gpus", o.gpus);
  fn("steps", o.steps);
  fn("lr", o.lr);
  fn("lr-schedule", o.lr_schedule);
  fn("warmup", o.warmup);
  fn("min-lr", o.min_lr);
  fn("weight-decay", o.weight_decay);
  fn("beta1", o.beta1);
  fn("beta2", o.beta2);
  fn("eps", o.eps);
  fn("grad-clip", o.grad_clip);
  fn("seed", o.seed);
  fn("precision", o.precision);
  fn("zero", o.zero);
  fn("offload", o.offload);
  fn("recompute", o.recompute);
  fn("eval-every", o.eval_every);
  fn("eval-batches", o.eval_batches);
  fn("save-every", o.save_every);
  fn("out", o.out);
  fn("log", o.log);
}

}  // namespace

nlohmann::json resumable_options(const TrainOptions& options) {
  TrainOptions copy = options;
  nlohmann::json saved = nlohmann::json::object();
  for_each_resumable(copy, [&](const char* flag, auto& field) { saved[flag] = field; });
  return saved;
}

void apply_resumable_options(TrainOptions& options, const nlohmann::json& saved) {
  if (!options.explicit_flags || !saved.is_object()) return;
  const std::set<std::string>& given = *options.explicit_flags;
  const bool ranks_given = given.count("gpus") != 0, accum_given = given.count("grad-accum") != 0;
  const int64_t micro_batches =
      saved.value("grad-accum", int64_t{1}) * saved.value("gpus", int64_t{1});
  for_each_resumable(options, [&](const char* flag, auto& field) {
    if (given.count(flag) || !saved.contains(flag)) return;
    try {
      saved.at(flag).get_to(field);
    } catch (const nlohmann::json::exception&) {
      DSTRAIN_USER_ERROR() << "the checkpoint's remembered setting --" << flag << " is malformed";
    }
  });
  // Other ranks than before, same micro-batches per step: the accumulation follows.
  if (ranks_given && !accum_given) {
    DSTRAIN_USER_CHECK(micro_batches % options.gpus == 0)
        << "the checkpoint's run makes each step of " << micro_batches << " micro-batches, which "
        << options.gpus << " ranks cannot share evenly; give --grad-accum too";
    options.grad_accum = micro_batches / options.gpus;
  }
}

}  // namespace dstrain
