// Running a program of the build (the dstrain binary) from a test, as a user does: in a
// directory, with empty input, capturing what it prints.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace dstrain::testing {

struct BinaryResult {
  int exit_code = -1;  // 128 + the signal when one killed it
  std::string out;
  std::string err;
};

// Runs `binary args` (`args`: a shell word list) in `dir`; stdout and stderr pass through
// dir/stdout.txt and dir/stderr.txt.
inline BinaryResult run_binary(const std::string& binary, const std::string& args,
                               const std::filesystem::path& dir) {
  const std::filesystem::path out_file = dir / "stdout.txt", err_file = dir / "stderr.txt";
  const std::string command = "cd '" + dir.string() + "' && " + binary + " " + args + " >'" +
                              out_file.string() + "' 2>'" + err_file.string() + "' </dev/null";
  const int status = std::system(command.c_str());
  BinaryResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream out(out_file), err(err_file);
  result.out.assign(std::istreambuf_iterator<char>(out), {});
  result.err.assign(std::istreambuf_iterator<char>(err), {});
  return result;
}

// A user's mistake as the binary reports it: exit code 2 and exactly one line
// "dstrain: error: ..." holding `fragment` (`args`: the command, for the failure message).
inline void expect_one_sentence(const BinaryResult& result, const std::string& args,
                                const std::string& fragment) {
  EXPECT_EQ(result.exit_code, 2) << args << "\nstderr: " << result.err;
  EXPECT_EQ(result.err.rfind("dstrain: error: ", 0), 0u) << args << "\nstderr: " << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(fragment), std::string::npos)
      << args << "\nexpected '" << fragment << "' in: " << result.err;
  EXPECT_EQ(result.err.find("terminate"), std::string::npos) << result.err;
}

}  // namespace dstrain::testing
