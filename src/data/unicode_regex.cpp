#include "data/unicode_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>
#include <memory>

#include "core/check.h"

namespace dstrain {

namespace {

pcre2_code* as_code(void* code) { return static_cast<pcre2_code*>(code); }

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// Per-call match state. The JIT stack is larger than PCRE2's 32 KiB default: a long run of
// whitespace under `\s+(?!\S)` backtracks one character at a time.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  explicit MatchState(const pcre2_code* code) {
    data = pcre2_match_data_create_from_pattern(code, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    DSTRAIN_CHECK(data && context && jit_stack) << "out of memory for a regex match";
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

}  // namespace

UnicodeRegex::UnicodeRegex(const std::string& pattern) : pattern_(pattern) {
  std::unique_ptr<pcre2_compile_context, decltype(&pcre2_compile_context_free)> context(
      pcre2_compile_context_create(nullptr), &pcre2_compile_context_free);
  DSTRAIN_CHECK(context != nullptr) << "out of memory compiling a regex";
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error_code, &error_offset,
                        context.get());
  DSTRAIN_USER_CHECK(code_ != nullptr)
      << "the tokenizer's regex pattern '" << pattern << "' does not compile: "
      << pcre2_message(error_code) << " (at byte " << error_offset << ").";
  // Without JIT (a PCRE2 built without it, or no executable memory) the interpreter gives the
  // same matches, slower.
  pcre2_jit_compile(as_code(code_), PCRE2_JIT_COMPLETE);
}

UnicodeRegex::~UnicodeRegex() { pcre2_code_free(as_code(code_)); }

UnicodeRegex::UnicodeRegex(UnicodeRegex&& other) noexcept
    : pattern_(std::move(other.pattern_)), code_(std::exchange(other.code_, nullptr)) {}

UnicodeRegex& UnicodeRegex::operator=(UnicodeRegex&& other) noexcept {
  if (this != &other) {
    pcre2_code_free(as_code(code_));
    pattern_ = std::move(other.pattern_);
    code_ = std::exchange(other.code_, nullptr);
  }
  return *this;
}

std::vector<std::pair<size_t, size_t>> UnicodeRegex::find_all(std::string_view subject) const {
  std::vector<std::pair<size_t, size_t>> matches;
  MatchState state(as_code(code_));
  const auto* bytes = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  while (start < subject.size()) {
    const int result = pcre2_match(as_code(code_), bytes, subject.size(), start,
                                   PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (result == PCRE2_ERROR_NOMATCH) break;
    DSTRAIN_USER_CHECK(result >= 0) << "matching the tokenizer's regex '" << pattern_
                                    << "' failed: " << pcre2_message(result) << ".";
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {  // empty: step over one whole character
      const size_t length = utf8_sequence_length(subject, begin);
      start = begin + (length > 0 ? length : 1);
    }
  }
  return matches;
}

std::string UnicodeRegex::escape(std::string_view literal) {
  std::string pattern;
  for (const char c : literal) {
    const unsigned char byte = static_cast<unsigned char>(c);
    // A backslash before an ASCII non-alphanumeric always means the character itself.
    if (byte < 0x80 && !std::isalnum(byte)) pattern += '\\';
    pattern += c;
  }
  return pattern;
}

size_t utf8_sequence_length(std::string_view text, size_t i) {
  const unsigned char lead = static_cast<unsigned char>(text[i]);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;  // at most U+10FFFF
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    const unsigned char b = static_cast<unsigned char>(text[i + k]);
    if (b < (k == 1 ? low : 0x80) || b > (k == 1 ? high : 0xBF)) return 0;
  }
  return length;
}

size_t valid_utf8_prefix(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t length = utf8_sequence_length(text, i);
    if (length == 0) break;
    i += length;
  }
  return i;
}

}  // namespace dstrain
