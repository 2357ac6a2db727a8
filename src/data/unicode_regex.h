// A compiled regular expression with Unicode properties (PCRE2, 8-bit, UTF + UCP), for the
// pre-tokenizer patterns of Hugging Face tokenizer.json files (\p{L}, \p{N}, (?!\S), (?i:...)).
//
// Hugging Face `tokenizers` runs these patterns with Oniguruma (Ruby syntax). PCRE2 is set up
// to agree with it on what these patterns use: UTF-8, Unicode classes for \s \w \d (UCP), and
// `^`/`$` at line boundaries (Ruby's `$` is end-of-line: PCRE2_MULTILINE, newline = LF).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dstrain {

class UnicodeRegex {
 public:
  // Compiles `pattern` (UTF-8), with JIT when PCRE2 has it. Throws UserError naming the pattern
  // and PCRE2's message when it does not compile.
  explicit UnicodeRegex(const std::string& pattern);
  ~UnicodeRegex();
  UnicodeRegex(UnicodeRegex&& other) noexcept;
  UnicodeRegex& operator=(UnicodeRegex&& other) noexcept;
  UnicodeRegex(const UnicodeRegex&) = delete;
  UnicodeRegex& operator=(const UnicodeRegex&) = delete;

  // The non-overlapping, non-empty matches of the pattern in `subject`, left to right, as
  // [begin, end) byte offsets, searching on from each match's end (an empty match moves the
  // search one character on and is not reported). The subject is the whole haystack: `^`, `$`
  // and lookarounds see nothing outside it.
  // REQUIRES: subject is valid UTF-8 (not checked again here, for speed).
  // Thread-safe: each call uses its own match state.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const;

  const std::string& pattern() const { return pattern_; }

  // `literal` as a pattern that matches exactly it (for Split's {"String": ...} patterns).
  static std::string escape(std::string_view literal);

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*: kept opaque so that users need no PCRE2 header
};

// The length of the well-formed UTF-8 prefix of `text` (RFC 3629: no overlongs, no
// surrogates, at most U+10FFFF): text.size() when all of it is valid.
size_t valid_utf8_prefix(std::string_view text);

// Length of the well-formed UTF-8 sequence that starts at text[i], or 0 when none does.
// REQUIRES: i < text.size().
size_t utf8_sequence_length(std::string_view text, size_t i);

}  // namespace dstrain
