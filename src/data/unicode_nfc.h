// Unicode Normalization Form C (canonical decomposition, then canonical composition), the
// "NFC" normalizer of a tokenizer.json (Qwen2's), through utf8proc.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dstrain {

// The NFC form of `text`. REQUIRES: valid UTF-8 (BpeTokenizer::encode checks it first);
// throws UserError otherwise.
std::string nfc_normalize(std::string_view text);

// The NFC form of a text with the way back to the text's bytes. The text is cut before each
// ASCII byte (no character composes with an ASCII one that follows it, and none reorders across
// it, so the pieces' NFC forms make the whole's); the pieces NFC changes are kept.
struct NfcAligned {
  std::string normalized;  // == nfc_normalize(text)
  struct Change {
    size_t text_begin, text_end;  // the piece in the text
    size_t nfc_begin, nfc_end;    // its NFC form in `normalized`
  };
  std::vector<Change> changes;  // rising

  // The bytes of the text that bytes [begin, end) of `normalized` come from: exact outside the
  // changed pieces, a range that ends (begins) inside one widened to its whole.
  std::pair<size_t, size_t> to_text(size_t begin, size_t end) const;
};
// REQUIRES: valid UTF-8 (as nfc_normalize).
NfcAligned nfc_normalize_aligned(std::string_view text);

}  // namespace dstrain
