// The LLaMA-family fixtures made with transformers (tests/reference/make_llama_reference.py)
// as dstrain runs: a plan, and the options that train the fixture's 10 steps with the
// settings transformers used (tests/train/hf_models_test.cpp, cuda_train_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"
#include "tests/train/small_model.h"
#include "train/options.h"
#include "train/trainer.h"
#include "train/weights_io.h"

namespace dstrain::test {

// The Hugging Face weights of model directory `dir` as a model test's host parameters.
inline void load_fixture_params(const ParamLayout& layout, const std::string& dir,
                                HostParams& params) {
  HostBlocks weights(layout);
  load_weights(layout, weights, dir);
  for (int block = 0; block < layout.num_blocks(); ++block) {
    std::memcpy(params.params[block].data(), weights.block(block).data,
                params.params[block].size() * sizeof(float));
  }
}

inline std::string fixture_dir(const std::string& fixture) {
  return std::string(DSTRAIN_SOURCE_DIR "/tests/reference/") + fixture;
}

inline nlohmann::json fixture_expected(const std::string& fixture) {
  return nlohmann::json::parse(slurp(fixture_dir(fixture) + "/expected.json"));
}

// What transformers did in 10 steps, as dstrain trains it on `ranks` ranks.
struct FixturePlan {
  const char* fixture;
  int dp = 1, tp = 1, pp = 1, zero = 0;
  bool offload = false;
  int ep = 1;  // expert parallelism (of the dp ranks)
  // The dp ranks split each micro-batch's sequences and keep the accumulation (DeepSeek's
  // auxiliary loss is per micro-batch, weight 1 each: only this split keeps it the same).
  bool split_batch = false;
  std::string name() const {
    return std::string(fixture) + "_dp" + std::to_string(dp) + "_tp" + std::to_string(tp) + "_pp" +
           std::to_string(pp) + "_zero" + std::to_string(zero) + (offload ? "_offload" : "") +
           (ep > 1 ? "_ep" + std::to_string(ep) : "");
  }
};

// gtest's name for a case (else it prints the struct's bytes).
inline void PrintTo(const FixturePlan& plan, std::ostream* out) { *out << plan.name(); }

inline TrainOptions fixture_run(const FixturePlan& p, const nlohmann::json& expected,
                                const std::filesystem::path& dir) {
  const std::string fixture = fixture_dir(p.fixture);
  TrainOptions options;
  options.device = "cpu";
  options.quiet = true;
  options.sample_tokens = 0;
  options.model = fixture;  // the model directory's config.json
  options.init_from = fixture;
  // The final weights are compared in fp32 (the default, the fixture's dtype, is bf16 for
  // Qwen2: tests/train/trust_test.cpp covers it).
  options.save_dtype = "fp32";
  options.data = fixture + "/train.bin";
  options.val_data = options.data;  // (no validation windows taken out of the data)
  // The step's sequences: the accumulation split over the dp ranks, or (more ranks than
  // micro-batches) the micro-batch.
  options.batch = expected["batch"];
  options.seq_len = expected["seq_len"];
  options.grad_accum = expected["grad_accum"].get<int64_t>() / p.dp;
  if (p.split_batch) {
    options.batch = expected["batch"].get<int64_t>() / p.dp;
    options.grad_accum = expected["grad_accum"];
  } else if (options.grad_accum == 0) {
    options.batch = options.batch * expected["grad_accum"].get<int64_t>() / p.dp;
    options.grad_accum = 1;
  }
  options.steps = expected["steps"];
  options.lr = expected["lr"];
  options.min_lr = expected["min_lr"];
  options.warmup = expected["warmup"];
  options.lr_schedule = expected["lr_schedule"];
  options.weight_decay = expected["weight_decay"];
  options.beta1 = expected["beta1"];
  options.beta2 = expected["beta2"];
  options.eps = expected["eps"];
  options.grad_clip = expected["grad_clip"];
  options.eval_every = 0;
  options.gpus = p.dp * p.tp * p.pp;
  options.tp = p.tp;
  options.ep = p.ep;
  options.pp = p.pp;
  options.zero = p.zero;
  options.offload = p.offload;
  options.threads = options.gpus;
  options.log = (dir / (p.name() + ".jsonl")).string();
  options.out = (dir / p.name()).string();
  return options;
}

// Trains `options` (made by fixture_run) and compares with what transformers did: every step's
// loss and pre-clip gradient norm within `relative`, every final weight within `absolute`.
inline void expect_trains_like_transformers(const TrainOptions& options, const std::string& fixture,
                                            double relative, double absolute) {
  const nlohmann::json expected = fixture_expected(fixture);
  std::ostringstream out;
  train(options, out);
  const LoggedRun run = read_logged_run(options);
  ASSERT_EQ(run.steps.size(), expected["losses"].size());
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const double loss = expected["losses"][i], norm = expected["grad_norms"][i];
    EXPECT_NEAR(run.steps[i]["loss"].get<double>(), loss, relative * loss) << "step " << i + 1;
    EXPECT_NEAR(run.steps[i]["grad_norm"].get<double>(), norm, relative * norm) << "step " << i + 1;
  }
  const SafetensorsFile ref = SafetensorsFile::open(fixture_dir(fixture) + "/final.safetensors");
  ASSERT_EQ(run.weights.size(), ref.names().size());
  for (const std::string& name : ref.names()) {
    const std::vector<float> want = ref.read_f32(name);
    const std::vector<float>& got = run.weights.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], absolute) << name << "[" << i << "]";
    }
  }
}

}  // namespace dstrain::test
