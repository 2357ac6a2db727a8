// BpeTokenizer against the `tokenizers` library: the fixtures in tests/reference/tokenizers/
// (made by tests/reference/make_tokenizer_fixtures.py) hold small trained tokenizer.json files
// of the GPT-2, Llama 3 and DeepSeek kinds and the library's ids for texts with accents, CJK,
// emoji, digit runs, whitespace runs, contractions and special tokens.
#include "data/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "core/fs.h"
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

TEST(BpeTokenizer, IdsEqualTheLibrarysOnEveryFixtureCase) {
  ASSERT_GE(fixture_cases().size(), 120u);
  size_t nonempty = 0;
  for (const json& c : fixture_cases()) {
    BpeTokenizer& tokenizer = fixture_tokenizer(c["tokenizer"]);
    const std::string text = c["text"];
    const std::vector<int32_t> expected = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> ids = tokenizer.encode(text);
    EXPECT_EQ(ids, expected) << c["tokenizer"] << " on " << json(text).dump();
    nonempty += !expected.empty();
    EXPECT_EQ(tokenizer.decode(expected), c["decoded"].get<std::string>()) << json(text).dump();
    // The ids stand for the text, or its NFC form under Qwen2's normalizer.
    EXPECT_EQ(tokenizer.decode_bytes(expected), c["normalized"].get<std::string>())
        << "round trip of " << json(text).dump();
    if (expected.empty()) continue;
    const std::span<const int32_t> prefix(expected.data(), expected.size() - 1);
    EXPECT_EQ(tokenizer.decode(prefix), c["prefix_decoded"].get<std::string>())
        << "a cut decode of " << json(text).dump();
  }
  EXPECT_GE(nonempty, 110u) << "the fixtures must not be all empty";
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
}

TEST(BpeTokenizer, BlocksCutAtSafePrefixesGiveTheWholeTextsIds) {
  const std::string corpus = read_file(kFixtures + "corpus.txt");
  for (const char* name : {"gpt2_kind", "llama3_kind", "deepseek_kind", "qwen2_kind"}) {
    BpeTokenizer& tokenizer = fixture_tokenizer(name);
    const std::vector<int32_t> whole = tokenizer.encode(corpus);
    std::vector<int32_t> blocked;
    std::string_view rest = corpus;
    size_t cuts = 0;
    while (!rest.empty()) {  // blocks of 300 bytes or more, cut where the tokenizer allows
      size_t block = 300, cut = 0;
      while (block < rest.size() && (cut = tokenizer.safe_prefix_length(rest.substr(0, block))) == 0)
        block *= 2;
      const size_t take = block >= rest.size() ? rest.size() : cut;
      const std::vector<int32_t> ids = tokenizer.encode(rest.substr(0, take));
      blocked.insert(blocked.end(), ids.begin(), ids.end());
      rest.remove_prefix(take);
      ++cuts;
    }
    EXPECT_GT(cuts, 10u);
    EXPECT_EQ(blocked, whole) << name;
  }
  BpeTokenizer& gpt2 = fixture_tokenizer("gpt2_kind");
  EXPECT_EQ(gpt2.safe_prefix_length("ab\ncd\nef"), 6u);
  EXPECT_EQ(gpt2.safe_prefix_length("ab \ncd"), 0u) << "a space before the newline";
  EXPECT_EQ(gpt2.safe_prefix_length("ab\n cd\n\n"), 0u) << "a space or newline after it";
  EXPECT_EQ(gpt2.safe_prefix_length(""), 0u);
}

TEST(BpeTokenizer, LongWordsAndTheCache) {
  BpeTokenizer& gpt2 = fixture_tokenizer("gpt2_kind");
  std::string long_word;  // one pre-token of 20000 letters
  while (long_word.size() < 20000) long_word += "quick";
  const std::vector<int32_t> first = gpt2.encode(long_word);
  EXPECT_LT(first.size(), long_word.size()) << "merged";
  EXPECT_EQ(gpt2.encode(long_word), first) << "from the cache";
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
  t["pre_tokenizer"] = {{"type", "Metaspace"}};
  EXPECT_USER_ERROR(from(t), "pre-tokenizer Metaspace", "does not support");
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

}  // namespace
}  // namespace dstrain
