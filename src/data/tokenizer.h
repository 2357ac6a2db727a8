// Byte-level tokenizer: token i is byte i, vocabulary 256. No merges, no special tokens.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;
  int vocab_size() const { return kVocabSize; }

  // One token per byte.
  std::vector<int32_t> encode(std::string_view text) const;

  // The exact bytes back. REQUIRES: every token in [0, 256).
  std::string decode_bytes(std::span<const int32_t> tokens) const;

  // Text fit for a terminal or a log: printable ASCII, '\n' and '\t' as they are, complete
  // well-formed UTF-8 sequences as they are, a backslash as "\\", every other byte as "\xNN"
  // (two lowercase hex digits), and a token outside [0, 256) as "<ID>" (a model whose
  // embedding table is padded past 256 can sample one).
  std::string decode(std::span<const int32_t> tokens) const;
};

}  // namespace dstrain
