// Running a program of the build (the dstrain binary) from a test, as a user does: in a
// directory, with empty input, capturing what it prints.
#pragma once

#include <sys/wait.h>

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

}  // namespace dstrain::testing
