#include "data/unicode_nfc.h"

#include <utf8proc.h>

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

}  // namespace dstrain
