// Checks of a run directory after kills and resumes (tests/cli): its step-NNNNNN directories,
// each read back whole against its checksums, and a run's checkpoints and losses against an
// uninterrupted run's, to the bit.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/checksums.h"

namespace dstrain::testing {

inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

// The step-NNNNNN directories of run directory `run` (none when it does not exist); staging
// directories (.tmp-step-...) are not among them.
inline std::vector<std::string> step_directories(const std::filesystem::path& run) {
  std::vector<std::string> steps;
  if (!std::filesystem::exists(run)) return steps;
  for (const std::filesystem::directory_entry& entry : std::filesystem::directory_iterator(run)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) == 0) steps.push_back(name);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Every step directory of `run` holds every checkpoint file and reads back whole against its
// checksums.json; `latest`, if there, names one.
inline void expect_whole_checkpoints(const std::filesystem::path& run, const std::string& when) {
  for (const std::string& step : step_directories(run)) {
    for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer.json",
                             "config.json", "checksums.json"}) {
      EXPECT_TRUE(std::filesystem::exists(run / step / file))
          << step << " lacks " << file << " " << when;
    }
    EXPECT_EQ(verify_checkpoint(run / step).damage, "") << step << " " << when;
  }
  if (std::filesystem::is_symlink(run / "latest")) {
    EXPECT_TRUE(std::filesystem::exists(run / "latest" / "trainer.json")) << when;
  }
}

// Each step's loss in a JSONL log, as its text, from its last record (a killed run's steps run
// again).
inline std::map<int, std::string> losses_by_step(const std::filesystem::path& log) {
  std::map<int, std::string> by_step;
  std::ifstream file(log);
  for (std::string line; std::getline(file, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.contains("loss") && record.contains("step")) {
      by_step[record["step"].get<int>()] = record["loss"].dump();
    }
  }
  return by_step;
}

// `run` (logging to run_log) wrote the checkpoints of `reference` (reference_log), steps
// 1..steps, to the bit (weights, Adam moments), and logged the same loss for every step.
inline void expect_same_checkpoints_and_losses(const std::filesystem::path& run,
                                               const std::filesystem::path& run_log,
                                               const std::filesystem::path& reference,
                                               const std::filesystem::path& reference_log,
                                               int steps) {
  const std::vector<std::string> written = step_directories(run);
  ASSERT_EQ(written, step_directories(reference));
  ASSERT_EQ(written.size(), static_cast<size_t>(steps));
  for (const std::string& step : written) {
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(run / step / file) == file_bytes(reference / step / file))
          << step << " " << file << " differs";
    }
  }
  const std::map<int, std::string> expected = losses_by_step(reference_log);
  EXPECT_EQ(expected.size(), static_cast<size_t>(steps));
  EXPECT_EQ(losses_by_step(run_log), expected);
}

}  // namespace dstrain::testing
