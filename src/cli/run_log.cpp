#include "cli/run_log.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace {

using ordered_json = nlohmann::ordered_json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The parts a step's time splits into (they add up to step_s), in the order the report stacks
// them. Other keys (comm_total_s: all communication, most of it hidden behind compute) are not
// parts of the sum and are not read.
const char* const kTimeParts[] = {"compute_s", "comm_exposed_s", "bubble_s", "optimizer_s",
                                  "other_s"};

// Where a record came from, for messages.
struct Place {
  const std::string& path;
  size_t line;
};

std::string excerpt(const std::string& line) {
  return line.size() <= 40 ? line : line.substr(0, 40) + "...";
}

// A number field: NaN when absent or null (a non-finite value is written as null).
double number_field(const ordered_json& record, const char* key, const Place& at) {
  const auto it = record.find(key);
  if (it == record.end() || it->is_null()) return kNaN;
  DSTRAIN_USER_CHECK(it->is_number()) << "line " << at.line << " of " << at.path << ": \"" << key
                                      << "\" is " << it->dump() << ", not a number";
  return it->get<double>();
}

int64_t step_field(const ordered_json& record, const Place& at) {
  const auto it = record.find("step");
  DSTRAIN_USER_CHECK(it != record.end() && it->is_number_integer() && it->get<int64_t>() >= 0)
      << "line " << at.line << " of " << at.path
      << ": a step or eval record needs \"step\", a whole number >= 0";
  return it->get<int64_t>();
}

void read_time(const ordered_json& time, const Place& at, StepRecord& step) {
  DSTRAIN_USER_CHECK(time.is_object())
      << "line " << at.line << " of " << at.path << ": \"time\" is not an object";
  for (const char* part : kTimeParts) {
    if (time.contains(part)) step.time_parts.emplace_back(part, number_field(time, part, at));
  }
  if (time.contains("step_s")) step.step_seconds = number_field(time, "step_s", at);
}

StepRecord read_step(const ordered_json& record, const Place& at) {
  StepRecord step;
  step.step = step_field(record, at);
  step.loss = number_field(record, "loss", at);
  step.lr = number_field(record, "lr", at);
  step.grad_norm = number_field(record, "grad_norm", at);
  step.tokens_per_s = number_field(record, "tokens_per_s", at);
  if (record.contains("loss_scale")) step.loss_scale = number_field(record, "loss_scale", at);
  if (record.contains("mfu")) step.mfu = number_field(record, "mfu", at);
  if (const auto it = record.find("skipped"); it != record.end()) {
    DSTRAIN_USER_CHECK(it->is_boolean())
        << "line " << at.line << " of " << at.path << ": \"skipped\" is not true or false";
    step.skipped = it->get<bool>();
  }
  if (const auto it = record.find("time"); it != record.end()) read_time(*it, at, step);
  return step;
}

// One rank's {category: bytes} into `memory` (categories in first-seen order).
void read_memory_row(const ordered_json& row, const Place& at, MemoryRecord& memory) {
  DSTRAIN_USER_CHECK(row.is_object())
      << "line " << at.line << " of " << at.path << ": a memory record's peak bytes are not an "
      << "object of {category: bytes}";
  std::vector<double> values(memory.categories.size(), 0.0);
  for (const auto& [category, bytes] : row.items()) {
    auto it = std::find(memory.categories.begin(), memory.categories.end(), category);
    if (it == memory.categories.end()) {
      memory.categories.push_back(category);
      for (std::vector<double>& earlier : memory.per_rank) earlier.push_back(0.0);
      values.push_back(0.0);
      it = memory.categories.end() - 1;
    }
    values[static_cast<size_t>(it - memory.categories.begin())] =
        number_field(row, category.c_str(), at);
  }
  memory.per_rank.push_back(std::move(values));
}

MemoryRecord read_memory(const ordered_json& record, const Place& at) {
  MemoryRecord memory;
  if (const auto it = record.find("ranks"); it != record.end() && it->is_number_integer()) {
    memory.ranks = it->get<int64_t>();
  }
  if (const auto it = record.find("per_rank_peak_bytes"); it != record.end()) {
    DSTRAIN_USER_CHECK(it->is_array())
        << "line " << at.line << " of " << at.path << ": \"per_rank_peak_bytes\" is not a list";
    for (const ordered_json& row : *it) read_memory_row(row, at, memory);
    memory.by_rank = true;
    memory.ranks = static_cast<int64_t>(memory.per_rank.size());
  } else if (const auto peak = record.find("peak_bytes"); peak != record.end()) {
    read_memory_row(*peak, at, memory);
  }
  return memory;
}

// A resumed run logs again from its checkpoint's step: its records replace the earlier ones
// from `step` on.
void drop_from(int64_t step, RunLog& log) {
  std::erase_if(log.steps, [&](const StepRecord& s) { return s.step >= step; });
  std::erase_if(log.evals, [&](const EvalRecord& e) { return e.step >= step; });
}

void read_record(const ordered_json& record, const Place& at, RunLog& log) {
  const auto type = record.find("type");
  if (type != record.end() && type->is_string()) {
    const std::string& kind = type->get_ref<const std::string&>();
    if (kind == "config") log.config = record;
    if (kind == "data") {
      const double floor = number_field(record, "entropy_floor", at);
      if (std::isfinite(floor)) log.entropy_floor = floor;
    }
    if (kind == "memory") log.memory = read_memory(record, at);
    if (kind == "summary") log.summary = record;
    return;  // other types: records this reader does not know
  }
  if (record.contains("eval_loss")) {
    const EvalRecord eval{step_field(record, at), number_field(record, "eval_loss", at)};
    std::erase_if(log.evals, [&](const EvalRecord& e) { return e.step >= eval.step; });
    log.evals.push_back(eval);
  } else if (record.contains("loss")) {
    StepRecord step = read_step(record, at);
    if (!log.steps.empty() && step.step <= log.steps.back().step) drop_from(step.step, log);
    log.steps.push_back(std::move(step));
  }
}

}  // namespace

RunLog parse_run_log_text(const std::string& text, const std::string& path) {
  RunLog log;
  log.path = path;
  const size_t slash = path.find_last_of('/');
  log.label = slash == std::string::npos ? path : path.substr(slash + 1);
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    const bool torn = end == std::string::npos;  // the last line, with no newline after it
    if (torn) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ordered_json record = ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) {
      if (torn) {
        log.warnings.push_back("skipped the unfinished last line " + std::to_string(line_number) +
                               " of " + path + " (a run stopped while writing it?)");
        continue;
      }
      DSTRAIN_USER_ERROR() << "line " << line_number << " of " << path << " is not a JSON object ("
                           << excerpt(line) << "): a dstrain --log file has one per line";
    }
    read_record(record, Place{path, line_number}, log);
  }
  DSTRAIN_USER_CHECK(!log.steps.empty())
      << path << " has no step records (a log of `dstrain --log FILE` has one per step)";
  return log;
}

RunLog parse_run_log(const std::string& path) { return parse_run_log_text(read_file(path), path); }

}  // namespace dstrain
