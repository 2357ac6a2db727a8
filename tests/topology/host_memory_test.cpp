// The host memory this process may still allocate: the least of MemAvailable, the cgroup's
// limit beyond its usage (v2 and v1 files), and the address-space limit beyond the mapped size.
#include "topology/host_memory.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/common/temp_dir.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

class HostMemoryTest : public ::testing::Test {
 protected:
  void write(const std::string& name, const std::string& text) const {
    fs::create_directories((dir_.path() / name).parent_path());
    std::ofstream(dir_.path() / name) << text;
  }
  HostMemorySources sources() const {
    HostMemorySources s;
    s.meminfo = (dir_.path() / "meminfo").string();
    s.cgroup_root = (dir_.path() / "cgroup").string();
    s.self_status = (dir_.path() / "status").string();
    s.read_rlimit = false;
    return s;
  }
  testing::TempDir dir_;
};

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST_F(HostMemoryTest, MemAvailableAlone) {
  write("meminfo", "MemTotal:       33554432 kB\nMemAvailable:   20971520 kB\n");
  const HostMemoryBudget budget = available_host_memory(sources());
  EXPECT_EQ(budget.bytes, 20 * kGiB);
  EXPECT_NE(budget.limited_by.find("MemAvailable"), std::string::npos);
}

TEST_F(HostMemoryTest, ACgroupLimitBelowItWins) {
  write("meminfo", "MemAvailable:   20971520 kB\n");
  write("cgroup/memory.max", std::to_string(8 * kGiB) + "\n");  // v2
  write("cgroup/memory.current", std::to_string(3 * kGiB) + "\n");
  HostMemoryBudget budget = available_host_memory(sources());
  EXPECT_EQ(budget.bytes, 5 * kGiB);
  EXPECT_NE(budget.limited_by.find("cgroup"), std::string::npos) << budget.limited_by;
  // "max" (v2) or v1's huge number: no limit.
  write("cgroup/memory.max", "max\n");
  EXPECT_EQ(available_host_memory(sources()).bytes, 20 * kGiB);
  fs::remove(dir_.path() / "cgroup/memory.max");
  write("cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(available_host_memory(sources()).bytes, 20 * kGiB);
  write("cgroup/memory/memory.limit_in_bytes", std::to_string(6 * kGiB) + "\n");  // v1
  write("cgroup/memory/memory.usage_in_bytes", std::to_string(kGiB) + "\n");
  EXPECT_EQ(available_host_memory(sources()).bytes, 5 * kGiB);
}

TEST_F(HostMemoryTest, TheAddressSpaceLimitBeyondWhatIsMapped) {
  write("meminfo", "MemAvailable:   20971520 kB\n");
  write("status", "Name:\tdstrain\nVmSize:\t 1048576 kB\n");  // 1 GiB mapped
  HostMemorySources s = sources();
  s.rlimit_as = 4 * kGiB;
  const HostMemoryBudget budget = available_host_memory(s);
  EXPECT_EQ(budget.bytes, 3 * kGiB);
  EXPECT_NE(budget.limited_by.find("ulimit -v"), std::string::npos) << budget.limited_by;
}

TEST_F(HostMemoryTest, NothingReadableIsNoBudget) {
  const HostMemoryBudget budget = available_host_memory(sources());
  EXPECT_EQ(budget.bytes, 0u);
  EXPECT_TRUE(budget.limited_by.empty());
}

}  // namespace
}  // namespace dstrain
