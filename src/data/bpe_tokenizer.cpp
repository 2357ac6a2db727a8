#include "data/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <deque>
#include <filesystem>
#include <queue>

#include "core/check.h"
#include "core/fs.h"
#include "data/bpe_tokenizer_impl.h"
#include "data/unicode_nfc.h"
#include "data/unicode_regex.h"

namespace dstrain {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer regex, the one ByteLevel(use_regex=true) applies (the `tokenizers`
// library's byte_level.rs). Needs PCRE2_UCP for \s and the \p classes to be Unicode.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;  // far above any real vocabulary (~256k)
constexpr size_t kMaxCachedWords = 1 << 18;
// Longer words are not cached: the SentencePiece kind's word can be a whole document.
constexpr size_t kMaxCachedWordBytes = 256;

std::string utf8_of(char32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {  // the table only reaches U+0143
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
  return out;
}

// The byte-to-character table as UTF-8 strings, and its inverse (code point -> byte).
struct ByteTables {
  std::array<std::string, 256> byte_chars;
  std::unordered_map<std::string, unsigned char> char_bytes;
  ByteTables() {
    for (int b = 0; b < 256; ++b) {
      byte_chars[b] = utf8_of(byte_to_unicode(static_cast<unsigned char>(b)));
      char_bytes[byte_chars[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
}

// The bytes a token stands for, the way the ByteLevel decoder gives them: every character
// through the inverse table, or the token's own UTF-8 when one character is not in it.
std::string token_bytes(const std::string& token) {
  const ByteTables& tables = byte_tables();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const size_t length = std::max<size_t>(1, utf8_sequence_length(token, i));
    const auto found = tables.char_bytes.find(token.substr(i, length));
    if (found == tables.char_bytes.end()) return token;
    bytes += static_cast<char>(found->second);
    i += length;
  }
  return bytes;
}

// Rust's String::from_utf8_lossy: each maximal prefix of a valid sequence that is cut short
// (and each byte that starts none) becomes one U+FFFD.
std::string lossy_utf8(std::string_view bytes) {
  std::string text;
  for (size_t i = 0; i < bytes.size();) {
    if (const size_t length = utf8_sequence_length(bytes, i); length > 0) {
      text.append(bytes.substr(i, length));
      i += length;
      continue;
    }
    // How far a valid sequence gets: try each shorter well-formed continuation.
    size_t consumed = 1;
    for (size_t end = std::min(bytes.size(), i + 4); end > i + 1; --end) {
      std::string candidate(bytes.substr(i, end - i));
      candidate.append(4, '\x80');  // padding with continuations: valid iff the prefix is
      const size_t length = utf8_sequence_length(candidate, 0);
      if (length > end - i) {
        consumed = end - i;
        break;
      }
    }
    text += "\xEF\xBF\xBD";
    i += consumed;
  }
  return text;
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
         static_cast<uint32_t>(right);
}

}  // namespace

char32_t byte_to_unicode(unsigned char byte) {
  const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
                         (byte >= 0xAE);
  if (printable) return byte;
  // The unprintable bytes, in order, take U+0100, U+0101, ...: count those below `byte`.
  int rank = 0;
  for (int b = 0; b < byte; ++b)
    rank += !((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE);
  return static_cast<char32_t>(256 + rank);
}

// ---------------------------------------------------------------------------------------------
// Reading tokenizer.json

namespace bpe_json {

void unsupported(const std::string& name, const std::string& what) {
  DSTRAIN_USER_ERROR() << "tokenizer '" << name << "' uses " << what
                       << ", which dstrain does not support (it reads BPE tokenizers of the "
                          "byte-level kinds, GPT-2, Llama 3, Qwen2, DeepSeek, and the "
                          "SentencePiece kind of Llama 2 and Mistral).";
}

std::string type_of(const json& node) {
  return node.is_object() && node.contains("type") && node["type"].is_string()
             ? node["type"].get<std::string>()
             : std::string("an untyped entry");
}

bool flag(const json& node, const char* key, bool fallback) {
  if (!node.contains(key) || node[key].is_null()) return fallback;
  return node[key].get<bool>();
}

const json& field(const json& node, const char* key) {
  static const json null_node;
  return node.is_object() && node.contains(key) ? node[key] : null_node;
}

}  // namespace bpe_json

namespace {

using namespace bpe_json;

bool is_unset(const json& node, const char* key) {
  return !node.contains(key) || node[key].is_null() ||
         (node[key].is_string() && node[key].get<std::string>().empty());
}

int32_t checked_id(const json& value, const std::string& name, const std::string& token) {
  DSTRAIN_USER_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                     value.get<int64_t>() <= kMaxId)
      << "tokenizer '" << name << "' gives token '" << token << "' the id " << value.dump()
      << ", outside 0.." << kMaxId << ".";
  return static_cast<int32_t>(value.get<int64_t>());
}

void remember_id(BpeTokenizer::Impl& impl, int32_t id, const std::string& token) {
  if (static_cast<size_t>(id) >= impl.id_tokens.size()) {
    impl.id_tokens.resize(id + 1);
    impl.id_known.resize(id + 1, false);
    impl.id_added.resize(id + 1, -1);
  }
  impl.id_tokens[id] = token;
  impl.id_known[id] = true;
}

void read_vocab(const json& model, BpeTokenizer::Impl& impl) {
  DSTRAIN_USER_CHECK(model.contains("vocab") && model["vocab"].is_object())
      << "tokenizer '" << impl.name << "' has no model.vocab object.";
  for (const auto& [token, value] : model["vocab"].items()) {
    const int32_t id = checked_id(value, impl.name, token);
    DSTRAIN_USER_CHECK(static_cast<size_t>(id) >= impl.id_known.size() || !impl.id_known[id])
        << "tokenizer '" << impl.name << "' gives the id " << id << " to both '"
        << impl.id_tokens[id] << "' and '" << token << "' in model.vocab.";
    impl.vocab[token] = id;
    remember_id(impl, id, token);
  }
  for (int b = 0; b < 256; ++b) {
    const auto found = impl.vocab.find(byte_tables().byte_chars[b]);
    impl.byte_ids[b] = found == impl.vocab.end() ? -1 : found->second;
  }
}

// A merge as its two tokens, from "a b" or ["a", "b"].
std::pair<std::string, std::string> merge_parts(const json& merge, size_t rank,
                                                const std::string& name) {
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string())
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  const std::string text = merge.is_string() ? merge.get<std::string>() : merge.dump();
  const size_t space = text.find(' ');
  DSTRAIN_USER_CHECK(merge.is_string() && space != std::string::npos && space > 0 &&
                     space + 1 < text.size() && text.find(' ', space + 1) == std::string::npos)
      << "tokenizer '" << name << "' has merge " << rank << " " << text
      << ", which is neither \"a b\" nor [\"a\", \"b\"].";
  return {text.substr(0, space), text.substr(space + 1)};
}

int32_t vocab_id_for_merge(const BpeTokenizer::Impl& impl, const std::string& token,
                           size_t rank) {
  const auto found = impl.vocab.find(token);
  DSTRAIN_USER_CHECK(found != impl.vocab.end())
      << "tokenizer '" << impl.name << "' has merge " << rank << " naming the token '" << token
      << "', which is not in model.vocab.";
  return found->second;
}

void read_merges(const json& model, BpeTokenizer::Impl& impl) {
  DSTRAIN_USER_CHECK(model.contains("merges") && model["merges"].is_array())
      << "tokenizer '" << impl.name << "' has no model.merges list.";
  const json& merges = model["merges"];
  impl.id_in_merge.assign(impl.id_tokens.size(), false);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto [left, right] = merge_parts(merges[rank], rank, impl.name);
    const int32_t left_id = vocab_id_for_merge(impl, left, rank);
    const int32_t right_id = vocab_id_for_merge(impl, right, rank);
    const int32_t new_id = vocab_id_for_merge(impl, left + right, rank);
    // A pair listed twice keeps its last rank, as the library's map does.
    impl.merges[pair_key(left_id, right_id)] = Merge{static_cast<int32_t>(rank), new_id};
    impl.id_in_merge[left_id] = impl.id_in_merge[right_id] = true;
  }
}

void read_model(const json& model, BpeTokenizer::Impl& impl) {
  DSTRAIN_USER_CHECK(model.is_object()) << "tokenizer '" << impl.name << "' has no model.";
  if (model.contains("type") && type_of(model) != "BPE")
    unsupported(impl.name, "a " + type_of(model) + " model");
  if (!is_unset(model, "dropout")) unsupported(impl.name, "BPE dropout");
  if (!is_unset(model, "continuing_subword_prefix"))
    unsupported(impl.name, "a continuing_subword_prefix");
  if (!is_unset(model, "end_of_word_suffix")) unsupported(impl.name, "an end_of_word_suffix");
  const bool byte_fallback = flag(model, "byte_fallback", false);
  if (byte_fallback && !impl.sentencepiece)
    unsupported(impl.name, "byte_fallback in a byte-level tokenizer");
  if (!byte_fallback && impl.sentencepiece)
    unsupported(impl.name, "a SentencePiece-kind model without byte_fallback");
  read_vocab(model, impl);
  if (impl.sentencepiece) read_byte_tokens(impl);
  read_merges(model, impl);
  impl.fuse_unk = flag(model, "fuse_unk", false);
  impl.ignore_merges = flag(model, "ignore_merges", false);
  if (!is_unset(model, "unk_token")) {
    const std::string unk = model["unk_token"].get<std::string>();
    const auto found = impl.vocab.find(unk);
    DSTRAIN_USER_CHECK(found != impl.vocab.end())
        << "tokenizer '" << impl.name << "' names the unk_token '" << unk
        << "', which is not in model.vocab.";
    impl.unk_id = found->second;
  }
}

// What a normalized added token is matched as: the normalizer's form of its content (the
// library normalizes the patterns of its second pass).
std::string normalized_form(const BpeTokenizer::Impl& impl, const std::string& content) {
  if (impl.nfc) return nfc_normalize(content);
  if (impl.sentencepiece) return impl.sentencepiece_pattern(content);
  return content;
}

AddedToken read_added_token(const json& entry, const BpeTokenizer::Impl& impl) {
  DSTRAIN_USER_CHECK(entry.is_object() && entry.contains("content") &&
                     entry["content"].is_string() && !entry["content"].get<std::string>().empty() &&
                     entry.contains("id"))
      << "tokenizer '" << impl.name << "' has an added token without content or id: "
      << entry.dump() << ".";
  AddedToken token;
  token.content = entry["content"].get<std::string>();
  token.id = checked_id(entry["id"], impl.name, token.content);
  for (const char* option : {"lstrip", "rstrip", "single_word"})
    if (flag(entry, option, false))
      unsupported(impl.name, "the added token '" + token.content + "' with " + option);
  token.normalized = flag(entry, "normalized", !flag(entry, "special", false));
  token.pattern = token.normalized ? normalized_form(impl, token.content) : token.content;
  return token;
}

void read_added_tokens(const json& root, BpeTokenizer::Impl& impl) {
  if (!root.contains("added_tokens") || root["added_tokens"].is_null()) return;
  DSTRAIN_USER_CHECK(root["added_tokens"].is_array())
      << "tokenizer '" << impl.name << "' has added_tokens that is not a list.";
  for (const json& entry : root["added_tokens"]) {
    AddedToken token = read_added_token(entry, impl);
    impl.added_has_newline |= token.content.find('\n') != std::string::npos;
    impl.added_has_space |= token.content.find(' ') != std::string::npos ||
                            token.content.find("\xE2\x96\x81") != std::string::npos;
    remember_id(impl, token.id, token.content);
    impl.added.push_back(std::move(token));
  }
  // Longest first: at one position the longest added token wins, as in the library.
  std::stable_sort(impl.added.begin(), impl.added.end(),
                   [](const AddedToken& a, const AddedToken& b) {
                     return a.pattern.size() > b.pattern.size();
                   });
  for (size_t i = 0; i < impl.added.size(); ++i) {
    impl.added_by_first_byte[static_cast<unsigned char>(impl.added[i].pattern[0])].push_back(
        static_cast<int>(i));
    impl.id_added[impl.added[i].id] = static_cast<int32_t>(i);
  }
}

PreTokenizerStep split_step(const json& split, const std::string& name) {
  const std::string behavior = split.value("behavior", std::string("Isolated"));
  if (behavior != "Isolated") unsupported(name, "a Split pre-tokenizer with behavior " + behavior);
  if (flag(split, "invert", false)) unsupported(name, "an inverted Split pre-tokenizer");
  const json& pattern = split.contains("pattern") ? split["pattern"] : json();
  PreTokenizerStep step;
  if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
    step.regex.emplace(pattern["Regex"].get<std::string>());
  } else if (pattern.contains("String") && pattern["String"].is_string()) {
    step.regex.emplace(UnicodeRegex::escape(pattern["String"].get<std::string>()));
  } else {
    DSTRAIN_USER_ERROR() << "tokenizer '" << name << "' has a Split pre-tokenizer without a "
                         << "{\"Regex\": ...} or {\"String\": ...} pattern.";
  }
  return step;
}

PreTokenizerStep byte_level_step(const json& byte_level) {
  PreTokenizerStep step;
  step.add_prefix_space = flag(byte_level, "add_prefix_space", true);
  if (flag(byte_level, "use_regex", true)) step.regex.emplace(kGpt2Pattern);
  return step;
}

// ByteLevel, or Sequence[Split..., ByteLevel].
void read_pre_tokenizer(const json& root, BpeTokenizer::Impl& impl) {
  const json& pre = root.contains("pre_tokenizer") ? root["pre_tokenizer"] : json();
  if (pre.is_null()) unsupported(impl.name, "no pre_tokenizer (so no byte-level mapping)");
  std::vector<json> parts{pre};
  if (type_of(pre) == "Sequence") {
    DSTRAIN_USER_CHECK(pre.contains("pretokenizers") && pre["pretokenizers"].is_array())
        << "tokenizer '" << impl.name << "' has a Sequence pre-tokenizer without a list.";
    parts = pre["pretokenizers"].get<std::vector<json>>();
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string type = type_of(parts[i]);
    const bool last = i + 1 == parts.size();
    if (type == "Split" && !last) {
      impl.steps.push_back(split_step(parts[i], impl.name));
    } else if (type == "ByteLevel" && last) {
      impl.steps.push_back(byte_level_step(parts[i]));
    } else {
      unsupported(impl.name, "the pre-tokenizer " + type +
                                 (last ? " at the end" : " inside a Sequence") +
                                 " (supported: ByteLevel, or Split pre-tokenizers then ByteLevel)");
    }
  }
}

// None, or NFC (Qwen2's): applied to the text between the added tokens that are not
// "normalized", before the normalized ones are cut out (the library's order).
void read_normalizer(const json& root, BpeTokenizer::Impl& impl) {
  if (!root.contains("normalizer") || root["normalizer"].is_null()) return;
  const std::string type = type_of(root["normalizer"]);
  if (type != "NFC") unsupported(impl.name, "the normalizer " + type + " (supported: none, NFC)");
  impl.nfc = true;
}

}  // namespace

BpeTokenizer BpeTokenizer::from_json(std::string_view json_text, const std::string& name) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {
    DSTRAIN_USER_ERROR() << "tokenizer '" << name << "' is not valid JSON (" << error.what()
                         << ").";
  }
  DSTRAIN_USER_CHECK(root.is_object())
      << "tokenizer '" << name << "' is not a tokenizer.json object.";
  auto impl = std::make_unique<Impl>();
  impl->name = name;
  try {
    const bool sentencepiece = is_sentencepiece(root);
    if (sentencepiece) read_sentencepiece_layout(root, *impl);
    else read_normalizer(root, *impl);
    DSTRAIN_USER_CHECK(root.contains("model")) << "tokenizer '" << name << "' has no model.";
    read_model(root["model"], *impl);
    read_added_tokens(root, *impl);
    if (!sentencepiece) read_pre_tokenizer(root, *impl);
  } catch (const json::exception& error) {  // a field of the wrong JSON type
    DSTRAIN_USER_ERROR() << "tokenizer '" << name << "' has a field of an unexpected type ("
                         << error.what() << ").";
  }
  return BpeTokenizer(std::move(impl));
}

BpeTokenizer BpeTokenizer::from_file(const std::string& path) {
  std::error_code error;
  DSTRAIN_USER_CHECK(std::filesystem::is_regular_file(path, error))
      << "tokenizer file '" << path << "' does not exist or is not a file.";
  return from_json(read_file(path), path);
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

int64_t BpeTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_tokens.size()); }

