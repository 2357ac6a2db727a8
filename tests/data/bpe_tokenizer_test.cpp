// BpeTokenizer against the `tokenizers` library: the fixtures in tests/reference/tokenizers/
// (made by tests/reference/make_tokenizer_fixtures.py) hold small trained tokenizer.json files
// of the GPT-2, Llama 3, Qwen2 and DeepSeek byte-level kinds and of the SentencePiece kind
// (Llama 2 / Mistral v0.1's Prepend normalizer, Mistral v0.3's and other Metaspace layouts,
// byte fallback), and the library's ids, decodes and (SentencePiece) offsets for texts with
// accents, CJK, emoji, digit runs, whitespace runs, contractions and special tokens.
#include "data/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "data/unicode_nfc.h"
#include "test_util.h"

namespace dstrain {
namespace {

using nlohmann::json;

const std::string kFixtures = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/tokenizers/";

BpeTokenizer& fixture_tokenizer(const std::string& name) {
  static std::map<std::string, BpeTokenizer> loaded;
  auto found = loaded.find(name);
  if (found == loaded.end())
    found = loaded.emplace(name, BpeTokenizer::from_file(kFixtures + name + ".json")).first;
  return found->second;
}

const json& fixture_cases() {
  static const json cases = json::parse(read_file(kFixtures + "cases.json"))["cases"];
  return cases;
}

TEST(BpeTokenizer, ByteToUnicodeIsGpt2sTable) {
  EXPECT_EQ(byte_to_unicode('!'), U'!');
  EXPECT_EQ(byte_to_unicode('~'), U'~');
  EXPECT_EQ(byte_to_unicode(0xE9), U'\u00e9');
  EXPECT_EQ(byte_to_unicode(0), U'\u0100');
  EXPECT_EQ(byte_to_unicode(' '), U'\u0120');   // the "Ġ" of GPT-2 vocabularies
  EXPECT_EQ(byte_to_unicode('\n'), U'\u010a');  // "Ċ"
  EXPECT_EQ(byte_to_unicode(0x7F), U'\u0121');
  EXPECT_EQ(byte_to_unicode(0xAD), U'\u0143');  // the last of the 68 unprintable bytes
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) seen.insert(byte_to_unicode(static_cast<unsigned char>(b)));
  EXPECT_EQ(seen.size(), 256u) << "a bijection";
}

// The library's offsets of a case: the SentencePiece kinds' from the fixture; the byte-level
// kinds' tokens lie one after the other over the text's bytes. Empty where the text is not NFC
// and the tokenizer normalizes it (those are checked by spans_cover_the_nfc_text).
std::vector<BpeTokenizer::TokenSpan> expected_spans(const json& c, BpeTokenizer& tokenizer) {
  std::vector<BpeTokenizer::TokenSpan> spans;
  if (c.contains("offsets")) {
    for (const json& offset : c["offsets"]) spans.push_back({offset[0], offset[1]});
    return spans;
  }
  if (c["normalized"] != c["text"]) return {};
  size_t end = 0;
  for (const int32_t id : c["ids"].get<std::vector<int32_t>>()) {
    const size_t begin = end;
    end += tokenizer.decode_bytes(std::span<const int32_t>(&id, 1)).size();
    spans.push_back({begin, end});
  }
  return spans;
}

// Under Qwen2's NFC normalizer, on a text that NFC changes: the spans rise inside the text, the
// last ends it, and each token's bytes lie in the NFC form of the text its span covers.
void spans_cover_the_nfc_text(const json& c, BpeTokenizer& tokenizer,
                              const std::vector<BpeTokenizer::TokenSpan>& spans) {
  const std::string text = c["text"];
  const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(spans.size(), ids.size());
  ASSERT_FALSE(spans.empty());
  EXPECT_EQ(spans.back().end, text.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_LE(spans[i].begin, spans[i].end);
    if (i > 0) {
      EXPECT_LE(spans[i - 1].end, spans[i].end);
      EXPECT_LE(spans[i - 1].begin, spans[i].begin);
    }
    // Outside what NFC changes, the token's own bytes (a part of a character, perhaps).
    const std::string covered = text.substr(spans[i].begin, spans[i].end - spans[i].begin);
    const std::string token = tokenizer.decode_bytes(std::span<const int32_t>(&ids[i], 1));
    if (covered == token) continue;
    EXPECT_NE(nfc_normalize(covered).find(token), std::string::npos)
        << "token " << i << " of " << json(text).dump();
  }
}

TEST(BpeTokenizer, IdsEqualTheLibrarysOnEveryFixtureCase) {
  ASSERT_GE(fixture_cases().size(), 280u);
  size_t nonempty = 0, sentencepiece = 0, not_nfc = 0;
  for (const json& c : fixture_cases()) {
    BpeTokenizer& tokenizer = fixture_tokenizer(c["tokenizer"]);
    const std::string text = c["text"];
    const std::vector<int32_t> expected = c["ids"].get<std::vector<int32_t>>();
    std::vector<BpeTokenizer::TokenSpan> spans;
    const std::vector<int32_t> ids = tokenizer.encode(text, spans);
    EXPECT_EQ(ids, expected) << c["tokenizer"] << " on " << json(text).dump();
    EXPECT_EQ(tokenizer.encode(text), expected) << c["tokenizer"] << " without spans";
    if (c["normalized"] != c["text"] && !c.contains("offsets")) {
      spans_cover_the_nfc_text(c, tokenizer, spans);
      ++not_nfc;
    } else {
      EXPECT_TRUE(spans == expected_spans(c, tokenizer))
          << c["tokenizer"] << ": the offsets of " << json(text).dump();
    }
    nonempty += !expected.empty();
    sentencepiece += c.contains("offsets");
    EXPECT_EQ(tokenizer.decode(expected), c["decoded"].get<std::string>()) << json(text).dump();
    // The ids stand for the text, or its NFC form under Qwen2's normalizer.
    EXPECT_EQ(tokenizer.decode_bytes(expected), c["normalized"].get<std::string>())
        << "round trip of " << json(text).dump();
    if (expected.empty()) continue;
    const std::span<const int32_t> prefix(expected.data(), expected.size() - 1);
    EXPECT_EQ(tokenizer.decode(prefix), c["prefix_decoded"].get<std::string>())
        << "a cut decode of " << json(text).dump();
  }
  EXPECT_GE(nonempty, 260u) << "the fixtures must not be all empty";
  EXPECT_GE(sentencepiece, 140u) << "the SentencePiece kinds have cases";
  EXPECT_GE(not_nfc, 1u) << "a text that NFC changes";
}

TEST(BpeTokenizer, EncodesWithoutPostProcessorTokensAndFindsEndOfText) {
  BpeTokenizer& llama = fixture_tokenizer("llama3_kind");
  const std::optional<int32_t> begin = llama.token_id("<|begin_of_text|>");
  ASSERT_TRUE(begin.has_value());
  EXPECT_NE(llama.encode("Hi there").front(), *begin) << "no <|begin_of_text|> is added";
  EXPECT_EQ(llama.end_of_text_id(), llama.token_id("<|end_of_text|>"));
  EXPECT_EQ(fixture_tokenizer("gpt2_kind").end_of_text_id(),
            fixture_tokenizer("gpt2_kind").token_id("<|endoftext|>"));
  BpeTokenizer& deepseek = fixture_tokenizer("deepseek_kind");
  EXPECT_EQ(deepseek.end_of_text_id(), deepseek.token_id("<｜end▁of▁sentence｜>"));
  EXPECT_TRUE(deepseek.end_of_text_id().has_value());
  // vocab_size: one more than the largest id of the file.
  const json file = json::parse(read_file(kFixtures + "llama3_kind.json"));
  int64_t largest = 0;
  for (const auto& [token, id] : file["model"]["vocab"].items()) largest = std::max<int64_t>(largest, id);
  EXPECT_EQ(llama.vocab_size(), largest + 1);
  // Llama 2 / Mistral: </s>, and no <s> from the post-processor.
  for (const char* name : {"llama2_kind", "mistral_v3_kind"}) {
    BpeTokenizer& sentencepiece = fixture_tokenizer(name);
    EXPECT_EQ(sentencepiece.end_of_text_id(), std::optional<int32_t>(2)) << name;
    EXPECT_EQ(sentencepiece.token_id("<s>"), std::optional<int32_t>(1)) << name;
    EXPECT_NE(sentencepiece.encode("Hi there").front(), 1) << name;
  }
}

const json& sentencepiece_corpus_ids() {
  static const json ids = json::parse(read_file(kFixtures + "sentencepiece_corpus_ids.json"));
  return ids;
}

// Encodes `text` as prepare does: blocks of 300 bytes or more, cut where the tokenizer allows.
std::vector<int32_t> encode_in_blocks(BpeTokenizer& tokenizer, std::string_view rest,
                                      size_t& cuts) {
  std::vector<int32_t> blocked;
  cuts = 0;
  while (!rest.empty()) {
    size_t block = 300, cut = 0;
    while (block < rest.size() && (cut = tokenizer.safe_prefix_length(rest.substr(0, block))) == 0)
      block *= 2;
    const size_t take = block >= rest.size() ? rest.size() : cut;
    const std::vector<int32_t> ids = tokenizer.encode(rest.substr(0, take));
    blocked.insert(blocked.end(), ids.begin(), ids.end());
    rest.remove_prefix(take);
    ++cuts;
  }
  return blocked;
}

TEST(BpeTokenizer, BlocksCutAtSafePrefixesGiveTheWholeTextsIds) {
  const std::string corpus = read_file(kFixtures + "corpus.txt");
  for (const char* name : {"gpt2_kind", "llama3_kind", "deepseek_kind", "qwen2_kind"}) {
    BpeTokenizer& tokenizer = fixture_tokenizer(name);
    const std::vector<int32_t> whole = tokenizer.encode(corpus);
    size_t cuts = 0;
    EXPECT_EQ(encode_in_blocks(tokenizer, corpus, cuts), whole) << name;
    EXPECT_GT(cuts, 10u);
  }
  BpeTokenizer& gpt2 = fixture_tokenizer("gpt2_kind");
  EXPECT_EQ(gpt2.safe_prefix_length("ab\ncd\nef"), 6u);
  EXPECT_EQ(gpt2.safe_prefix_length("ab \ncd"), 0u) << "a space before the newline";
  EXPECT_EQ(gpt2.safe_prefix_length("ab\n cd\n\n"), 0u) << "a space or newline after it";
  EXPECT_EQ(gpt2.safe_prefix_length(""), 0u);
}

TEST(BpeTokenizer, SentencePieceBlocksCutOnlyWhereTheIdsStayTheLibrarys) {
  const std::string corpus = read_file(kFixtures + "corpus.txt");
  // Metaspace: before a space (split true), or before a space after "\n" (<0x0A>, in no
  // merge; the corpus has indented lines). Llama 2's Prepend: nowhere, the file is one block.
  for (const auto& [name, min_cuts] : std::vector<std::pair<std::string, size_t>>{
           {"llama2_metaspace_kind", 20}, {"mistral_v3_kind", 8}, {"llama2_kind", 1}}) {
    BpeTokenizer& tokenizer = fixture_tokenizer(name);
    const std::vector<int32_t> library = sentencepiece_corpus_ids()[name]["ids"];
    EXPECT_EQ(tokenizer.encode(corpus), library) << name;
    size_t cuts = 0;
    EXPECT_EQ(encode_in_blocks(tokenizer, corpus, cuts), library) << name;
    EXPECT_GE(cuts, min_cuts) << name;
    if (name == "llama2_kind") {
      EXPECT_EQ(cuts, 1u) << "Prepend gives every block a \"\u2581\": no cut";
    }
  }
  BpeTokenizer& split = fixture_tokenizer("llama2_metaspace_kind");
  EXPECT_EQ(split.safe_prefix_length("ab cd  ef"), 6u);
  EXPECT_EQ(split.safe_prefix_length(" abc"), 0u) << "nothing before the space";
  BpeTokenizer& whole_words = fixture_tokenizer("mistral_v3_kind");
  EXPECT_EQ(whole_words.safe_prefix_length("ab\n  cd ef\n"), 3u);
  EXPECT_EQ(whole_words.safe_prefix_length("ab cd  ef\ngh"), 0u) << "no fence before a space";
  EXPECT_EQ(whole_words.safe_prefix_length("ab\n cd   \n"), 3u) << "\"\u2581\u2581\" merges";
  EXPECT_EQ(fixture_tokenizer("llama2_kind").safe_prefix_length("ab\n  cd ef\n"), 0u);
  EXPECT_EQ(fixture_tokenizer("llama2_added_kind").safe_prefix_length("ab\n cd"), 0u);
  EXPECT_EQ(fixture_tokenizer("mistral_v3_added_kind").safe_prefix_length("ab\n cd"), 0u)
      << "the added token \"lazy dog\" holds a space";
}

TEST(BpeTokenizer, SentencePieceLongPiecesAndDecoding) {
  BpeTokenizer& llama2 = fixture_tokenizer("llama2_kind");
  std::string lines;  // one piece of 60000 bytes, its BPE run line by line
  while (lines.size() < 60000) lines += "the quick brown fox\n";
  const std::vector<int32_t> ids = llama2.encode(lines);
  EXPECT_LT(ids.size(), lines.size() / 2) << "merged";
  EXPECT_EQ(llama2.decode_bytes(ids), " " + lines) << "the prefix \"\u2581\"'s space";
  EXPECT_EQ(llama2.decode(ids), lines) << "Strip takes it off";
  // Byte tokens of a cut character: one U+FFFD each; an id with no token: "<ID>".
  const std::vector<int32_t> cut = {*llama2.token_id("<0xE6>"), *llama2.token_id("<0x9D>"),
                                    *llama2.token_id("<s>"), 99999};
  EXPECT_EQ(llama2.decode(cut), "\xEF\xBF\xBD\xEF\xBF\xBD<s><99999>");
  EXPECT_EQ(llama2.decode_bytes(std::span<const int32_t>(cut.data(), 3)), "\xE6\x9D<s>");
  EXPECT_USER_ERROR(llama2.decode_bytes(cut), "99999", "position 3");
  EXPECT_USER_ERROR(llama2.encode("ok \xff bad"), "not valid UTF-8", "byte 3");
}

TEST(BpeTokenizer, LongWordsAndTheCache) {
  BpeTokenizer& gpt2 = fixture_tokenizer("gpt2_kind");
  std::string long_word;  // one pre-token of 20000 letters
  while (long_word.size() < 20000) long_word += "quick";
  const std::vector<int32_t> first = gpt2.encode(long_word);
  EXPECT_LT(first.size(), long_word.size()) << "merged";
  EXPECT_EQ(gpt2.encode(long_word), first) << "again (too long for the cache)";
  EXPECT_EQ(gpt2.decode_bytes(first), long_word);
}

TEST(BpeTokenizer, RejectsTextThatIsNotUtf8AndUnknownIds) {
  BpeTokenizer& gpt2 = fixture_tokenizer("gpt2_kind");
  EXPECT_USER_ERROR(gpt2.encode("ok \xff bad"), "not valid UTF-8", "byte 3");
  const std::vector<int32_t> unknown = {5, 100000};
  EXPECT_USER_ERROR(gpt2.decode_bytes(unknown), "100000", "position 1");
  EXPECT_NE(gpt2.decode(unknown).find("<100000>"), std::string::npos);
}

// A minimal valid tokenizer.json: the 256 byte characters (ids 0..255), one merge "Ġ t" -> 256.
json tiny_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    const char32_t c = byte_to_unicode(static_cast<unsigned char>(b));
    std::string utf8;
    if (c < 0x80) utf8 += static_cast<char>(c);
    else {
      utf8 += static_cast<char>(0xC0 | (c >> 6));
      utf8 += static_cast<char>(0x80 | (c & 0x3F));
    }
    vocab[utf8] = b;
  }
  vocab["Ġt"] = 256;
  return {{"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false},
                             {"use_regex", true}}},
          {"added_tokens", json::array({{{"id", 257}, {"content", "<|endoftext|>"},
                                         {"special", true}}})},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"Ġ t"})}}}};
}

