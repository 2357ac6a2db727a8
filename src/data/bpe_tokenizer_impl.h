// BpeTokenizer's tables and the helpers its two source files share: bpe_tokenizer.cpp (reading
// tokenizer.json, the byte-level kinds, BPE itself) and bpe_sentencepiece.cpp (the
// SentencePiece kind). Internal to them: other code includes data/bpe_tokenizer.h.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/bpe_tokenizer.h"
#include "data/unicode_regex.h"

namespace dstrain {

struct AddedToken {
  std::string content;
  // What is matched: the content, or for a normalized token the normalizer's form of it (the
  // library matches those in the normalized text).
  std::string pattern;
  int32_t id = 0;
  bool normalized = false;  // matched in a second pass, on the text left between the others
};

// One step of the byte-level pre-tokenizer: a Split (regex, Isolated) or the final ByteLevel
// (optional prefix space, then its regex when use_regex).
struct PreTokenizerStep {
  std::optional<UnicodeRegex> regex;
  bool add_prefix_space = false;
};

struct Merge {
  int32_t rank = 0;
  int32_t new_id = 0;
};

// The SentencePiece kind (Llama 2, Mistral): spaces written "▁", a "▁" put before a piece of
// text, characters outside the vocabulary as <0xNN> byte tokens.
struct SentencePieceLayout {
  enum class Prepend { kNever, kFirst, kAlways };  // Metaspace's prepend_scheme
  bool prepend_normalizer = false;   // Prepend("▁"): before every piece between added tokens
  bool replace_normalizer = false;   // Replace(" ", "▁")
  std::optional<Prepend> metaspace;  // a Metaspace pre-tokenizer (then no normalizer)
  bool metaspace_split = false;      // its words cut before each "▁"
  size_t strip_start = 0;            // the decoder's Strip(" ", start, stop)
  size_t strip_stop = 0;
};

struct BpeTokenizer::Impl {
  std::string name;                                // the file, for messages
  std::unordered_map<std::string, int32_t> vocab;  // model token -> id
  std::vector<std::string> id_tokens;              // (vocab_size,) id -> token; "" for none
  std::vector<bool> id_known;                      // (vocab_size,)
  std::vector<int32_t> id_added;  // (vocab_size,) the index into `added` of the id's, or -1
  std::vector<bool> id_in_merge;  // (model ids,) a side of some merge
  std::unordered_map<uint64_t, Merge> merges;             // (left id, right id) -> rank, merged id
  std::array<int32_t, 256> byte_ids{};                    // byte -> id of its character, -1 if none
  std::vector<AddedToken> added;                          // longest pattern first
  std::array<std::vector<int>, 256> added_by_first_byte;  // byte -> indices into `added`
  std::vector<PreTokenizerStep> steps;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  bool nfc = false;  // the byte-level kinds' normalizer: NFC (Qwen2) or none
  bool added_has_newline = false;
  bool added_has_space = false;  // " " or "▁" in an added token
  std::unordered_map<std::string, std::vector<int32_t>> word_cache;  // word -> ids

  // The SentencePiece kind (bpe_sentencepiece.cpp); none for the byte-level kinds.
  std::optional<SentencePieceLayout> sentencepiece;
  std::array<int32_t, 256> byte_token_ids{};  // byte -> id of <0xNN>
  std::vector<int16_t> id_byte;               // (model ids,) the byte of <0xNN>, -1 for others
  std::array<int32_t, 128> ascii_ids{};       // ASCII character -> its vocabulary id, -1 if none

  // bpe_tokenizer.cpp
  std::vector<int32_t> encode(std::string_view text, std::vector<BpeTokenizer::TokenSpan>* spans);
  std::pair<size_t, const AddedToken*> next_added(std::string_view text, size_t from,
                                                  bool normalized_pass) const;
  // With `spans`, each id's bytes of the text go there too; `offset` is where `text` (or
  // `segment`) lies in the text given to encode.
  using Spans = std::vector<BpeTokenizer::TokenSpan>;
  void cut_added(std::string_view text, bool normalized_pass, std::vector<int32_t>& ids,
                 Spans* spans, size_t offset);
  void encode_normalized(std::string_view piece, std::vector<int32_t>& ids, Spans* spans,
                         size_t offset);
  void encode_segment(std::string_view segment, std::vector<int32_t>& ids, Spans* spans,
                      size_t offset);
  void encode_word(std::string_view word, std::vector<int32_t>& ids);
  std::vector<int32_t> word_ids(std::string_view word) const;
  std::vector<int32_t> initial_symbols(std::string_view word) const;
  bool is_fence(int32_t id) const;
  std::vector<int32_t> merge_between_fences(const std::vector<int32_t>& symbols) const;
  std::vector<int32_t> merge_symbols(std::vector<int32_t> symbols) const;

  // bpe_sentencepiece.cpp
  void encode_sentencepiece(std::string_view text, std::vector<int32_t>& ids,
                            std::vector<BpeTokenizer::TokenSpan>* spans);
  void encode_sentencepiece_piece(std::string_view text, size_t begin, size_t end,
                                  std::vector<int32_t>& ids,
                                  std::vector<BpeTokenizer::TokenSpan>* spans);
  std::vector<int32_t> sentencepiece_symbols(std::string_view word) const;
  size_t sentencepiece_length(int32_t id) const;  // the normalized bytes a model token covers
  std::string sentencepiece_bytes(int32_t id) const;
  std::string sentencepiece_decode(std::span<const int32_t> ids) const;
  size_t sentencepiece_safe_prefix(std::string_view text) const;
  std::string sentencepiece_pattern(const std::string& content) const;
};

namespace bpe_json {

using nlohmann::json;

// Throws UserError: "tokenizer 'NAME' uses WHAT, which dstrain does not support (...)".
[[noreturn]] void unsupported(const std::string& name, const std::string& what);
std::string type_of(const json& node);  // its "type", or "an untyped entry"
bool flag(const json& node, const char* key, bool fallback);
// The node at `key`, or null when there is none.
const json& field(const json& node, const char* key);

// Whether the normalizer and pre_tokenizer make the SentencePiece kind: a Metaspace
// pre-tokenizer, or a normalizer with Prepend or Replace (Llama 2's).
bool is_sentencepiece(const json& root);
// Reads the SentencePiece kind's normalizer, pre_tokenizer and decoder into impl.sentencepiece;
// refuses, naming it, any other part or combination.
void read_sentencepiece_layout(const json& root, BpeTokenizer::Impl& impl);
// After model.vocab: the 256 byte tokens byte_fallback needs (refused when one is missing).
void read_byte_tokens(BpeTokenizer::Impl& impl);

}  // namespace bpe_json

}  // namespace dstrain
