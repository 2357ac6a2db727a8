#include "topology/shared_memory.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "test_util.h"

namespace dstrain {
namespace {

using testing::user_error_of;

constexpr uint64_t kMiB = 1024 * 1024;
constexpr uint64_t kDockerDefault = 64 * kMiB;  // /dev/shm of `docker run` without --shm-size
const char* const kMissingPath = "/nonexistent-dstrain-test/shm";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The UserError's sentence, "" when `body` throws none.
std::string user_error_if_any(const std::function<void()>& body) {
  try {
    body();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Sets (or, with nullptr, removes) an environment variable for the life of the object.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnvironment() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The check active whatever the environment running the tests says.
struct CheckActive {
  ScopedEnvironment shm{"NCCL_SHM_DISABLE", nullptr};
  ScopedEnvironment skip{"DSTRAIN_SKIP_SHM_CHECK", nullptr};
  ScopedEnvironment simple{"NCCL_BUFFSIZE", nullptr};
  ScopedEnvironment ll{"NCCL_LL_BUFFSIZE", nullptr};
  ScopedEnvironment ll128{"NCCL_LL128_BUFFSIZE", nullptr};
};

TEST(SharedMemory, Needed_is_two_ring_segments_per_gpu_with_NCCL_defaults) {
  const uint64_t segment = 9637888;  // the segment size NCCL 2.18 reports
  const NcclProtocolBuffers defaults;
  EXPECT_EQ(nccl_shm_bytes_needed(0, defaults), 0u);
  EXPECT_EQ(nccl_shm_bytes_needed(2, defaults), 2 * 2 * segment);
  EXPECT_EQ(nccl_shm_bytes_needed(8, defaults), 8 * 2 * segment);
  EXPECT_GT(nccl_shm_bytes_needed(4, defaults), kDockerDefault);  // fails in Docker's default
  EXPECT_LT(nccl_shm_bytes_needed(2, defaults), kDockerDefault);  // two GPUs fit
}

TEST(SharedMemory, NCCL_buffer_sizes_from_the_environment_and_bad_values_ignored) {
  CheckActive active;
  ScopedEnvironment simple("NCCL_BUFFSIZE", "1048576");
  ScopedEnvironment ll("NCCL_LL_BUFFSIZE", "0x10000");
  ScopedEnvironment ll128("NCCL_LL128_BUFFSIZE", "lots");
  const NcclProtocolBuffers buffers = nccl_protocol_buffers_from_environment();
  EXPECT_EQ(buffers.simple, 1048576u);
  EXPECT_EQ(buffers.ll, 65536u);
  EXPECT_EQ(buffers.ll128, NcclProtocolBuffers{}.ll128);
  EXPECT_EQ(nccl_shm_bytes_needed(3, buffers), 3u * 2 * (4096 + 1048576 + 65536 + 4915200));
}

TEST(SharedMemory, Docker_default_is_too_small_for_8_gpus_in_one_sentence) {
  const SharedMemorySpace docker{kDockerDefault - 4096, kDockerDefault};
  const uint64_t needed = nccl_shm_bytes_needed(8, NcclProtocolBuffers{});
  const std::string message =
      user_error_of([&] { require_shared_memory("/dev/shm", docker, needed, 8); });
  ASSERT_FALSE(message.empty());
  for (const char* part : {"/dev/shm has 64.0 MiB free", "(64.0 MiB in all)", "147.1 MiB",
                           "8 GPUs", "--ipc=host", "--shm-size", "DSTRAIN_SKIP_SHM_CHECK=1"}) {
    EXPECT_TRUE(contains(message, part)) << "no '" << part << "' in: " << message;
  }
  EXPECT_FALSE(contains(message, "\n")) << message;
}

TEST(SharedMemory, Enough_space_passes_down_to_the_byte) {
  const uint64_t needed = nccl_shm_bytes_needed(8, NcclProtocolBuffers{});
  EXPECT_NO_THROW(require_shared_memory("/dev/shm", {needed, 1024 * kMiB}, needed, 8));
  EXPECT_FALSE(user_error_of([&] {
                 require_shared_memory("/dev/shm", {needed - 1, 1024 * kMiB}, needed, 8);
               }).empty());
}

TEST(SharedMemory, One_gpu_never_checks) {
  CheckActive active;
  EXPECT_NO_THROW(check_shared_memory_for_nccl(0, kMissingPath));
  EXPECT_NO_THROW(check_shared_memory_for_nccl(1, kMissingPath));
}

TEST(SharedMemory, Unreadable_path_is_a_user_error_naming_ipc_host) {
  CheckActive active;
  const std::string message =
      user_error_of([] { check_shared_memory_for_nccl(2, kMissingPath); });
  EXPECT_TRUE(contains(message, std::string("cannot read ") + kMissingPath)) << message;
  EXPECT_TRUE(contains(message, "No such file or directory")) << message;
  EXPECT_TRUE(contains(message, "--ipc=host")) << message;
}

TEST(SharedMemory, NCCL_SHM_DISABLE_or_the_escape_hatch_skips_the_check) {
  {
    CheckActive active;
    ScopedEnvironment disabled("NCCL_SHM_DISABLE", "1");
    EXPECT_NO_THROW(check_shared_memory_for_nccl(8, kMissingPath));
  }
  {
    CheckActive active;
    ScopedEnvironment skipped("DSTRAIN_SKIP_SHM_CHECK", "1");
    EXPECT_NO_THROW(check_shared_memory_for_nccl(8, kMissingPath));
  }
  {
    CheckActive active;
    ScopedEnvironment not_one("NCCL_SHM_DISABLE", "0");  // NCCL's default: the check runs
    EXPECT_FALSE(user_error_of([] { check_shared_memory_for_nccl(8, kMissingPath); }).empty());
  }
}

TEST(SharedMemory, This_machine_dev_shm_reads_sanely_and_the_check_agrees_with_it) {
  std::string error;
  const std::optional<SharedMemorySpace> space = shared_memory_space("/dev/shm", &error);
  if (!space) GTEST_SKIP() << "no /dev/shm here: " << error;
  EXPECT_GT(space->total_bytes, 0u);
  EXPECT_LE(space->free_bytes, space->total_bytes);
  CheckActive active;
  const uint64_t needed = nccl_shm_bytes_needed(8, NcclProtocolBuffers{});
  const std::string message = user_error_if_any([] { check_shared_memory_for_nccl(8); });
  // Free space may change between the two reads (other processes): only a clear margin counts.
  if (space->free_bytes > 2 * needed) {
    EXPECT_TRUE(message.empty()) << message;
  }
  if (space->free_bytes < needed / 2) {
    EXPECT_TRUE(contains(message, "--ipc=host")) << message;
  }
}

}  // namespace
}  // namespace dstrain
