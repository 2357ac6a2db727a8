// One libFuzzer target: compiled once per fuzz entry (tests/fuzz/CMakeLists.txt), with
// DSTRAIN_FUZZ_ENTRY its name, as the program fuzz_<name>.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_entries.h"

#ifndef DSTRAIN_FUZZ_ENTRY
#error "DSTRAIN_FUZZ_ENTRY names the fuzz entry of this target"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dstrain::fuzz::FuzzEntry& entry = dstrain::fuzz::fuzz_entry(DSTRAIN_FUZZ_ENTRY);
  entry.run({data, size});
  return 0;
}
