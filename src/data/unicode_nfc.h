// Unicode Normalization Form C (canonical decomposition, then canonical composition), the
// "NFC" normalizer of a tokenizer.json (Qwen2's), through utf8proc.
#pragma once

#include <string>
#include <string_view>

namespace dstrain {

// The NFC form of `text`. REQUIRES: valid UTF-8 (BpeTokenizer::encode checks it first);
// throws UserError otherwise.
std::string nfc_normalize(std::string_view text);

}  // namespace dstrain
