#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"

namespace dstrain {
namespace {

TEST(ByteTokenizer, RoundTripEveryByteAndRandomBytes) {
  const ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.vocab_size(), 256);
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const auto tokens = tokenizer.encode(all);
  ASSERT_EQ(tokens.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[b], b);
  EXPECT_EQ(tokenizer.decode_bytes(tokens), all);

  Rng rng(17);
  std::string random(10000, '\0');
  for (char& c : random) c = static_cast<char>(rng.below(256));
  EXPECT_EQ(tokenizer.decode_bytes(tokenizer.encode(random)), random);
  EXPECT_TRUE(tokenizer.encode("").empty());
}

TEST(ByteTokenizer, PrintableDecode) {
  const ByteTokenizer tokenizer;
  const std::string text = "Hi!\n\tx\\y\r\x01\x7f";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), "Hi!\n\tx\\\\y\\x0d\\x01\\x7f");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("plain ASCII text.")), "plain ASCII text.");
}

TEST(ByteTokenizer, PrintableDecodeKeepsWellFormedUtf8Only) {
  const ByteTokenizer tokenizer;
  const std::string utf8 = "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";  // café € 😀
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(utf8)), utf8);
  // A cut sequence, a stray continuation byte, an overlong form, a surrogate, 0xff.
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xc3")), "\\xc3");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("a\xa9z")), "a\\xa9z");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xc0\xaf")), "\\xc0\\xaf");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xed\xa0\x80")), "\\xed\\xa0\\x80");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xff")), "\\xff");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xe2\x82")), "\\xe2\\x82");
}

TEST(ByteTokenizer, IdsOutsideTheByteRange) {
  const ByteTokenizer tokenizer;
  const std::vector<int32_t> tokens = {'a', 300, 0xc3, -1, 0xa9};
  EXPECT_EQ(tokenizer.decode(tokens), "a<300>\\xc3<-1>\\xa9");
  EXPECT_THROW(tokenizer.decode_bytes(tokens), Error);
}

}  // namespace
}  // namespace dstrain
