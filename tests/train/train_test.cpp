// The training loop end to end, in process: agreement with an independent PyTorch run,
// determinism, bit-identical resume, checkpoints that refuse to load when broken.
#include <gtest/gtest.h>

#include "tests/common/jsonl_log.h"
#include "tests/common/temp_dir.h"
#include "tests/train/expect_user_error.h"

#include <filesystem>
#include <functional>
#include <iomanip>
#include <unistd.h>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "core/safetensors.h"
#include "data/token_file.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;
const std::string kFixture = DSTRAIN_SOURCE_DIR "/tests/reference/gpt2_tiny/";

class TrainTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return temp_.file(name); }
  testing::TempDir temp_;
};

std::string slurp(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  EXPECT_TRUE(file.good()) << path;
  return std::string(std::istreambuf_iterator<char>(file), {});
}

std::vector<nlohmann::json> read_log(const std::string& path) {
  return dstrain::testing::read_jsonl(path);
}
using dstrain::testing::step_records;

TrainOptions quiet_options() {
  TrainOptions options;
  options.device = "cpu";  // the CPU backend's own tests, on a machine with a GPU too
  options.quiet = true;
  options.sample_tokens = 0;
  options.threads = 2;
  return options;
}

TEST_F(TrainTest, LossesGradNormsAndWeightsMatchPyTorch) {
  const nlohmann::json expected = nlohmann::json::parse(slurp(kFixture + "expected.json"));
  TrainOptions options = quiet_options();
  options.model = kFixture + "config.json";
  options.init_from = kFixture + "model.safetensors";
  options.data = kFixture + "train.bin";
  options.val_data = kFixture + "train.bin";
  options.batch = expected["batch"];
  options.seq_len = expected["seq_len"];
  options.grad_accum = expected["grad_accum"];
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
  options.log = path("log.jsonl");
  options.out = path("out");
  std::ostringstream out;
  train(options, out);

  const auto steps = step_records(read_log(options.log));
  ASSERT_EQ(steps.size(), expected["losses"].size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const double loss = expected["losses"][i], norm = expected["grad_norms"][i];
    const double lr = expected["lrs"][i];
    EXPECT_NEAR(steps[i]["loss"].get<double>(), loss, 1e-5 * loss) << "step " << i + 1;
    EXPECT_NEAR(steps[i]["grad_norm"].get<double>(), norm, 1e-5 * norm) << "step " << i + 1;
    EXPECT_NEAR(steps[i]["lr"].get<double>(), lr, 1e-12) << "step " << i + 1;
  }
  // The weights after the last step, tensor by tensor. Adam divides by sqrt(v), so where a
  // gradient is near zero an fp32 rounding difference moves the update by up to ~lr * 1e-3:
  // 1e-5 is about 1% of the distance the weights travel in 8 steps at lr 1e-3.
  const SafetensorsFile ours = SafetensorsFile::open(path("out/step-000008/model.safetensors"));
  const SafetensorsFile ref = SafetensorsFile::open(kFixture + "final.safetensors");
  ASSERT_EQ(ours.names().size(), ref.names().size());
  for (const std::string& name : ref.names()) {
    const std::vector<float> a = ours.read_f32(name), b = ref.read_f32(name);
    ASSERT_EQ(a.size(), b.size()) << name;
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << name << "[" << i << "]";
  }
}

TrainOptions small_synthetic_run(const std::string& log) {
  TrainOptions options = quiet_options();
  options.model = "tiny";
  options.batch = 4;
  options.seq_len = 32;
  options.grad_accum = 2;
  options.steps = 12;
  options.warmup = 3;
  options.eval_every = 4;
  options.eval_batches = 2;
  options.log = log;
  return options;
}

