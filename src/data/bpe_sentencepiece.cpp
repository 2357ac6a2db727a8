// The SentencePiece kind of BpeTokenizer (Llama 2, Mistral, Mixtral): reading its layout,
// encoding with "▁" and byte fallback, its safe cuts, decoding through its decoder. The
// semantics are the `tokenizers` library's (normalizers/prepend.rs, normalizers/replace.rs,
// pre_tokenizers/metaspace.rs, models/bpe/model.rs merge_word, decoders/byte_fallback.rs,
// decoders/strip.rs), checked against it by tests/reference/make_tokenizer_fixtures.py.
#include <algorithm>
#include <optional>

#include "core/check.h"
#include "data/bpe_tokenizer_impl.h"
#include "data/unicode_nfc.h"

namespace dstrain {

namespace {

using nlohmann::json;
using TokenSpan = BpeTokenizer::TokenSpan;

constexpr std::string_view kMeta = "\xE2\x96\x81";  // "▁" (U+2581), SentencePiece's space
constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// The name of the byte token of `byte`: "<0xNN>", upper-case hex as the library looks it up.
std::string byte_token_name(unsigned char byte) {
  constexpr char kHex[] = "0123456789ABCDEF";
  return std::string("<0x") + kHex[byte >> 4] + kHex[byte & 15] + ">";
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The byte of a token the ByteFallback decoder reads as one: "<0x" two hex digits ">".
std::optional<unsigned char> byte_of_token(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  const int high = hex_digit(token[3]), low = hex_digit(token[4]);
  if (high < 0 || low < 0) return std::nullopt;
  return static_cast<unsigned char>(high * 16 + low);
}

std::string with_spaces(std::string_view token) {  // every "▁" as " "
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const bool meta = token.substr(i, kMeta.size()) == kMeta;
    out += meta ? ' ' : token[i];
    i += meta ? kMeta.size() : 1;
  }
  return out;
}

size_t char_end(std::string_view text, size_t i) {
  return i + std::max<size_t>(1, utf8_sequence_length(text, i));
}

// ---------------------------------------------------------------------------------------------
// Reading the layout

using bpe_json::field;
using bpe_json::type_of;
using bpe_json::unsupported;

// "Sequence[Prepend, Replace]" and the like, for messages.
std::string describe(const json& node, const char* list_key) {
  if (node.is_null()) return "none";
  std::string text = type_of(node);
  if (text != "Sequence" || !field(node, list_key).is_array()) return text;
  text += "[";
  for (const json& part : node[list_key]) text += (text.back() == '[' ? "" : ", ") + type_of(part);
  return text + "]";
}

// The parts of a Sequence (or the node alone).
std::vector<json> parts_of(const json& node, const char* list_key) {
  if (type_of(node) == "Sequence" && field(node, list_key).is_array())
    return node[list_key].get<std::vector<json>>();
  return {node};
}

bool is_string(const json& node, const char* key, std::string_view value) {
  return field(node, key).is_string() && node[key].get<std::string>() == value;
}

// Replace(String `from` -> `to`).
bool is_replace(const json& node, std::string_view from, std::string_view to) {
  return type_of(node) == "Replace" && is_string(field(node, "pattern"), "String", from) &&
         is_string(node, "content", to);
}

void read_normalizer(const json& normalizer, BpeTokenizer::Impl& impl) {
  SentencePieceLayout& layout = *impl.sentencepiece;
  const std::string refused =
      "the normalizer " + describe(normalizer, "normalizers") +
      " (supported for the SentencePiece kind: Prepend(\"\xE2\x96\x81\") and Replace(\" \", "
      "\"\xE2\x96\x81\") in a Sequence, or none)";
  for (const json& part : parts_of(normalizer, "normalizers")) {
    if (type_of(part) == "Prepend" && is_string(part, "prepend", kMeta) &&
        !layout.prepend_normalizer) {
      layout.prepend_normalizer = true;
    } else if (is_replace(part, " ", kMeta) && !layout.replace_normalizer) {
      layout.replace_normalizer = true;
    } else {
      unsupported(impl.name, refused);
    }
  }
  if (!layout.replace_normalizer) unsupported(impl.name, refused);
}

void read_metaspace(const json& metaspace, BpeTokenizer::Impl& impl) {
  SentencePieceLayout& layout = *impl.sentencepiece;
  if (!is_string(metaspace, "replacement", kMeta))
    unsupported(impl.name, "a Metaspace pre-tokenizer with the replacement " +
                               field(metaspace, "replacement").dump() +
                               " (supported: \"\xE2\x96\x81\")");
  using Prepend = SentencePieceLayout::Prepend;
  // prepend_scheme is "always" when missing; older files also say add_prefix_space, which
  // must then not be false (the library's rule).
  const json& scheme = field(metaspace, "prepend_scheme");
  const std::string name = scheme.is_string() ? scheme.get<std::string>() : "always";
  if (name == "always") layout.metaspace = Prepend::kAlways;
  if (name == "first") layout.metaspace = Prepend::kFirst;
  if (name == "never") layout.metaspace = Prepend::kNever;
  if (!layout.metaspace)
    unsupported(impl.name, "a Metaspace pre-tokenizer with prepend_scheme " + scheme.dump() +
                               " (supported: always, first, never)");
  if (!bpe_json::flag(metaspace, "add_prefix_space", true) && name != "never")
    unsupported(impl.name,
                "a Metaspace pre-tokenizer with add_prefix_space false and "
                "prepend_scheme " +
                    name + " (they contradict each other)");
  layout.metaspace_split = bpe_json::flag(metaspace, "split", true);
}

// Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", n, m)?]: the decoder of the real
// files (transformers' LlamaConverter writes it for both layouts).
void read_decoder(const json& decoder, BpeTokenizer::Impl& impl) {
  const std::vector<json> parts = parts_of(decoder, "decoders");
  const bool strip =
      parts.size() == 4 && type_of(parts[3]) == "Strip" && is_string(parts[3], "content", " ") &&
      field(parts[3], "start").is_number_unsigned() && field(parts[3], "stop").is_number_unsigned();
  const bool known = type_of(decoder) == "Sequence" && (parts.size() == 3 || strip) &&
                     is_replace(parts[0], kMeta, " ") && type_of(parts[1]) == "ByteFallback" &&
                     type_of(parts[2]) == "Fuse";
  if (!known)
    unsupported(impl.name,
                "the decoder " + describe(decoder, "decoders") +
                    " (supported for the SentencePiece kind: Sequence[Replace(\"\xE2\x96\x81\", "
                    "\" \"), ByteFallback, Fuse, Strip(\" \", start, stop)])");
  if (strip) {
    impl.sentencepiece->strip_start = parts[3]["start"].get<size_t>();
    impl.sentencepiece->strip_stop = parts[3]["stop"].get<size_t>();
  }
}

}  // namespace

namespace bpe_json {

bool is_sentencepiece(const json& root) {
  if (type_of(field(root, "pre_tokenizer")) == "Metaspace") return true;
  for (const json& part : parts_of(field(root, "normalizer"), "normalizers"))
    if (type_of(part) == "Prepend" || type_of(part) == "Replace") return true;
  return false;
}

void read_sentencepiece_layout(const json& root, BpeTokenizer::Impl& impl) {
  impl.sentencepiece.emplace();
  const json& normalizer = field(root, "normalizer");
  const json& pre = field(root, "pre_tokenizer");
  if (type_of(pre) == "Metaspace") {
    if (!normalizer.is_null())
      unsupported(impl.name, "a Metaspace pre-tokenizer after the normalizer " +
                                 describe(normalizer, "normalizers"));
    read_metaspace(pre, impl);
  } else {
    if (!pre.is_null())
      unsupported(impl.name, "the pre-tokenizer " + describe(pre, "pretokenizers") +
                                 " after a Prepend/Replace normalizer (supported: none)");
    read_normalizer(normalizer, impl);
  }
  read_decoder(field(root, "decoder"), impl);
}

void read_byte_tokens(BpeTokenizer::Impl& impl) {
  impl.id_byte.assign(impl.id_tokens.size(), -1);
  for (int b = 0; b < 256; ++b) {
    const std::string name = byte_token_name(static_cast<unsigned char>(b));
    const auto found = impl.vocab.find(name);
    if (found == impl.vocab.end())
      unsupported(impl.name, "byte_fallback without the byte token " + name + " in model.vocab");
    impl.byte_token_ids[b] = found->second;
    impl.id_byte[found->second] = static_cast<int16_t>(b);
  }
  for (int c = 0; c < 128; ++c) {
    const auto found = impl.vocab.find(std::string(1, static_cast<char>(c)));
    impl.ascii_ids[c] = found == impl.vocab.end() ? -1 : found->second;
  }
}

}  // namespace bpe_json

// ---------------------------------------------------------------------------------------------
// Encoding

namespace {

// A stretch of the text in the model's alphabet: bytes [begin, end) of the text with each
// space as "▁", after a "▁" that stands for no byte of the text when `prefix` (Prepend's or
// Metaspace's).
struct MetaText {
  size_t begin = 0;
  size_t end = 0;
  bool prefix = false;
};

std::string meta_string(std::string_view text, MetaText meta) {
  std::string out(meta.prefix ? kMeta : "");
  for (size_t i = meta.begin; i < meta.end; ++i) {
    if (text[i] == ' ') {
      out += kMeta;
    } else {
      out += text[i];
    }
  }
  return out;
}

// Walks a MetaText's normalized bytes and the text's characters together, so that the
// normalized bytes of a token give the text's bytes it stands for, as the library's offsets:
// a prefix "▁" is aligned with the first character after it, a "▁" with its space, a byte
// token with its whole character. Tokens must come in order.
class MetaCursor {
 public:
  MetaCursor(std::string_view text, MetaText meta) : text_(text), next_char_(meta.begin) {
    if (meta.prefix) {  // the first unit: the prefix, over the first character
      unit_ = {meta.begin, char_end(text, meta.begin)};
      normalized_end_ = kMeta.size();
    }
  }

