// nfc_normalize_aligned: the NFC form of the whole text (utf8proc's, through nfc_normalize),
// and its way back to the text's bytes, on random mixes of what NFC composes and reorders.
#include "data/unicode_nfc.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace dstrain {
namespace {

// Pieces that NFC composes (e + U+0301, Hangul jamo), reorders (U+0323 after U+0301), expands
// (U+0958, a composition exclusion) or keeps (precomposed é, CJK, emoji, ASCII).
const std::vector<std::string> kPieces = {"e",
                                          "a",
                                          " ",
                                          "\n",
                                          "\xCC\x81" /* U+0301 */,
                                          "\xCC\xA3" /* U+0323 */,
                                          "\xC3\xA9" /* é */,
                                          "\xE1\x84\x80" /* U+1100 */,
                                          "\xE1\x85\xA1" /* U+1161 */,
                                          "\xE1\x86\xA8" /* U+11A8 */,
                                          "\xE0\xA5\x98" /* U+0958 */,
                                          "\xE6\x97\xA5" /* 日 */,
                                          "\xF0\x9F\x99\x82" /* 🙂 */,
                                          "Z"};

std::string random_text(std::mt19937& rng, int pieces) {
  std::uniform_int_distribution<size_t> pick(0, kPieces.size() - 1);
  std::string text;
  for (int i = 0; i < pieces; ++i) text += kPieces[pick(rng)];
  return text;
}

TEST(Nfc, AlignedFormIsTheWholeTextsNfcAndMapsBack) {
  std::mt19937 rng(7);
  size_t changed = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::string text = random_text(rng, 1 + trial % 24);
    SCOPED_TRACE(text);
    const NfcAligned aligned = nfc_normalize_aligned(text);
    ASSERT_EQ(aligned.normalized, nfc_normalize(text));
    changed += !aligned.changes.empty();
    // Each changed piece maps to its own bytes of the text, whose NFC form it is.
    for (const NfcAligned::Change& c : aligned.changes) {
      EXPECT_EQ(aligned.to_text(c.nfc_begin, c.nfc_end), std::make_pair(c.text_begin, c.text_end));
      EXPECT_EQ(nfc_normalize(text.substr(c.text_begin, c.text_end - c.text_begin)),
                aligned.normalized.substr(c.nfc_begin, c.nfc_end - c.nfc_begin));
    }
    // Every range maps inside the text, rising with its ends; a range clear of the changes
    // maps to the same bytes.
    const size_t n = aligned.normalized.size();
    for (size_t begin = 0; begin <= n; ++begin) {
      for (size_t end = begin; end <= n; ++end) {
        const auto [b, e] = aligned.to_text(begin, end);
        ASSERT_LE(b, e);
        ASSERT_LE(e, text.size());
        if (begin > 0) {
          ASSERT_LE(aligned.to_text(begin - 1, end).first, b);
        }
        bool clear = true;
        for (const NfcAligned::Change& c : aligned.changes)
          clear = clear && (end <= c.nfc_begin || begin >= c.nfc_end);
        if (clear) {
          ASSERT_EQ(text.substr(b, e - b), aligned.normalized.substr(begin, end - begin));
        }
      }
    }
    EXPECT_EQ(aligned.to_text(0, n), std::make_pair(size_t{0}, text.size()));
  }
  EXPECT_GE(changed, 200u) << "the texts must exercise composition";
}

TEST(Nfc, AsciiAndNfcTextAreUnchanged) {
  for (const std::string text : {"", "plain ascii\n", "caf\xC3\xA9 \xE6\x97\xA5"}) {
    const NfcAligned aligned = nfc_normalize_aligned(text);
    EXPECT_EQ(aligned.normalized, text);
    EXPECT_TRUE(aligned.changes.empty());
  }
  const NfcAligned composed = nfc_normalize_aligned("xe\xCC\x81y");  // x, e + U+0301, y
  EXPECT_EQ(composed.normalized, "x\xC3\xA9y");
  EXPECT_EQ(composed.to_text(1, 3), std::make_pair(size_t{1}, size_t{4}));
  EXPECT_EQ(composed.to_text(3, 4), std::make_pair(size_t{4}, size_t{5}));
}

}  // namespace
}  // namespace dstrain
