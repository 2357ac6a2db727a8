#include "data/tokenizer.h"

#include "core/check.h"

namespace dstrain {

namespace {

// Length of the well-formed UTF-8 sequence (RFC 3629: no overlongs, no surrogates, at most
// U+10FFFF) that starts at bytes[i], or 0 when none starts there.
size_t utf8_sequence_length(const std::vector<int>& bytes, size_t i) {
  const int lead = bytes[i];
  size_t length = 0;
  int low = 0x80, high = 0xBF;  // the allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  if (i + length > bytes.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    const int b = bytes[i + k];
    const int lo = k == 1 ? low : 0x80, hi = k == 1 ? high : 0xBF;
    if (b < lo || b > hi) return 0;
  }
  return length;
}

}  // namespace

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
  // Bytes, with -1 standing for a token outside [0, 256) so UTF-8 runs stop at it.
  std::vector<int> bytes(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i)
    bytes[i] = (tokens[i] >= 0 && tokens[i] < kVocabSize) ? tokens[i] : -1;
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < bytes.size();) {
    const int b = bytes[i];
    if (b < 0) {
      text += "<" + std::to_string(tokens[i]) + ">";
    } else if (b == '\\') {
      text += "\\\\";
    } else if ((b >= 0x20 && b < 0x7F) || b == '\n' || b == '\t') {
      text += static_cast<char>(b);
    } else if (const size_t length = b >= 0x80 ? utf8_sequence_length(bytes, i) : 0; length > 0) {
      for (size_t k = 0; k < length; ++k) text += static_cast<char>(bytes[i + k]);
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
