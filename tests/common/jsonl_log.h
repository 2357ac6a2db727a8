// Reading a training log (--log, JSONL) back in a test: its records, its step records, the
// losses of its steps. A line still being written (a run going on) does not parse: skipped.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dstrain::testing {

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> records;
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object()) records.push_back(std::move(record));
  }
  return records;
}

// The step records ({"step", "loss", "lr", ...}), in order.
inline std::vector<nlohmann::json> step_records(const std::vector<nlohmann::json>& log) {
  std::vector<nlohmann::json> steps;
  for (const nlohmann::json& record : log) {
    if (record.contains("loss") && record.contains("step")) steps.push_back(record);
  }
  return steps;
}

inline std::vector<double> step_losses(const std::filesystem::path& path) {
  std::vector<double> losses;
  for (const nlohmann::json& record : step_records(read_jsonl(path))) {
    losses.push_back(record["loss"].get<double>());
  }
  return losses;
}

}  // namespace dstrain::testing