TEST_F(TrainTest, SameSeedSameBits) {
  TrainOptions a = small_synthetic_run(path("a.jsonl"));
  a.out = path("a");
  TrainOptions b = small_synthetic_run(path("b.jsonl"));
  b.out = path("b");
  std::ostringstream out;
  train(a, out);
  train(b, out);
  EXPECT_EQ(slurp(path("a/step-000012/model.safetensors")),
            slurp(path("b/step-000012/model.safetensors")));
  TrainOptions c = small_synthetic_run(path("c.jsonl"));
  c.out = path("c");
  c.seed = 7;
  train(c, out);
  EXPECT_NE(slurp(path("a/step-000012/model.safetensors")),
            slurp(path("c/step-000012/model.safetensors")));
}

// The summary's list of losses is bounded (a run of millions of steps keeps a flat memory: the
// soak of issue 35 found it growing 8 bytes a step); the last step's loss is kept beside it.
TEST_F(TrainTest, TheSummaryKeepsTheFirstLossesAndTheLast) {
  TrainOptions options = small_synthetic_run(path("bounded.jsonl"));
  options.eval_every = 0;
  options.steps = 5;
  options.test.summary_losses_kept = 3;
  std::ostringstream out;
  const TrainSummary summary = train(options, out);
  const std::vector<double> logged = dstrain::testing::step_losses(path("bounded.jsonl"));
  ASSERT_EQ(logged.size(), 5u);
  EXPECT_EQ(summary.losses, std::vector<double>(logged.begin(), logged.begin() + 3));
  ASSERT_TRUE(summary.final_loss.has_value());
  EXPECT_EQ(*summary.final_loss, logged.back());
  EXPECT_NE(out.str().find("final train loss"), std::string::npos) << out.str();
}

// 2N steps straight, and N steps + resume + N steps: byte-identical weights and optimizer
// state, identical logged losses and eval losses.
void expect_bit_identical_resume(const TrainOptions& base, const TrainTest* test,
                                 const std::function<std::string(const std::string&)>& path) {
  TrainOptions straight = base;
  straight.out = path("straight");
  straight.save_every = base.steps / 2;
  straight.log = path("straight.jsonl");
  std::ostringstream out;
  train(straight, out);

  TrainOptions resumed = base;
  resumed.resume = path("straight/" + std::string("step-") +
                        (std::ostringstream() << std::setw(6) << std::setfill('0')
                                              << base.steps / 2).str());
  resumed.model.clear();
  resumed.out = path("resumed");
  resumed.log = path("resumed.jsonl");
  const TrainSummary summary = train(resumed, out);
  EXPECT_EQ(summary.first_step, base.steps / 2);

  const std::string last = "/step-" + (std::ostringstream() << std::setw(6) << std::setfill('0')
                                                            << base.steps).str();
  EXPECT_EQ(slurp(path("straight") + last + "/model.safetensors"),
            slurp(path("resumed") + last + "/model.safetensors"));
  EXPECT_EQ(slurp(path("straight") + last + "/optimizer.safetensors"),
            slurp(path("resumed") + last + "/optimizer.safetensors"));
  const auto all = read_log(path("straight.jsonl"));
  const auto tail = read_log(path("resumed.jsonl"));
  std::vector<nlohmann::json> expected_tail;
  for (const auto& record : all) {
    if (record.contains("step") && record["step"].get<int64_t>() > base.steps / 2 &&
        (record.contains("loss") || record.contains("eval_loss"))) {
      expected_tail.push_back(record);
    }
  }
  std::vector<nlohmann::json> got_tail;
  for (const auto& record : tail) {
    if (record.contains("loss") || record.contains("eval_loss")) got_tail.push_back(record);
  }
  ASSERT_EQ(got_tail.size(), expected_tail.size());
  ASSERT_GT(got_tail.size(), 0u);
  for (size_t i = 0; i < got_tail.size(); ++i) {
    EXPECT_EQ(got_tail[i]["step"], expected_tail[i]["step"]);
    for (const char* key : {"loss", "eval_loss", "grad_norm", "lr"}) {
      if (expected_tail[i].contains(key)) {
        EXPECT_EQ(got_tail[i][key].get<double>(), expected_tail[i][key].get<double>())
            << key << " at step " << got_tail[i]["step"];
      }
    }
  }
}

