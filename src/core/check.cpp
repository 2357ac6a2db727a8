#include "core/check.h"

namespace dstrain {

ErrorContext& thread_error_context() {
  thread_local ErrorContext context;
  return context;
}

namespace detail {

void CheckMessage::raise() const {
  if (user_error_) throw UserError(stream_.str());
  std::ostringstream full;
  full << "check failed: " << expr_ << " at " << file_ << ":" << line_;
  const ErrorContext& context = thread_error_context();
  if (context.rank >= 0) full << " [rank " << context.rank << "]";
  if (!context.device.empty()) full << " [" << context.device << "]";
  const std::string text = stream_.str();
  if (!text.empty()) full << ": " << text;
  throw Error(full.str());
}

}  // namespace detail
}  // namespace dstrain
