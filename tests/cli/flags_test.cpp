// Flags are exact words, as a user types them: no prefix guessing (`--ep 2` is not `--eps 2`),
// an unknown flag names the nearest ones, launchers' habits (DeepSpeed's --local_rank,
// torchrun's variables) mean what they mean there, and --help shows every flag with a value
// name and, where it does not depend on the machine, its default.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using Result = dstrain::testing::BinaryResult;

const std::string kSmall = "--batch 2 --seq-len 16 --steps 1 --eval-every 0 --sample 0 --quiet";

class FlagsTest : public ::testing::Test {
 protected:
  Result run(const std::string& args, const std::string& environment = "") const {
    return dstrain::testing::run_binary(environment + " " + DSTRAIN_BINARY, args, temp_.path());
  }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(temp_.path() / name) << text;
  }
  // Exit code 2 and exactly one line "dstrain: error: ..." holding `fragment`.
  void expect_user_error(const std::string& args, const std::string& fragment,
                         const std::string& environment = "") const {
    dstrain::testing::expect_one_sentence(run(args, environment), args, fragment);
  }
  dstrain::testing::TempDir temp_;
};

TEST_F(FlagsTest, PrefixesAreNotGuessedAndTheNearestFlagsAreNamed) {
  // Boost's default would read these as --epochs 2 and --zero 1, silently; --ep is expert
  // parallelism, its own flag, not --eps.
  expect_user_error("--epo 2 " + kSmall, "unknown flag --epo (nearest: --epochs, --ep, --eps)");
  expect_user_error("--ep 2 " + kSmall,
                    "--ep 2: expert parallelism over 2 ranks needs a "
                    "mixture-of-experts model; tiny is dense");
  expect_user_error("--zer 1 " + kSmall, "unknown flag --zer (nearest: --zero)");
  expect_user_error("--stpes 3", "unknown flag --stpes (nearest: --steps)");
  expect_user_error("--lr-sched cosine", "unknown flag --lr-sched (nearest: --lr-schedule)");
  expect_user_error("--frobnicate 1", "unknown flag --frobnicate; see dstrain --help");
  // The other commands parse the same way.
  expect_user_error("plan --mod 6b", "unknown flag --mod (nearest: --model)");
  expect_user_error("prepare --inp a.txt --out d", "unknown flag --inp (nearest: --input)");
  expect_user_error("topo --js", "unknown flag --js (nearest: --json)");
  // Boost 1.74 substitutes %value% in its own error messages forever when the value holds it
  // (found by the run_config fuzzer in config files; the command line goes the same way).
  expect_user_error("--seed %value%", "holds \"%value%\", which no flag name or value may contain");
}

TEST_F(FlagsTest, ConfigFilesTakeExactNamesToo) {
  write("prefix.json", R"({"zer": 1})");
  expect_user_error("--config prefix.json " + kSmall, "\"zer\" is not a dstrain flag");
  write("prefix.conf", "zer = 1\n");
  expect_user_error("--config prefix.conf " + kSmall, "config file prefix.conf");
  // The exact names work in both forms.
  write("exact.conf", "zero = 1\nbatch = 2\n");
  const Result ok = run("--config exact.conf --gpus 2 --seq-len 16 --steps 1 --eval-every 0 "
                        "--sample 0 --quiet --log run.jsonl --device cpu");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  std::ifstream log(temp_.path() / "run.jsonl");
  std::string first;
  std::getline(log, first);
  EXPECT_NE(first.find("\"zero\":1"), std::string::npos) << first;
}

TEST_F(FlagsTest, DeepSpeedsLocalRankIsAcceptedAndIgnored) {
  for (const std::string flag : {"--local_rank 0", "--local_rank=0", "--local-rank 0"}) {
    const Result result = run(flag + " " + kSmall);
    EXPECT_EQ(result.exit_code, 0) << flag << ": " << result.err;
    EXPECT_NE(result.out.find("(from a launcher) is ignored"), std::string::npos) << result.out;
  }
}

TEST_F(FlagsTest, TorchrunsVariablesMeanWhatTheyMeanThere) {
  // torchrun --nproc-per-node 8 starts eight processes on a node: dstrain is one per node.
  expect_user_error(kSmall, "LOCAL_WORLD_SIZE='8': the launcher started several processes",
                    "env WORLD_SIZE=8 LOCAL_WORLD_SIZE=8 LOCAL_RANK=0");
  expect_user_error(kSmall, "NNODES='2' and WORLD_SIZE='3' contradict each other",
                    "env NNODES=2 WORLD_SIZE=3 NODE_RANK=0 MASTER_ADDR=127.0.0.1");
  expect_user_error(kSmall, "NODE_RANK='0' and RANK='1' contradict each other",
                    "env WORLD_SIZE=2 NODE_RANK=0 RANK=1 MASTER_ADDR=127.0.0.1");
  // One process on one node, as torchrun --nnodes 1 --nproc-per-node 1 starts it: a plain run.
  const Result single = run(kSmall, "env WORLD_SIZE=1 RANK=0 GROUP_RANK=0 LOCAL_RANK=0 "
                                    "LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511");
  EXPECT_EQ(single.exit_code, 0) << single.err;
}

// Every flag in --help has a value name (no Boost "arg"), and a flag whose default is the
// planner's shows no "(=...)" beside the text that says so.
TEST_F(FlagsTest, HelpNamesEveryValueAndNoMachineDependentDefault) {
  const Result help = run("--help");
  ASSERT_EQ(help.exit_code, 0);
  EXPECT_EQ(help.out.find(" arg "), std::string::npos) << help.out;
  EXPECT_EQ(help.out.find(" arg\n"), std::string::npos) << help.out;
  for (const std::string flag : {"--gpus", "--batch", "--seq-len", "--grad-accum", "--zero",
                                 "--recompute", "--tp", "--pp", "--precision", "--lr"}) {
    const std::regex shown("\n  " + flag + " [A-Z|,.]+ \\(=");
    EXPECT_FALSE(std::regex_search(help.out, shown)) << flag << " shows a fixed default";
  }
  EXPECT_NE(help.out.find("dp x tp x pp"), std::string::npos);
  for (const char* flag : {"--overwrite", "--keep-last", "--mirror", "--epochs",
                           "--lr-decay-steps", "--save-dtype", "--local_rank"}) {
    EXPECT_NE(help.out.find(std::string("\n  ") + flag + " "), std::string::npos) << flag;
  }
}

}  // namespace