BpeTokenizer from(const json& tokenizer) { return BpeTokenizer::from_json(tokenizer.dump(), "t.json"); }

TEST(BpeTokenizer, TinyHandMadeTokenizer) {
  BpeTokenizer tokenizer = from(tiny_tokenizer());
  EXPECT_EQ(tokenizer.vocab_size(), 258);
  EXPECT_EQ(tokenizer.encode("a t<|endoftext|>"), (std::vector<int32_t>{'a', 256, 257}));
  json prefixed = tiny_tokenizer();
  prefixed["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_EQ(from(prefixed).encode("t"), (std::vector<int32_t>{256})) << "\" t\"";
}

TEST(BpeTokenizer, BadFilesAreOneSentence) {
  EXPECT_USER_ERROR(BpeTokenizer::from_file("/nonexistent/tokenizer.json"), "does not exist");
  EXPECT_USER_ERROR(BpeTokenizer::from_json("{not json", "t.json"), "t.json", "not valid JSON");
  EXPECT_USER_ERROR(BpeTokenizer::from_json("[1, 2]", "t.json"), "not a tokenizer.json");
  json t = tiny_tokenizer();
  t["model"].erase("vocab");
  EXPECT_USER_ERROR(from(t), "no model.vocab");
  t = tiny_tokenizer();
  t["model"].erase("merges");
  EXPECT_USER_ERROR(from(t), "no model.merges");
  t = tiny_tokenizer();
  t["model"]["merges"].push_back("Ġ zzz");
  EXPECT_USER_ERROR(from(t), "merge 1", "'zzz'", "not in model.vocab");
  t = tiny_tokenizer();
  t["model"]["merges"].push_back(json::array({"a", "b"}));  // "ab" is not a token
  EXPECT_USER_ERROR(from(t), "merge 1", "'ab'");
  t = tiny_tokenizer();
  t["model"]["merges"].push_back("a b c");
  EXPECT_USER_ERROR(from(t), "merge 1", "neither");
  t = tiny_tokenizer();
  t["model"]["vocab"]["Ġt"] = -1;
  EXPECT_USER_ERROR(from(t), "'Ġt'", "-1", "outside");
  t["model"]["vocab"]["Ġt"] = 1 << 24;
  EXPECT_USER_ERROR(from(t), "16777216", "outside");
  t["model"]["vocab"]["Ġt"] = 3;
  EXPECT_USER_ERROR(from(t), "id 3", "both");
  t = tiny_tokenizer();
  t["added_tokens"][0]["id"] = "x";
  EXPECT_USER_ERROR(from(t), "<|endoftext|>", "outside");
}

TEST(BpeTokenizer, UnsupportedPartsAreNamed) {
  json t = tiny_tokenizer();
  t["normalizer"] = {{"type", "NFKC"}};
  EXPECT_USER_ERROR(from(t), "normalizer NFKC", "does not support");
  t["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array()}};
  EXPECT_USER_ERROR(from(t), "normalizer Sequence", "does not support");
  t = tiny_tokenizer();
  t["pre_tokenizer"] = {{"type", "WhitespaceSplit"}};
  EXPECT_USER_ERROR(from(t), "pre-tokenizer WhitespaceSplit", "does not support");
  t["pre_tokenizer"] = nullptr;
  EXPECT_USER_ERROR(from(t), "no pre_tokenizer");
  t["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Digits"}},
                                                        {{"type", "ByteLevel"}}})}};
  EXPECT_USER_ERROR(from(t), "pre-tokenizer Digits");
  t["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}},
                                            {"behavior", "Removed"}};
  EXPECT_USER_ERROR(from(t), "behavior Removed");
  t["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}},
                                            {"behavior", "Isolated"}};
  EXPECT_USER_ERROR(from(t), "'(a'", "does not compile");
  t = tiny_tokenizer();
  t["model"]["type"] = "WordPiece";
  EXPECT_USER_ERROR(from(t), "WordPiece model");
  t = tiny_tokenizer();
  t["model"]["dropout"] = 0.1;
  EXPECT_USER_ERROR(from(t), "dropout");
  t = tiny_tokenizer();
  t["model"]["byte_fallback"] = true;
  EXPECT_USER_ERROR(from(t), "byte_fallback in a byte-level tokenizer");
  t = tiny_tokenizer();
  t["added_tokens"][0]["lstrip"] = true;
  EXPECT_USER_ERROR(from(t), "<|endoftext|>", "lstrip");
}

