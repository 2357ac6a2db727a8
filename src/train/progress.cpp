#include "train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

namespace dstrain {

std::string format_duration(double seconds) {
  const long total = std::lround(std::max(0.0, seconds));
  char text[32];
  if (total >= 3600)
    std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else
    std::snprintf(text, sizeof text, "%ld:%02ld", total / 60, total % 60);
  return text;
}

ProgressPrinter::ProgressPrinter(std::ostream& out, int64_t total_steps, bool quiet,
                                 int64_t keep_every)
    : out_(out),
      total_(total_steps),
      quiet_(quiet),
      tty_(isatty(STDOUT_FILENO) != 0 && &out == &std::cout) {
  every_ = keep_every > 0 ? keep_every : std::max<int64_t>(1, total_steps / 25);
}
// One line per step: rewritten in place on a terminal, every `every_`-th kept.
void ProgressPrinter::step(int64_t step, double loss, double lr, double norm, double tokens_per_s,
                           double eta_seconds, double bubble) {
  if (quiet_) return;
  char bubble_text[32] = "";
  if (bubble >= 0) std::snprintf(bubble_text, sizeof bubble_text, " | bubble %.0f%%", 100 * bubble);
  char line[240];
  std::snprintf(line, sizeof line,
                "step %*lld/%lld | loss %.4f | lr %.2e | norm %.3f | %s tok/s%s | ETA %s", width(),
                static_cast<long long>(step + 1), static_cast<long long>(total_), loss, lr, norm,
                format_rate(tokens_per_s).c_str(), bubble_text, format_duration(eta_seconds).c_str());
  const bool keep = (step + 1) % every_ == 0 || step + 1 == total_ || step == 0;
  if (tty_) {
    out_ << "\r\033[K" << line << (keep ? "\n" : "") << std::flush;
  } else if (keep) {
    out_ << line << "\n" << std::flush;
  }
}
void ProgressPrinter::message(const std::string& text) {
  if (tty_) out_ << "\r\033[K";
  out_ << text << "\n" << std::flush;
}

}  // namespace dstrain
