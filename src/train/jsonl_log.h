// The JSONL training log: one JSON object per line, flushed as written, so a crashed or
// interrupted run leaves every finished record readable.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace dstrain {

class TensorBoardWriter;

// The JSONL log and, where asked, the same numbers as TensorBoard scalars
// (core/tensorboard.h: scalars_of_log_record's tags).
class JsonlLog {
 public:
  JsonlLog();  // disabled: write() does nothing
  // append: continue an existing log (a resumed run); otherwise the file is replaced.
  JsonlLog(const std::string& path, bool append);
  JsonlLog(JsonlLog&&) noexcept;
  JsonlLog& operator=(JsonlLog&&) noexcept;
  ~JsonlLog();
  // Every record written from now on also goes to a new event file in `dir`, its steps from
  // start_step + 1 (the run's first step: a resumed run's replace what an interrupted run
  // logged after its checkpoint).
  void add_tensorboard(const std::string& dir, int64_t start_step);
  bool enabled() const { return file_.is_open() || board_ != nullptr; }
  void write(const nlohmann::json& record);

 private:
  std::string path_;
  std::ofstream file_;
  std::unique_ptr<TensorBoardWriter> board_;
  int64_t start_step_ = 0;
};

}  // namespace dstrain
