// The fuzz entries: one function per parser of what other people make (files from the Hugging
// Face hub, nvidia-smi's text, DeepSpeed's configs, checkpoints) and per wire format (the TCP
// store's frames, both directions). Each takes the bytes of one input, hands them to the
// parser's public entry point (through a scratch file where that entry point takes a path)
// and uses what it returns.
//
// The contract every entry checks: an input parses, or is refused with dstrain::UserError (the
// TCP store's frames: dstrain::Error, which tcp_store.h documents for a malformed message).
// Anything else escapes: another exception, a crash, a sanitizer report, a hang, or (under
// libFuzzer) an allocation above -malloc_limit_mb. Both the libFuzzer targets
// (fuzz_target.cpp, built with DSTRAIN_FUZZ=ON) and the regression test (regression_test.cpp,
// in every build) call them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dstrain::fuzz {

using FuzzInput = std::span<const uint8_t>;

struct FuzzEntry {
  std::string name;  // the format: tests/fuzz/corpus/<name>/, tests/fuzz/regressions/<name>/
  void (*run)(FuzzInput input);
};

// Every entry, in a fixed order.
const std::vector<FuzzEntry>& fuzz_entries();
// REQUIRES: `name` is an entry's name.
const FuzzEntry& fuzz_entry(const std::string& name);

}  // namespace dstrain::fuzz