std::optional<int32_t> BpeTokenizer::token_id(std::string_view token) const {
  for (const AddedToken& added : impl_->added)
    if (added.content == token) return added.id;
  const auto found = impl_->vocab.find(std::string(token));
  if (found == impl_->vocab.end()) return std::nullopt;
  return found->second;
}

std::optional<int32_t> BpeTokenizer::end_of_text_id() const {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>",
                           "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
                           "</s>"})
    for (const AddedToken& added : impl_->added)
      if (added.content == name) return added.id;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Encoding

// The library's leftmost-longest matching: the first position in text[from..) where an added
// token of the pass matches, the longest one there.
std::pair<size_t, const AddedToken*> BpeTokenizer::Impl::next_added(std::string_view text,
                                                                    size_t from,
                                                                    bool normalized_pass) const {
  for (size_t i = from; i < text.size(); ++i) {
    for (const int index : added_by_first_byte[static_cast<unsigned char>(text[i])]) {
      const AddedToken& token = added[index];
      if (token.normalized == normalized_pass &&
          text.compare(i, token.pattern.size(), token.pattern) == 0)
        return {i, &token};
    }
  }
  return {text.size(), nullptr};
}

// Cuts the added tokens of one pass (normalized false, then true) out of `text`; what lies
// between goes to the next pass, then to the pre-tokenizer.
void BpeTokenizer::Impl::cut_added(std::string_view text, bool normalized_pass,
                                   std::vector<int32_t>& ids, Spans* spans, size_t offset) {
  for (size_t piece_begin = 0;;) {
    const auto [at, token] = next_added(text, piece_begin, normalized_pass);
    const std::string_view piece = text.substr(piece_begin, at - piece_begin);
    normalized_pass ? encode_segment(piece, ids, spans, offset + piece_begin)
                    : encode_normalized(piece, ids, spans, offset + piece_begin);
    if (token == nullptr) return;
    ids.push_back(token->id);
    if (spans != nullptr) spans->push_back({offset + at, offset + at + token->pattern.size()});
    piece_begin = at + token->pattern.size();
  }
}

