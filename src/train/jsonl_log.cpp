#include "train/jsonl_log.h"

#include "core/check.h"
#include "core/tensorboard.h"

namespace dstrain {

JsonlLog::JsonlLog() = default;
JsonlLog::JsonlLog(JsonlLog&&) noexcept = default;
JsonlLog& JsonlLog::operator=(JsonlLog&&) noexcept = default;
JsonlLog::~JsonlLog() = default;

JsonlLog::JsonlLog(const std::string& path, bool append) : path_(path) {
  file_.open(path, append ? std::ios::app : std::ios::trunc);
  DSTRAIN_USER_CHECK(file_.is_open()) << "cannot write the log file " << path
                                      << " (does its directory exist?)";
}

void JsonlLog::add_tensorboard(const std::string& dir, int64_t start_step) {
  board_ = std::make_unique<TensorBoardWriter>(dir, start_step + 1);
  start_step_ = start_step;
}

void JsonlLog::write(const nlohmann::json& record) {
  if (file_.is_open()) {
    file_ << record.dump() << '\n';
    file_.flush();
    DSTRAIN_USER_CHECK(file_.good()) << "writing the log file " << path_ << " failed";
  }
  if (board_ == nullptr) return;
  const LogScalars scalars = scalars_of_log_record(record, start_step_);
  if (scalars.scalars.empty()) return;
  board_->add_scalars(scalars.step, scalars.scalars);
  board_->flush();
}

}  // namespace dstrain