TEST(BpeTokenizer, SplitWithALiteralString) {
  json t = tiny_tokenizer();
  t["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Split"},
                                                         {"pattern", {{"String", "."}}},
                                                         {"behavior", "Isolated"}},
                                                        {{"type", "ByteLevel"},
                                                         {"add_prefix_space", false},
                                                         {"use_regex", false}}})}};
  BpeTokenizer tokenizer = from(t);
  // "." is a literal, not "any character"; " t" merges inside a piece only.
  EXPECT_EQ(tokenizer.encode("a t.x"), (std::vector<int32_t>{'a', 256, '.', 'x'}));
}

// A variant of the Llama 2 fixture: each is refused in one sentence naming the file and the part.
TEST(BpeTokenizer, UnsupportedSentencePieceVariantsAreNamed) {
  const json llama2 = json::parse(read_file(kFixtures + "llama2_kind.json"));
  const json metaspace = json::parse(read_file(kFixtures + "mistral_v3_kind.json"));
  const auto refused = [](json t, const std::string& part) {
    SCOPED_TRACE(part);
    EXPECT_USER_ERROR(from(t), "tokenizer 't.json' uses", part, "which dstrain does not support");
  };
  json t = metaspace;
  t["pre_tokenizer"]["prepend_scheme"] = "sometimes";
  refused(t, "a Metaspace pre-tokenizer with prepend_scheme \"sometimes\"");
  t = metaspace;
  t["pre_tokenizer"]["replacement"] = "_";
  refused(t, "a Metaspace pre-tokenizer with the replacement \"_\"");
  t = metaspace;
  t["normalizer"] = {{"type", "NFKC"}};
  refused(t, "a Metaspace pre-tokenizer after the normalizer NFKC");
  t = metaspace;
  t["decoder"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}};
  refused(t, "the decoder Metaspace (supported for the SentencePiece kind");
  t = llama2;
  t["decoder"]["decoders"].erase(2);  // no Fuse
  refused(t, "the decoder Sequence[Replace, ByteFallback, Strip]");
  t = llama2;
  t["normalizer"]["normalizers"].push_back({{"type", "NFKC"}});
  refused(t, "the normalizer Sequence[Prepend, Replace, NFKC]");
  t = llama2;
  t["normalizer"]["normalizers"][0]["prepend"] = "_";
  refused(t, "the normalizer Sequence[Prepend, Replace]");
  t = llama2;
  t["pre_tokenizer"] = {{"type", "Whitespace"}};
  refused(t, "the pre-tokenizer Whitespace after a Prepend/Replace normalizer");
  t = llama2;
  t["model"]["byte_fallback"] = false;
  refused(t, "a SentencePiece-kind model without byte_fallback");
  t = llama2;
  t["model"]["vocab"].erase("<0x7F>");
  refused(t, "byte_fallback without the byte token <0x7F> in model.vocab");
  // Older files' add_prefix_space: false needs prepend_scheme never (as in the library).
  t = metaspace;
  t["pre_tokenizer"].erase("prepend_scheme");
  t["pre_tokenizer"]["add_prefix_space"] = false;
  refused(t, "add_prefix_space false and prepend_scheme always");
  t["pre_tokenizer"]["prepend_scheme"] = "never";
  const std::vector<int32_t> after_bos = fixture_tokenizer("mistral_v3_kind").encode("<s>Hi");
  EXPECT_EQ(from(t).encode("Hi"), std::vector<int32_t>(after_bos.begin() + 1, after_bos.end()))
      << "never: no prefix, as after an added token under first";
}

}  // namespace
}  // namespace dstrain