// The normalized pass, on the normalizer's form of the piece (NFC, or the piece itself); the
// spans of an NFC form are mapped back to the piece's bytes.
void BpeTokenizer::Impl::encode_normalized(std::string_view piece, std::vector<int32_t>& ids,
                                           Spans* spans, size_t offset) {
  if (!nfc) return cut_added(piece, true, ids, spans, offset);
  if (spans == nullptr) return cut_added(nfc_normalize(piece), true, ids, nullptr, 0);
  const NfcAligned aligned = nfc_normalize_aligned(piece);
  const size_t first = spans->size();
  cut_added(aligned.normalized, true, ids, spans, 0);
  for (size_t i = first; i < spans->size(); ++i) {
    const auto [begin, end] = aligned.to_text((*spans)[i].begin, (*spans)[i].end);
    (*spans)[i] = {offset + begin, offset + end};
  }
}

namespace {

// A piece of the pre-tokenizer: its bytes, where they start in the text, and how many of its
// first bytes (a prefix space) are not in the text.
struct Piece {
  std::string_view bytes;
  size_t text_begin = 0;
  size_t added = 0;

  size_t text_end() const { return text_begin + bytes.size() - added; }
  Piece sub(size_t begin, size_t end) const {
    return {bytes.substr(begin, end - begin), text_begin + (begin > added ? begin - added : 0),
            begin < added ? std::min(added - begin, end - begin) : 0};
  }
};

// The spans of one word's ids: the tokens' bytes one after the other from the word's first
// byte in the text (a prefix space covering none), held inside the word, the last ending it. A
// dropped byte or an unk_token only blurs the spans inside its word.
void push_word_spans(std::span<const int32_t> ids, const std::vector<std::string>& id_tokens,
                     const Piece& word, std::vector<BpeTokenizer::TokenSpan>& spans) {
  const auto place = [&](size_t spelled) {
    return std::min(word.text_end(),
                    word.text_begin + (spelled > word.added ? spelled - word.added : 0));
  };
  size_t spelled = 0;
  for (const int32_t id : ids) {
    const size_t begin = place(spelled);
    spelled += token_bytes(id_tokens[id]).size();
    spans.push_back({begin, place(spelled)});
  }
  if (!ids.empty()) spans.back().end = word.text_end();
}

}  // namespace

