// Hugging Face byte-level BPE tokenizers, read from a `tokenizer.json`: the GPT-2 kind
// (pre_tokenizer ByteLevel with its regex) and the Llama-3 / Qwen2 / DeepSeek kind
// (pre_tokenizer Sequence[Split(Regex, Isolated)..., ByteLevel(use_regex false)]).
//
// encode(text) gives the ids of the `tokenizers` library's
// `Tokenizer.encode(text, add_special_tokens=False).ids`: the added tokens (special or not)
// are cut out of the text as whole strings first (leftmost, longest at a position), each
// piece of text between them is split by the pre-tokenizer's regexes, mapped to GPT-2's
// byte-to-character alphabet, and merged by BPE rank. The post_processor (Llama 3's
// <|begin_of_text|>) is not applied.
//
// Supported: normalizer null or NFC (Qwen2's; the text between the added tokens that are not
// "normalized" is put in NFC before the rest is cut out, as the library does); model BPE (merges as "a b" strings or [a, b] pairs,
// ignore_merges, unk_token and fuse_unk; no dropout, no continuing_subword_prefix, no
// end_of_word_suffix); added tokens without lstrip, rstrip or single_word. Anything else is
// refused when the file is read, in one sentence naming what is unsupported.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dstrain {

class BpeTokenizer {
 public:
  // Reads a tokenizer.json. Throws UserError, naming the file, when it is missing, not JSON,
  // lacks model.vocab or model.merges, has a merge naming a token (or a merged token) that is
  // not in the vocabulary, an id outside [0, 2^24) or two vocabulary tokens with one id, a
  // regex that does not compile, or a normalizer, pre-tokenizer, model or option this class
  // does not implement.
  static BpeTokenizer from_file(const std::string& path);
  // The same from the JSON text; `name` appears in error messages.
  static BpeTokenizer from_json(std::string_view json_text, const std::string& name);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // One more than the largest id of the vocabulary and the added tokens: the embedding rows a
  // model needs.
  int64_t vocab_size() const;

  // The ids of `text`. Throws UserError when text is not valid UTF-8 (naming the byte offset).
  // Not thread-safe: it fills a cache of the ids of each pre-token (use one tokenizer per
  // thread).
  std::vector<int32_t> encode(std::string_view text);

  // The bytes the ids stand for: added tokens as their text, vocabulary tokens through the
  // inverse of the byte-to-character table (a token with a character outside the table as its
  // own UTF-8). Throws UserError on an id with no token.
  std::string decode_bytes(std::span<const int32_t> ids) const;
  // decode_bytes as text, the way the library's decode(ids, skip_special_tokens=False) gives
  // it: each maximal ill-formed UTF-8 subsequence becomes U+FFFD (a cut multi-byte character
  // at the end of a sample, say). An id with no token (a model's vocabulary padded past the
  // tokenizer's) shows as "<ID>" instead of an error.
  std::string decode(std::span<const int32_t> ids) const;

  // The id of a token (vocabulary or added), if there is one.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The end-of-text id for `prepare --eot`: the first added token among <|endoftext|>
  // (GPT-2, Qwen2), <|end_of_text|> (Llama 3) and <｜end▁of▁sentence｜> (DeepSeek); none when
  // the file has none of them.
  std::optional<int32_t> end_of_text_id() const;

  // The length of the longest prefix of `text` that can be encoded on its own with the same
  // ids as within the whole text: up to the last "\n" that has a printable non-space ASCII
  // character on both sides (no pre-tokenizer pattern of the supported kinds puts such a
  // newline inside a pre-token with what follows it). 0 when there is no such newline, or
  // when an added token contains a newline (it could span the cut).
  // Lets prepare encode a large file block by block.
  size_t safe_prefix_length(std::string_view text) const;

  struct Impl;  // the tables; defined in bpe_tokenizer.cpp (its readers there need the name)

 private:
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// GPT-2's byte-to-character table (`bytes_to_unicode`): the printable bytes '!'..'~',
// 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order,
// for U+0100, U+0101, ... Returns the character's code point.
char32_t byte_to_unicode(unsigned char byte);

}  // namespace dstrain