  // The text bytes of normalized bytes [begin, end), begin at or after the last call's end.
  TokenSpan span(size_t begin, size_t end) {
    seek(begin);
    const size_t first = unit_.begin;
    seek(end - 1);
    return {first, unit_.end};
  }

 private:
  void seek(size_t normalized) {
    while (normalized >= normalized_end_) {  // to the next character
      unit_ = {next_char_, char_end(text_, next_char_)};
      next_char_ = unit_.end;
      normalized_end_ += text_[unit_.begin] == ' ' ? kMeta.size() : unit_.end - unit_.begin;
    }
  }

  std::string_view text_;
  size_t next_char_;
  TokenSpan unit_;             // the text bytes of the current unit
  size_t normalized_end_ = 0;  // where the current unit's normalized bytes end
};

// The bytes of `word` (normalized bytes [begin, end) of a MetaText) as ids, with their spans.
struct WordSink {
  BpeTokenizer::Impl& impl;
  std::vector<int32_t>& ids;
  std::vector<TokenSpan>* spans;
  std::optional<MetaCursor> cursor;

  void word(std::string_view normalized, size_t begin, size_t end) {
    const size_t first = ids.size();
    impl.encode_word(normalized.substr(begin, end - begin), ids);
    if (!cursor) return;
    size_t at = begin;
    for (size_t i = first; i < ids.size(); ++i) {
      const size_t length = impl.sentencepiece_length(ids[i]);
      spans->push_back(cursor->span(at, at + length));
      at += length;
    }
    DSTRAIN_CHECK(at == end) << "the tokens of a word of " << end - begin << " bytes spell "
                             << at - begin;
  }

