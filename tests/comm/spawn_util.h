// Helpers of the tests that run real processes: this test binary spawned again
// (/proc/self/exe, posix_spawn) with extra environment variables, which a static initializer of
// the test file reads to run its part and _Exit before gtest's main; and a bounded wait for its
// exit code. Header-only: tests/comm/ compiles only *_test.cpp files.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dstrain::test {

// Starts this binary with this process's environment plus `variables` ("NAME=value").
inline pid_t spawn_this_binary(std::vector<std::string> variables) {
  std::vector<char*> environment;
  for (char** variable = environ; *variable != nullptr; ++variable)
    environment.push_back(*variable);
  for (std::string& variable : variables) environment.push_back(variable.data());
  environment.push_back(nullptr);
  char name[] = "tests_comm";
  char* argv[] = {name, nullptr};
  pid_t pid = -1;
  const int error =
      ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, environment.data());
  EXPECT_EQ(error, 0) << "posix_spawn: " << std::strerror(error);
  return pid;
}

// The exit code of `pid`, waiting at most `seconds`; a child still running then is killed
// (and -1 returned) so a broken test fails instead of hanging.
inline int wait_for_exit(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace dstrain::test