// The pre-tokenizer's steps, each splitting every piece of the previous one, then BPE on each.
void BpeTokenizer::Impl::encode_segment(std::string_view segment, std::vector<int32_t>& ids,
                                        Spans* spans, size_t offset) {
  if (segment.empty()) return;
  std::deque<std::string> prefixed;  // pieces that got a prefix space live here
  std::vector<Piece> pieces{{segment, offset, 0}};
  for (const PreTokenizerStep& step : steps) {
    std::vector<Piece> next;
    for (Piece piece : pieces) {
      if (step.add_prefix_space && !piece.bytes.empty() && piece.bytes.front() != ' ') {
        piece = {prefixed.emplace_back(" " + std::string(piece.bytes)), piece.text_begin,
                 piece.added + 1};
      }
      if (!step.regex) {
        next.push_back(piece);
        continue;
      }
      size_t covered = 0;  // Isolated: the gaps between matches are pieces too
      for (const auto& [begin, end] : step.regex->find_all(piece.bytes)) {
        if (begin > covered) next.push_back(piece.sub(covered, begin));
        next.push_back(piece.sub(begin, end));
        covered = end;
      }
      if (covered < piece.bytes.size()) next.push_back(piece.sub(covered, piece.bytes.size()));
    }
    pieces = std::move(next);
  }
  for (const Piece& piece : pieces) {
    const size_t first = ids.size();
    encode_word(piece.bytes, ids);
    if (spans != nullptr) {
      push_word_spans(std::span(ids).subspan(first), id_tokens, piece, *spans);
    }
  }
}

void BpeTokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& ids) {
  if (word.size() > kMaxCachedWordBytes) {
    const std::vector<int32_t> merged = word_ids(word);
    ids.insert(ids.end(), merged.begin(), merged.end());
    return;
  }
  const std::string key(word);
  auto cached = word_cache.find(key);
  if (cached == word_cache.end()) {
    if (word_cache.size() >= kMaxCachedWords) word_cache.clear();
    cached = word_cache.emplace(key, word_ids(word)).first;
  }
  ids.insert(ids.end(), cached->second.begin(), cached->second.end());
}

std::vector<int32_t> BpeTokenizer::Impl::word_ids(std::string_view word) const {
  // ignore_merges (Llama 3): a word that is a token as a whole is that token, merges or not.
  if (ignore_merges) {
    std::string mapped;  // the word in the model's alphabet
    if (sentencepiece) {
      mapped = word;
    } else {
      for (const char c : word) mapped += byte_tables().byte_chars[static_cast<unsigned char>(c)];
    }
    if (const auto found = vocab.find(mapped); found != vocab.end()) return {found->second};
  }
  return merge_between_fences(sentencepiece ? sentencepiece_symbols(word)
                                            : initial_symbols(word));
}

// One symbol per byte (its character's id). A byte whose character is not in the vocabulary
// becomes unk_token (consecutive ones fused into one with fuse_unk), or is dropped without one,
// as the library does.
std::vector<int32_t> BpeTokenizer::Impl::initial_symbols(std::string_view word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool pending_unk = false;
  for (const char c : word) {
    const int32_t id = byte_ids[static_cast<unsigned char>(c)];
    if (id >= 0) {
      if (pending_unk) symbols.push_back(*unk_id);
      pending_unk = false;
      symbols.push_back(id);
    } else if (unk_id) {
      if (pending_unk && !fuse_unk) symbols.push_back(*unk_id);
      pending_unk = true;
    }
  }
  if (pending_unk) symbols.push_back(*unk_id);
  return symbols;
}