  void added(const AddedToken& token, size_t at) {
    ids.push_back(token.id);
    if (cursor) spans->push_back(cursor->span(at, at + token.pattern.size()));
  }
};

// Normalized bytes [begin, end) as BPE words: one, or with Metaspace's split one before each
// "▁".
void encode_words(std::string_view normalized, size_t begin, size_t end, bool split,
                  WordSink& sink) {
  size_t word_begin = begin;
  for (size_t i = begin + 1; split && i < end; ++i) {
    if (normalized.compare(i, kMeta.size(), kMeta) != 0) continue;
    sink.word(normalized, word_begin, i);
    word_begin = i;
  }
  if (end > word_begin) sink.word(normalized, word_begin, end);
}

// A MetaText, with the normalized added tokens cut out of it when `cut_added` (Llama 2's
// layout matches them in the normalized text), as BPE words.
void encode_meta(BpeTokenizer::Impl& impl, std::string_view text, MetaText meta, bool cut_added,
                 std::vector<int32_t>& ids, std::vector<TokenSpan>* spans) {
  const std::string normalized = meta_string(text, meta);
  WordSink sink{impl, ids, spans, std::nullopt};
  if (spans != nullptr) sink.cursor.emplace(text, meta);
  const bool split = impl.sentencepiece->metaspace_split;
  for (size_t from = 0;;) {
    const auto [at, token] = cut_added
                                 ? impl.next_added(normalized, from, true)
                                 : std::pair<size_t, const AddedToken*>{normalized.size(), nullptr};
    encode_words(normalized, from, at, split, sink);
    if (token == nullptr) return;
    sink.added(*token, at);
    from = at + token->pattern.size();
  }
}

}  // namespace

// One piece between the added tokens that are not normalized.
void BpeTokenizer::Impl::encode_sentencepiece_piece(std::string_view text, size_t begin, size_t end,
                                                    std::vector<int32_t>& ids,
                                                    std::vector<TokenSpan>* spans) {
  const SentencePieceLayout& layout = *sentencepiece;
  if (!layout.metaspace) {  // the normalizer: the whole piece, cut by the normalized tokens
    encode_meta(*this, text, {begin, end, layout.prepend_normalizer}, true, ids, spans);
    return;
  }
  // Metaspace: the normalized tokens are cut from the text as it is (no normalizer), then each
  // stretch between them is pre-tokenized on its own.
  const std::string_view piece_text = text.substr(0, end);
  for (size_t from = begin;;) {
    const auto [at, token] = next_added(piece_text, from, true);
    if (at > from) {
      const bool starts_with_meta = text[from] == ' ' || text.substr(from, 3) == kMeta;
      const bool wanted = *layout.metaspace == SentencePieceLayout::Prepend::kAlways ||
                          (*layout.metaspace == SentencePieceLayout::Prepend::kFirst && from == 0);
      encode_meta(*this, text, {from, at, wanted && !starts_with_meta}, false, ids, spans);
    }
    if (token == nullptr) return;
    ids.push_back(token->id);
    if (spans != nullptr) spans->push_back({at, at + token->pattern.size()});
    from = at + token->pattern.size();
  }
}

void BpeTokenizer::Impl::encode_sentencepiece(std::string_view text, std::vector<int32_t>& ids,
                                              std::vector<TokenSpan>* spans) {
  for (size_t from = 0;;) {
    const auto [at, token] = next_added(text, from, false);
    if (at > from) encode_sentencepiece_piece(text, from, at, ids, spans);
    if (token == nullptr) return;
    ids.push_back(token->id);
    if (spans != nullptr) spans->push_back({at, at + token->pattern.size()});
    from = at + token->pattern.size();
  }
}

// One symbol per character in the vocabulary, else one byte token per byte of it (all 256
// exist, so there is never an unk_token).
std::vector<int32_t> BpeTokenizer::Impl::sentencepiece_symbols(std::string_view word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  for (size_t i = 0; i < word.size();) {
    const size_t end = char_end(word, i);
    int32_t id = -1;
    if (end == i + 1 && static_cast<unsigned char>(word[i]) < 128) {
      id = ascii_ids[static_cast<unsigned char>(word[i])];
    } else if (const auto found = vocab.find(std::string(word.substr(i, end - i)));
               found != vocab.end()) {
      id = found->second;
    }
    if (id >= 0) {
      symbols.push_back(id);
    } else {
      for (size_t b = i; b < end; ++b)
        symbols.push_back(byte_token_ids[static_cast<unsigned char>(word[b])]);
    }
    i = end;
  }
  return symbols;
}

size_t BpeTokenizer::Impl::sentencepiece_length(int32_t id) const {
  if (static_cast<size_t>(id) < id_byte.size() && id_byte[id] >= 0) return 1;
  return id_tokens[id].size();
}

// A normalized added token is matched in its normalized form.
std::string BpeTokenizer::Impl::sentencepiece_pattern(const std::string& content) const {
  if (sentencepiece->metaspace) return content;  // no normalizer
  return meta_string(content, {0, content.size(), sentencepiece->prepend_normalizer});
}

// ---------------------------------------------------------------------------------------------
// Safe cuts

size_t BpeTokenizer::Impl::sentencepiece_safe_prefix(std::string_view text) const {
  const SentencePieceLayout& layout = *sentencepiece;
  // Prepend would give the block after any cut a "▁" the whole text has not; an added token
  // with a space could span the cut.
  if (layout.prepend_normalizer || added_has_space) return 0;
  const bool split_at_spaces = layout.metaspace && layout.metaspace_split;
  if (!split_at_spaces && ignore_merges) return 0;  // a whole word could be one token
  for (size_t p = text.size(); p-- > 1;) {
    if (text[p] != ' ') continue;
    if (split_at_spaces) return p;
    // The word runs on over the space: it is merged apart there only after a fence (an ASCII
    // character; a space before is a "▁", which merges).
    const auto before = static_cast<unsigned char>(text[p - 1]);
    if (before >= 128 || before == ' ') continue;
    const int32_t id = ascii_ids[before] >= 0 ? ascii_ids[before] : byte_token_ids[before];
    if (is_fence(id)) return p;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Decoding

// An added token: its content, or for a normalized one its normalized form with "▁" as a space
// (" lazy dog" for "lazy dog" under Prepend: the prefix it took).
std::string BpeTokenizer::Impl::sentencepiece_bytes(int32_t id) const {
  if (id_added[id] >= 0) {
    const AddedToken& token = added[id_added[id]];
    return token.normalized ? with_spaces(token.pattern) : token.content;
  }
  if (static_cast<size_t>(id) < id_byte.size() && id_byte[id] >= 0)
    return std::string(1, static_cast<char>(id_byte[id]));
  return with_spaces(id_tokens[id]);
}

namespace {

// The decoder's ByteFallback and Fuse, one token at a time: runs of byte tokens become their
// bytes when those are UTF-8, else one U+FFFD per byte token.
class FallbackText {
 public:
  void add(const std::string& token) {
    if (const std::optional<unsigned char> byte = byte_of_token(token)) {
      run_ += static_cast<char>(*byte);
      ++run_tokens_;
      return;
    }
    flush();
    text_ += token;
  }

  std::string finish() {
    flush();
    return std::move(text_);
  }

 private:
  void flush() {
    if (valid_utf8_prefix(run_) == run_.size()) {
      text_ += run_;
    } else {
      for (size_t i = 0; i < run_tokens_; ++i) text_ += kReplacementCharacter;
    }
    run_.clear();
    run_tokens_ = 0;
  }

  std::string text_, run_;
  size_t run_tokens_ = 0;
};

// Strip(" ", start, stop): up to `start` leading and `stop` trailing spaces.
std::string stripped(std::string text, size_t start, size_t stop) {
  size_t leading = 0;
  while (leading < start && leading < text.size() && text[leading] == ' ') ++leading;
  text.erase(0, leading);
  for (size_t trailing = 0; trailing < stop && !text.empty() && text.back() == ' '; ++trailing)
    text.pop_back();
  return text;
}

}  // namespace

std::string BpeTokenizer::Impl::sentencepiece_decode(std::span<const int32_t> ids) const {
  FallbackText text;
  for (const int32_t id : ids) {
    const bool known = id >= 0 && static_cast<size_t>(id) < id_tokens.size() && id_known[id];
    if (!known) {
      text.add("<" + std::to_string(id) + ">");
      continue;
    }
    // Replace("▁", " ") comes first, on every token, the added ones too (a normalized one in
    // its normalized form, as tokenizers 0.23 decodes it; 0.19 took its content).
    const bool added_token = id_added[id] >= 0;
    text.add(with_spaces(added_token ? added[id_added[id]].pattern : id_tokens[id]));
  }
  return stripped(text.finish(), sentencepiece->strip_start, sentencepiece->strip_stop);
}

}  // namespace dstrain
