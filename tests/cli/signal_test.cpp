// SIGINT / SIGTERM during training: the first stops the run after the current step with a
// checkpoint and the signal's exit code; a second exits at once, and the last good
// checkpoint stays loadable.
#include <gtest/gtest.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "tests/common/checkpoint_checks.h"
#include "tests/common/temp_dir.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using dstrain::testing::expect_whole_checkpoints;
using dstrain::testing::step_directories;

class SignalTest : public ::testing::Test {
 protected:
  dstrain::testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();

  // Starts dstrain with `args`, its output going to files in dir_.
  pid_t start(const std::vector<std::string>& args) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string out = (dir_ / "stdout.txt").string(), err = (dir_ / "stderr.txt").string();
      (void)!std::freopen(out.c_str(), "w", stdout);
      (void)!std::freopen(err.c_str(), "w", stderr);
      std::vector<char*> argv{const_cast<char*>(DSTRAIN_BINARY)};
      for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
      argv.push_back(nullptr);
      ::execv(DSTRAIN_BINARY, argv.data());
      ::_exit(127);
    }
    return pid;
  }
  // Waits until the log has at least `steps` step records (or 120 s pass).
  bool wait_for_steps(const fs::path& log, int steps) {
    for (int i = 0; i < 1200; ++i) {
      std::ifstream file(log);
      int count = 0;
      for (std::string line; std::getline(file, line);) {
        if (line.find("\"loss\"") != std::string::npos) ++count;
      }
      if (count >= steps) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  int wait_exit(pid_t pid) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  std::string read(const fs::path& path) {
    std::ifstream file(path);
    return std::string(std::istreambuf_iterator<char>(file), {});
  }
};

std::vector<std::string> long_run(const fs::path& dir) {
  // Simulated ranks on the CPU backend whatever GPUs the machine has: this is about signals.
  return {"--device", "cpu", "--gpus", "2", "--zero", "3", "--batch", "8", "--seq-len", "64", "--steps", "100000",
          "--eval-every", "0", "--sample", "0", "--out", (dir / "run").string(),
          "--log", (dir / "log.jsonl").string()};
}

TEST_F(SignalTest, FirstSignalSavesACheckpointAndExitsCleanly) {
  for (int signal : {SIGINT, SIGTERM}) {
    fs::remove_all(dir_ / "run");
    fs::remove(dir_ / "log.jsonl");
    const pid_t pid = start(long_run(dir_));
    ASSERT_TRUE(wait_for_steps(dir_ / "log.jsonl", 3)) << read(dir_ / "stderr.txt");
    ::kill(pid, signal);
    EXPECT_EQ(wait_exit(pid), 128 + signal) << read(dir_ / "stderr.txt");
    const std::string latest = fs::read_symlink(dir_ / "run/latest").string();
    ASSERT_FALSE(latest.empty());
    const fs::path checkpoint = dir_ / "run" / latest;
    EXPECT_TRUE(fs::exists(checkpoint / "trainer.json"));
    EXPECT_NE(read(dir_ / "stdout.txt").find("interrupted"), std::string::npos);

    // The run continues from it.
    const int steps = std::stoi(latest.substr(5)) + 2;
    // Only the new end: every other setting of the run comes from the checkpoint.
    const pid_t resumed = start({"--resume", (dir_ / "run").string(), "--steps",
                                 std::to_string(steps), "--quiet"});
    EXPECT_EQ(wait_exit(resumed), 0) << read(dir_ / "stderr.txt");
  }
}

// `timeout`, job schedulers and shells deliver one SIGTERM to every process of the group, so it
// may arrive twice: the same signal within a second counts once, and the run still writes its
// checkpoint and exits cleanly.
TEST_F(SignalTest, TheSameSignalTwiceAtOnceCountsOnce) {
  const pid_t pid = start(long_run(dir_));
  ASSERT_TRUE(wait_for_steps(dir_ / "log.jsonl", 3)) << read(dir_ / "stderr.txt");
  ::kill(pid, SIGTERM);
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 128 + SIGTERM) << read(dir_ / "stderr.txt");
  EXPECT_EQ(read(dir_ / "stderr.txt").find("second signal"), std::string::npos);
  EXPECT_NE(read(dir_ / "stdout.txt").find("interrupted"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir_ / "run/latest/trainer.json"));
}