TEST_F(TrainTest, ResumeIsBitIdenticalOnSyntheticData) {
  expect_bit_identical_resume(small_synthetic_run(""), this,
                              [this](const std::string& name) { return path(name); });
}

TEST_F(TrainTest, ResumeIsBitIdenticalWithShuffledFileData) {
  // Random tokens in two shards, shuffled windows, several epochs within the run.
  Rng rng(5);
  for (int shard = 0; shard < 2; ++shard) {
    std::vector<int32_t> tokens(700);
    for (int32_t& token : tokens) token = int32_t(rng.below(256));
    write_token_file(path("shard_" + std::to_string(shard) + ".bin"), tokens,
                     TokenFormat::kLlmcU16);
  }
  TrainOptions options = small_synthetic_run("");
  options.data = path("shard_*.bin");
  options.shuffle = true;
  options.steps = 10;
  options.grad_accum = 1;
  options.eval_every = 5;
  expect_bit_identical_resume(options, this,
                              [this](const std::string& name) { return path(name); });
}

using test::expect_user_error;

// A run stopped between writing a checkpoint and moving `latest` to it (a second signal): the
// run directory resumes from the newer whole checkpoint, not from what `latest` still names
// (which resuming into the same directory would refuse as older than the run's newest).
TEST_F(TrainTest, ARunStoppedBeforeItsLatestMovedResumesFromTheNewestWholeCheckpoint) {
  TrainOptions options = small_synthetic_run("");
  options.steps = 3;
  options.eval_every = 0;
  options.save_every = 1;
  options.out = path("lagging");
  std::ostringstream out;
  train(options, out);
  ASSERT_TRUE(fs::exists(path("lagging/step-000003/trainer.json")));
  fs::remove(path("lagging/latest"));
  fs::create_directory_symlink("step-000002", path("lagging/latest"));
  TrainOptions resume = small_synthetic_run("");
  resume.steps = 4;
  resume.eval_every = 0;
  resume.resume = path("lagging");
  resume.out = path("lagging");
  std::ostringstream log;
  EXPECT_EQ(train(resume, log).steps, 4);
  EXPECT_NE(log.str().find("step-000003"), std::string::npos) << log.str();
  EXPECT_EQ(fs::read_symlink(path("lagging/latest")), "step-000004");
}

TEST_F(TrainTest, BrokenCheckpointsAreClearErrors) {
  TrainOptions options = small_synthetic_run(path("log.jsonl"));
  options.steps = 2;
  options.eval_every = 0;
  options.out = path("run");
  std::ostringstream out;
  train(options, out);
  const fs::path good = path("run/step-000002");
  ASSERT_TRUE(fs::exists(good / "model.safetensors"));
  ASSERT_TRUE(fs::is_symlink(path("run/latest")));
  EXPECT_EQ(fs::read_symlink(path("run/latest")), "step-000002");
  EXPECT_TRUE(fs::exists(path("run/latest/config.json"))) << "a link that tools can follow";
  // No temp directory is left behind.
  for (const auto& entry : fs::directory_iterator(path("run"))) {
    EXPECT_EQ(entry.path().filename().string().rfind(".tmp", 0), std::string::npos);
  }

  TrainOptions resume = small_synthetic_run("");
  resume.steps = 4;
  resume.eval_every = 0;
  auto broken_copy = [&](const std::string& name) {
    const fs::path copy = path(name);
    fs::copy(good, copy, fs::copy_options::recursive);
    resume.resume = copy.string();
    return copy;
  };
  // A half-written directory: trainer.json never made it.
  fs::remove(broken_copy("no_trainer") / "trainer.json");
  expect_user_error(resume, "incomplete");
  // Weights cut short.
  {
    const fs::path copy = broken_copy("truncated");
    fs::resize_file(copy / "model.safetensors", fs::file_size(copy / "model.safetensors") / 2);
    expect_user_error(resume, "model.safetensors");
  }
  // trainer.json that is not JSON.
  {
    const fs::path copy = broken_copy("bad_json");
    std::ofstream(copy / "trainer.json") << "{\"step\": 2,";
    expect_user_error(resume, "trainer.json");
  }
  // `latest` naming a checkpoint that is not there.
  {
    fs::create_directories(path("dangling"));
    std::ofstream(path("dangling/latest")) << "step-000099\n";
    resume.resume = path("dangling");
    expect_user_error(resume, "does not exist");
    fs::create_directories(path("dangling_link"));
    fs::create_directory_symlink("step-000099", path("dangling_link/latest"));
    resume.resume = path("dangling_link");
    expect_user_error(resume, "does not exist");
  }
  // A run of an earlier version: `latest` a text file naming the step.
  {
    fs::create_directories(path("old_run"));
    fs::copy(good, path("old_run/step-000002"), fs::copy_options::recursive);
    std::ofstream(path("old_run/latest")) << "step-000002\n";
    TrainOptions old = resume;
    old.resume = path("old_run");
    old.out = path("old_run");
    std::ostringstream log;
    EXPECT_EQ(train(old, log).steps, 4);
    EXPECT_EQ(fs::read_symlink(path("old_run/latest")), "step-000004") << "replaced by a link";
  }
  // A different model than the checkpoint's.
  resume.resume = good.string();
  resume.model = "gpt2-124m";
  expect_user_error(resume, "differs");
  // A different batch geometry than the checkpoint's.
  resume.model.clear();
  resume.batch = 8;
  expect_user_error(resume, "batch");
  // Already at --steps.
  resume.batch = 4;
  resume.steps = 2;
  expect_user_error(resume, "already reaches");
}

