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

// A network rate as people write it (`--inter-node-bandwidth 200Gbit/s`), decimal prefixes K, M,
// G, T (case-insensitive), then the unit:
//   bytes: "25GB/s", "25 GBps", "25GB"  (an upper-case B)
//   bits:  "200Gbit/s", "200Gb/s", "200Gbps", "200 Gbit", "100G" (a bare prefix: links are
//          named in bits, "100G Ethernet", "400G NDR")
// Returns bytes/s. Throws UserError with one sentence naming `flag` on anything else: no
// number, no prefix or unit, a zero or negative rate.
double parse_rate(std::string_view text, const std::string& flag);

}  // namespace dstrain