TEST_F(SignalTest, SecondSignalExitsAtOnceAndKeepsTheLastGoodCheckpoint) {
  std::vector<std::string> args = long_run(dir_);
  args.push_back("--save-every");
  args.push_back("1");
  const pid_t pid = start(args);
  ASSERT_TRUE(wait_for_steps(dir_ / "log.jsonl", 3)) << read(dir_ / "stderr.txt");
  ::kill(pid, SIGINT);
  ::kill(pid, SIGTERM);  // another signal: a second one, even at once
  const int code = wait_exit(pid);  // the code of whichever signal came second
  EXPECT_TRUE(code == 128 + SIGTERM || code == 128 + SIGINT) << code;
  EXPECT_NE(read(dir_ / "stderr.txt").find("second signal"), std::string::npos);
  // Whatever step it died in, `latest` names a whole checkpoint that resumes; a newer one may be
  // whole too (written before the signal, `latest` not moved yet): --resume takes the newest.
  const std::string latest = fs::read_symlink(dir_ / "run/latest").string();
  ASSERT_FALSE(latest.empty());
  int newest = std::stoi(latest.substr(5));
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_ / "run")) {
    const std::string name = entry.path().filename().string();
    if (name.size() == 11 && name.rfind("step-", 0) == 0) {  // step-NNNNNN, not a staging dir
      newest = std::max(newest, std::stoi(name.substr(5)));
    }
  }
  const int steps = newest + 1;
  const pid_t resumed = start({"--resume", (dir_ / "run").string(), "--steps",
                               std::to_string(steps), "--sample", "0", "--quiet"});
  EXPECT_EQ(wait_exit(resumed), 0) << read(dir_ / "stderr.txt");
}

// SIGKILL at random moments: during start-up, a step, a checkpoint's writing, between its rename
// and `latest`. After every kill each step-NNNNNN directory is whole (its files all there: a
// checkpoint appears by rename or not at all) and `latest` names one; the run resumes from what
// it left (from scratch with --overwrite before its first checkpoint) and is killed again until
// it reaches its last step. Every checkpoint it wrote is then the uninterrupted run's to the bit
// (weights, Adam moments), and so is every step's loss in its log. Rounds from scratch repeat
// until eight kills have landed (a kill after the run's end does not count); each kill comes at
// a moment drawn over roughly what is left of the run.
TEST_F(SignalTest, KilledAtRandomMomentsEveryResumeIsBitIdentical) {
  constexpr int kSteps = 6, kKills = 8;
  const auto args = [&](const std::string& out, const std::string& log) {
    std::vector<std::string> a = long_run(dir_);
    a[std::find(a.begin(), a.end(), "--steps") - a.begin() + 1] = std::to_string(kSteps);
    a[std::find(a.begin(), a.end(), "--out") - a.begin() + 1] = (dir_ / out).string();
    a[std::find(a.begin(), a.end(), "--log") - a.begin() + 1] = (dir_ / log).string();
    for (const char* more : {"--save-every", "1", "--quiet"}) a.push_back(more);
    return a;
  };
  const auto started = std::chrono::steady_clock::now();
  ASSERT_EQ(wait_exit(start(args("reference", "reference.jsonl"))), 0)
      << read(dir_ / "stderr.txt");
  const double whole_run =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::mt19937 rng(20261127);
  std::uniform_real_distribution<double> fraction(0.0, 1.0);
  const fs::path run = dir_ / "run";
  int kills = 0;
  for (int round = 0; round < 16 && kills < kKills; ++round) {
    fs::remove_all(run);
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 100) << "the run never reached its end";
      // CPU ranks again (--device is the machine's, not the run's: a build with the emulator
      // would resume on its GPU, in other bits).
      std::vector<std::string> resume = {"--resume", run.string(), "--steps",
                                         std::to_string(kSteps), "--device", "cpu", "--quiet"};
      std::vector<std::string> fresh = args("run", "run.jsonl");
      fresh.push_back("--overwrite");
      const std::vector<std::string> steps = step_directories(run);
      // Killed after its last checkpoint (while it sampled or exited): the run is done.
      if (!steps.empty() && steps.back() == "step-00000" + std::to_string(kSteps)) break;
      const pid_t pid = start(steps.empty() ? fresh : resume);
      if (kills < kKills) {
        // Within what is left of the run (its start-up and its steps still to go), roughly.
        const double left = static_cast<double>(kSteps + 1 - steps.size()) / (kSteps + 1);
        std::this_thread::sleep_for(std::chrono::duration<double>(fraction(rng) * left *
                                                                  whole_run));
        ::kill(pid, SIGKILL);
      }
      const int code = wait_exit(pid);
      if (code == 0) break;
      ASSERT_EQ(code, 128 + SIGKILL) << read(dir_ / "stderr.txt");
      ++kills;
      expect_whole_checkpoints(run, "after kill " + std::to_string(kills));
    }
    dstrain::testing::expect_same_checkpoints_and_losses(run, dir_ / "run.jsonl", dir_ / "reference",
                                                         dir_ / "reference.jsonl", kSteps);
    // A resume removes what a kill left half-written; the last run wrote its own whole.
    for (const fs::directory_entry& entry : fs::directory_iterator(run)) {
      EXPECT_FALSE(entry.path().filename().string().starts_with(".tmp-")) << entry.path();
    }
  }
  EXPECT_GE(kills, kKills);
}

}  // namespace
