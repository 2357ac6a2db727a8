// --check-replicas: clean runs of every plan pass the check at every step; a divergence planted
// in one rank's weights (one bit of one element) is caught at that step, naming the tensor, the
// step and the ranks, and the step is not saved.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "core/check.h"
#include "tests/common/temp_dir.h"
#include "tests/train/small_model.h"
#include "train/replica_check.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

class ReplicaCheckTest : public ::testing::Test {
 protected:
  TrainOptions options(const std::string& name, int ranks) {
    TrainOptions o = test::small_run_options(dir_.path(), name, ranks);
    o.model = test::write_small_model_config(dir_.path(), 2, 4);
    o.steps = 4;
    o.threads = ranks;
    o.check_replicas = 1;
    o.save_every = 1;
    return o;
  }
  // The run's error message (empty: it finished).
  static std::string run(const TrainOptions& o) {
    std::ostringstream out;
    try {
      train(o, out);
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  }
  static bool saved(const TrainOptions& o, int step) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%06d", step);
    return fs::exists(fs::path(o.out) / name);
  }
  dstrain::testing::TempDir dir_;
};

TEST_F(ReplicaCheckTest, CleanRunsOfEveryPlanAgree) {
  struct Plan {
    const char* name;
    int ranks, zero, tp, pp;
    bool offload;
  };
  for (const Plan& p : {Plan{"zero1", 2, 1, 1, 1, false}, Plan{"zero3", 2, 3, 1, 1, false},
                        Plan{"offload", 2, 2, 1, 1, true}, Plan{"pp2", 2, 0, 1, 2, false},
                        Plan{"tp2", 2, 0, 2, 1, false}, Plan{"dp2tp2", 4, 3, 2, 1, false}}) {
    TrainOptions o = options(p.name, p.ranks);
    o.zero = p.zero;
    o.tp = p.tp;
    o.pp = p.pp;
    o.offload = p.offload;
    o.grad_accum = test::kSmallRunMicroBatches / (p.ranks / (p.tp * p.pp));
    EXPECT_EQ(run(o), "") << p.name;
    EXPECT_TRUE(saved(o, 4)) << p.name;
  }
}

TEST_F(ReplicaCheckTest, ADataParallelReplicaThatDivergesIsCaughtAtThatStep) {
  TrainOptions o = options("dp", 2);
  o.zero = 1;
  o.test.diverge_step = 3;
  o.test.diverge_rank = 1;
  o.test.diverge_tensor = "h.1.ln_2.weight";
  const std::string error = run(o);
  EXPECT_NE(error.find("replica check after step 3: h.1.ln_2.weight differs between the "
                       "data-parallel replicas: rank 0 holds checksum 0x"),
            std::string::npos) << error;
  EXPECT_NE(error.find(", rank 1 (0x"), std::string::npos) << error;
  EXPECT_NE(error.find("the run stops without saving this step"), std::string::npos) << error;
  EXPECT_TRUE(saved(o, 2));
  EXPECT_FALSE(saved(o, 3));
}

TEST_F(ReplicaCheckTest, TheTiedEmbeddingsCopyOnTheLastStageIsChecked) {
  TrainOptions o = options("tied", 2);
  o.pp = 2;
  o.test.diverge_step = 2;
  o.test.diverge_rank = 1;  // the last stage
  o.test.diverge_tensor = "wte.weight";
  const std::string error = run(o);
  EXPECT_NE(error.find("replica check after step 2: wte.weight differs between the tied "
                       "embedding's copies (first and last pipeline stage): rank 0 holds"),
            std::string::npos) << error;
  EXPECT_FALSE(saved(o, 2));
}

TEST_F(ReplicaCheckTest, ReplicatedTensorsOfTensorParallelRanksAreChecked) {
  TrainOptions o = options("tp", 2);
  o.tp = 2;
  o.test.diverge_step = 1;
  o.test.diverge_rank = 1;  // tp index 1
  o.test.diverge_tensor = "h.0.ln_1.bias";  // every tp rank holds it whole
  const std::string error = run(o);
  EXPECT_NE(error.find("replica check after step 1: h.0.ln_1.bias differs between the "
                       "tensor-parallel ranks: rank 0 holds checksum"),
            std::string::npos) << error;
  EXPECT_FALSE(saved(o, 1));
}

TEST(ReplicaChecksum, Fnv1aOfKnownInputs) {
  // The published FNV-1a 64 test vectors.
  EXPECT_EQ(fnv1a64(nullptr, 0), 0xcbf29ce484222325ull);
  const unsigned char a[] = {'a'};
  EXPECT_EQ(fnv1a64(a, 1), 0xaf63dc4c8601ec8cull);
  const unsigned char foobar[] = {'f', 'o', 'o', 'b', 'a', 'r'};
  EXPECT_EQ(fnv1a64(foobar, 6), 0x85944171f73967e8ull);
}

}  // namespace
}  // namespace dstrain
