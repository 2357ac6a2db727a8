#include "train/jsonl_log.h"

#include "core/check.h"

namespace dstrain {

JsonlLog::JsonlLog(const std::string& path, bool append) : path_(path) {
  file_.open(path, append ? std::ios::app : std::ios::trunc);
  DSTRAIN_USER_CHECK(file_.is_open()) << "cannot write the log file " << path
                                      << " (does its directory exist?)";
}

void JsonlLog::write(const nlohmann::json& record) {
  if (!file_.is_open()) return;
  file_ << record.dump() << '\n';
  file_.flush();
  DSTRAIN_USER_CHECK(file_.good()) << "writing the log file " << path_ << " failed";
}

}  // namespace dstrain
