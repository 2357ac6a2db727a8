// Sizes as people write them on the command line (`--host-memory 256G`). (Printing them:
// format_bytes in core/allocator.h.)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace dstrain {

// "256G", "256GB", "256GiB", "512M", "1T", "1.5G", "4096" (bytes), case-insensitive, spaces
// allowed between number and unit. Units are binary whatever the spelling: K = KB = KiB = 1024
// bytes, M = 2^20, G = 2^30, T = 2^40, P = 2^50. Throws UserError on anything else, on a
// negative number, and on a size that does not fit in 64 bits.
uint64_t parse_size(std::string_view text);

}  // namespace dstrain
