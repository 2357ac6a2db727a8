#include "data/unicode_nfc.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "core/check.h"

namespace dstrain {

std::string nfc_normalize(std::string_view text) {
  // Most text is already NFC and ASCII has nothing to compose: skip the copy for it.
  bool ascii = true;
  for (const char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(text);
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t length = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
      static_cast<utf8proc_ssize_t>(text.size()), &mapped,
      static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  const std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(mapped, &std::free);
  DSTRAIN_USER_CHECK(length >= 0) << "NFC normalization failed: "
                                  << utf8proc_errmsg(length);
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(length));
}

NfcAligned nfc_normalize_aligned(std::string_view text) {
  const auto ascii = [&](size_t i) { return static_cast<unsigned char>(text[i]) < 0x80; };
  NfcAligned out;
  out.normalized.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    size_t first = at;  // the first non-ASCII byte
    while (first < text.size() && ascii(first)) ++first;
    if (first == text.size()) {
      out.normalized.append(text.substr(at));
      break;
    }
    // The piece: the ASCII character before it (a mark composes with it), up to the next ASCII.
    const size_t begin = first > at ? first - 1 : first;
    size_t end = first;
    while (end < text.size() && !ascii(end)) ++end;
    out.normalized.append(text.substr(at, begin - at));
    const std::string_view piece = text.substr(begin, end - begin);
    const std::string nfc = nfc_normalize(piece);
    if (nfc != piece) {
      const size_t nfc_begin = out.normalized.size();
      out.changes.push_back({begin, end, nfc_begin, nfc_begin + nfc.size()});
    }
    out.normalized += nfc;
    at = end;
  }
  return out;
}

std::pair<size_t, size_t> NfcAligned::to_text(size_t begin, size_t end) const {
  // The last change that starts at or before `position` (before it, for an end).
  const auto last_change = [&](size_t position, bool is_end) -> const Change* {
    const auto after = std::partition_point(changes.begin(), changes.end(), [&](const Change& c) {
      return is_end ? c.nfc_begin < position : c.nfc_begin <= position;
    });
    return after == changes.begin() ? nullptr : &*(after - 1);
  };
  const auto map = [&](size_t position, bool is_end) {
    const Change* change = last_change(position, is_end);
    if (change == nullptr) return position;
    const bool inside = is_end ? position <= change->nfc_end : position < change->nfc_end;
    if (inside) return is_end ? change->text_end : change->text_begin;
    return position - change->nfc_end + change->text_end;
  };
  return {map(begin, false), map(end, true)};
}

}  // namespace dstrain
