// What a run prints while it trains: one line per step (rewritten in place on a terminal,
// every few steps kept), and messages.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "core/format.h"  // format_rate

namespace dstrain {

std::string format_duration(double seconds);  // "1:05", "2:03:04"

class ProgressPrinter {
 public:
  // keep_every: every how many steps a line stays (piped output prints only those);
  // 0: about 25 lines per run.
  ProgressPrinter(std::ostream& out, int64_t total_steps, bool quiet, int64_t keep_every = 0);
  // step is 0-based. bubble: the pipeline's mean share of the step spent waiting (< 0: no
  // pipeline, not shown).
  void step(int64_t step, double loss, double lr, double norm, double tokens_per_s,
            double eta_seconds, double bubble = -1.0);
  void message(const std::string& text);

 private:
  int width() const { return static_cast<int>(std::to_string(total_).size()); }
  std::ostream& out_;
  int64_t total_;
  bool quiet_;
  bool tty_;
  int64_t every_;
};

}  // namespace dstrain
