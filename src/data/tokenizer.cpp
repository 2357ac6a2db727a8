#include "data/tokenizer.h"

#include "core/check.h"
#include "data/unicode_regex.h"

namespace dstrain {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode_bytes(std::span<const int32_t> tokens) const {
  std::string bytes(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    DSTRAIN_CHECK(tokens[i] >= 0 && tokens[i] < kVocabSize)
        << "token " << tokens[i] << " at " << i << " is not a byte";
    bytes[i] = static_cast<char>(static_cast<unsigned char>(tokens[i]));
  }
  return bytes;
}

std::string ByteTokenizer::decode(std::span<const int32_t> tokens) const {
  static const char kHex[] = "0123456789abcdef";
  // The bytes, with 0xFF (never part of UTF-8) standing for a token outside [0, 256), so
  // UTF-8 runs stop at it; `tokens` tells it from a real 0xFF byte.
  std::string bytes(tokens.size(), '\xff');
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= 0 && tokens[i] < kVocabSize) bytes[i] = static_cast<char>(tokens[i]);
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < bytes.size();) {
    const int b = static_cast<unsigned char>(bytes[i]);
    if (tokens[i] < 0 || tokens[i] >= kVocabSize) {
      text += "<" + std::to_string(tokens[i]) + ">";
    } else if (b == '\\') {
      text += "\\\\";
    } else if ((b >= 0x20 && b < 0x7F) || b == '\n' || b == '\t') {
      text += static_cast<char>(b);
    } else if (const size_t length = b >= 0x80 ? utf8_sequence_length(bytes, i) : 0; length > 0) {
      text.append(bytes, i, length);
      i += length;
      continue;
    } else {
      text += "\\x";
      text += kHex[b >> 4];
      text += kHex[b & 15];
    }
    ++i;
  }
  return text;
}

}  // namespace dstrain
