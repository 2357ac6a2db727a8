// Running the command-line entry point in process, for the tests of its commands: the exit
// code and what it printed, and the check that a user's mistake is one sentence and exit 2.
#pragma once

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"

namespace dstrain::testing {

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

// run_cli with argv = "dstrain", args...
inline CliResult run_cli_args(std::vector<std::string> args) {
  args.insert(args.begin(), "dstrain");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  CliResult r;
  r.exit_code = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

// Exit 2 and exactly one line "dstrain: error: ..." holding `fragment`.
inline void expect_cli_user_error(const std::vector<std::string>& args,
                                  const std::string& fragment) {
  const CliResult r = run_cli_args(args);
  std::string joined;
  for (const std::string& a : args) joined += a + " ";
  EXPECT_EQ(r.exit_code, 2) << joined << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.rfind("dstrain: error: ", 0), 0u) << joined << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << joined << "\nstderr: " << r.err;
}

}  // namespace dstrain::testing
