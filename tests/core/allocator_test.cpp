// The allocator's limit (--gpu-memory): allocations up to it succeed, one past it is refused
// with a sentence naming the flag, the category, the device and what is held.
#include <gtest/gtest.h>

#include <string>

#include "core/allocator.h"
#include "core/check.h"

namespace dstrain {
namespace {

TEST(AllocatorLimit, RefusesPastTheLimitNamingWhatItWasFor) {
  auto allocator = make_cpu_allocator(3);
  allocator->set_limit(4096, "--gpu-memory 4K");
  Buffer params = allocator->allocate(MemCategory::Parameters, 3000);
  Buffer grads = allocator->allocate(MemCategory::Gradients, 1096);  // exactly at the limit
  EXPECT_EQ(allocator->stats().current_total, 4096u);
  try {
    (void)allocator->allocate(MemCategory::Activations, 1);
    FAIL() << "an allocation past the limit succeeded";
  } catch (const UserError& e) {
    const std::string text = e.what();
    for (const char* part : {"--gpu-memory 4K: 1 B more for activations would bring cpu:3 to",
                             "past its 4.0 KiB", "(held: parameters 2.9 KiB, gradients"}) {
      EXPECT_NE(text.find(part), std::string::npos) << part << "\n" << text;
    }
  }
  grads.reset();  // released memory counts no more
  Buffer activations = allocator->allocate(MemCategory::Activations, 1096);
  EXPECT_EQ(allocator->stats().current_total, 4096u);
  allocator->set_limit(0, "");  // no limit
  Buffer more = allocator->allocate(MemCategory::Workspace, 1 << 20);
  EXPECT_FALSE(more.empty());
}

}  // namespace
}  // namespace dstrain
