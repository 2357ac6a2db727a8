// The command line: `dstrain [train] [flags]`, `dstrain prepare ...`, `dstrain --help`.
#pragma once

#include <ostream>

namespace dstrain {

// Runs one command line. Returns the process exit code: 0 success, 2 a user's mistake (one
// sentence on `err`), 1 an internal error. Never exits the process itself.
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace dstrain