bool BpeTokenizer::Impl::is_fence(int32_t id) const {
  return static_cast<size_t>(id) >= id_in_merge.size() || !id_in_merge[id];
}

// BPE on each run between fences (symbols in no merge, such as Llama 2's <0x0A>), a fence
// standing alone: the same result as on the whole, since no merge reaches across a fence, in
// memory for the longest run (a SentencePiece-kind word can be a whole file).
std::vector<int32_t> BpeTokenizer::Impl::merge_between_fences(
    const std::vector<int32_t>& symbols) const {
  std::vector<int32_t> merged;
  size_t run_begin = 0;
  for (size_t i = 0; i <= symbols.size(); ++i) {
    if (i < symbols.size() && !is_fence(symbols[i])) continue;
    if (run_begin == 0 && i == symbols.size()) return merge_symbols(symbols);  // no fence
    const std::vector<int32_t> run =
        merge_symbols(std::vector<int32_t>(symbols.begin() + run_begin, symbols.begin() + i));
    merged.insert(merged.end(), run.begin(), run.end());
    if (i < symbols.size()) merged.push_back(symbols[i]);
    run_begin = i + 1;
  }
  return merged;
}

// Merges the adjacent pair of lowest rank (leftmost on a tie) until no pair has a merge.
// A heap of candidate pairs with a linked list of symbols: O(n log n) for a word of n bytes
// (a long run of spaces or digits is one word). Entries made stale by a merge are skipped.
std::vector<int32_t> BpeTokenizer::Impl::merge_symbols(std::vector<int32_t> symbols) const {
  const int n = static_cast<int>(symbols.size());
  std::vector<int> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    int32_t rank, left, right, left_id, right_id, new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto offer = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const auto found = merges.find(pair_key(symbols[left], symbols[right]));
    if (found == merges.end()) return;
    heap.push({found->second.rank, left, right, symbols[left], symbols[right],
               found->second.new_id});
  };
  for (int i = 0; i + 1 < n; ++i) offer(i, i + 1);
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    if (!alive[top.left] || !alive[top.right] || next[top.left] != top.right ||
        symbols[top.left] != top.left_id || symbols[top.right] != top.right_id)
      continue;
    symbols[top.left] = top.new_id;
    alive[top.right] = false;
    next[top.left] = next[top.right];
    if (next[top.left] >= 0) prev[next[top.left]] = top.left;
    offer(prev[top.left], top.left);
    offer(top.left, next[top.left]);
  }
  std::vector<int32_t> merged;
  for (int i = n > 0 ? 0 : -1; i >= 0; i = next[i]) merged.push_back(symbols[i]);
  return merged;
}

