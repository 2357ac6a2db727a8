// The JSONL training log: one JSON object per line, flushed as written, so a crashed or
// interrupted run leaves every finished record readable.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace dstrain {

class JsonlLog {
 public:
  JsonlLog() = default;  // disabled: write() does nothing
  // append: continue an existing log (a resumed run); otherwise the file is replaced.
  JsonlLog(const std::string& path, bool append);
  bool enabled() const { return file_.is_open(); }
  void write(const nlohmann::json& record);

 private:
  std::string path_;
  std::ofstream file_;
};

}  // namespace dstrain