TEST_F(TrainTest, InitFromAcceptsHuggingFaceNamesAndRejectsWrongShapes) {
  // A checkpoint in the transformers layout: "transformer." prefix, attn.bias buffers,
  // lm_head.weight — all of which must load or be ignored.
  const SafetensorsFile source = SafetensorsFile::open(kFixture + "model.safetensors");
  std::vector<std::vector<float>> keep;
  SafetensorsWriter writer;
  for (const std::string& name : source.names()) {
    keep.push_back(source.read_f32(name));
    writer.add("transformer." + name, DType::F32, source.info(name).shape, keep.back().data());
  }
  std::vector<float> mask(32 * 32, 1.0f);
  writer.add("transformer.h.0.attn.bias", DType::F32, {1, 1, 32, 32}, mask.data());
  keep.push_back(source.read_f32("wte.weight"));  // kept: the writer holds its address
  writer.add("lm_head.weight", DType::F32, source.info("wte.weight").shape, keep.back().data());
  writer.write(path("hf.safetensors"));

  TrainOptions options = quiet_options();
  options.model = kFixture + "config.json";
  options.data = kFixture + "train.bin";
  options.batch = 4;
  options.seq_len = 16;
  options.steps = 1;
  options.eval_every = 0;
  options.init_from = path("hf.safetensors");
  std::ostringstream out;
  EXPECT_NO_THROW(train(options, out));

  // The same file for a model of another width: a shape mismatch, said clearly.
  options.model = "tiny";
  expect_user_error(options, "shape");
  options.init_from = path("missing.safetensors");
  expect_user_error(options, "missing.safetensors");
}

TEST_F(TrainTest, BadOptionsAreClearErrors) {
  TrainOptions options = small_synthetic_run("");
  options.steps = 0;
  expect_user_error(options, "--steps");
  options = small_synthetic_run("");
  options.seq_len = 4096;
  expect_user_error(options, "n_positions");
  options = small_synthetic_run("");
  options.save_every = 5;
  expect_user_error(options, "--out");
  options = small_synthetic_run("");
  options.data = path("nothing_*.bin");
  expect_user_error(options, "nothing_");
  options = small_synthetic_run("");
  options.lr_schedule = "linear";
  expect_user_error(options, "--lr-schedule");
  options = small_synthetic_run("");
  options.log = path("no/such/dir/log.jsonl");
  expect_user_error(options, "log");
}

}  // namespace
}  // namespace dstrain