std::vector<int32_t> BpeTokenizer::Impl::encode(std::string_view text,
                                                std::vector<TokenSpan>* spans) {
  const size_t valid = valid_utf8_prefix(text);
  DSTRAIN_USER_CHECK(valid == text.size())
      << "the text is not valid UTF-8 at byte " << valid
      << "; the tokenizer reads UTF-8 text (convert the file, e.g. with iconv).";
  std::vector<int32_t> ids;
  if (sentencepiece) {
    encode_sentencepiece(text, ids, spans);
    return ids;
  }
  cut_added(text, false, ids, spans, 0);
  return ids;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) {
  return impl_->encode(text, nullptr);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, std::vector<TokenSpan>& spans) {
  spans.clear();
  return impl_->encode(text, &spans);
}

size_t BpeTokenizer::safe_prefix_length(std::string_view text) const {
  if (impl_->sentencepiece) return impl_->sentencepiece_safe_prefix(text);
  if (impl_->added_has_newline) return 0;  // an added token could span the cut
  const auto graphic = [](char c) { return c > ' ' && c < 0x7F; };
  for (size_t p = text.size() - (text.empty() ? 0 : 1); p >= 2; --p) {
    if (text[p - 1] == '\n' && graphic(text[p - 2]) && graphic(text[p])) return p;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Decoding

std::string BpeTokenizer::decode_bytes(std::span<const int32_t> ids) const {
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    DSTRAIN_USER_CHECK(id >= 0 && id < vocab_size() && impl_->id_known[id])
        << "token id " << id << " at position " << i << " has no token in tokenizer '"
        << impl_->name << "'.";
    bytes += impl_->sentencepiece ? impl_->sentencepiece_bytes(id)
                                  : token_bytes(impl_->id_tokens[id]);
  }
  return bytes;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  if (impl_->sentencepiece) return impl_->sentencepiece_decode(ids);
  std::string text, run;  // run: the bytes of known tokens since the last unknown id
  for (const int32_t id : ids) {
    if (id >= 0 && id < vocab_size() && impl_->id_known[id]) {
      run += token_bytes(impl_->id_tokens[id]);
      continue;
    }
    text += lossy_utf8(run) + "<" + std::to_string(id) + ">";
    run.clear();
  }
  return text + lossy_utf8(run);
}

}  // namespace dstrain
