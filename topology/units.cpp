#include "topology/units.h"

#include <cctype>
#include <cmath>

#include "core/check.h"

namespace dstrain {

namespace {

std::string lower(std::string_view text) {
  std::string out;
  for (char c : text) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

[[noreturn]] void bad_size(std::string_view text) {
  DSTRAIN_USER_ERROR() << "'" << text << "' is not a size: write a number with an optional "
                       << "binary unit, such as 512M, 256G, 256GiB or 1T";
}

}  // namespace

uint64_t parse_size(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t end = text.size();
  while (end > i && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  const std::string_view body = text.substr(i, end - i);

  // The number: digits, optionally a fraction.
  size_t k = 0;
  std::string number;
  while (k < body.size() && std::isdigit(static_cast<unsigned char>(body[k]))) number += body[k++];
  size_t fraction_digits = 0;
  if (k < body.size() && body[k] == '.') {
    number += body[k++];
    while (k < body.size() && std::isdigit(static_cast<unsigned char>(body[k]))) {
      number += body[k++];
      ++fraction_digits;
    }
    if (fraction_digits == 0) bad_size(text);
  }
  if (number.empty() || number[0] == '.') bad_size(text);
  while (k < body.size() && body[k] == ' ') ++k;

  const std::string unit = lower(body.substr(k));
  int shift = -1;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else {
    const char prefix = unit[0];
    const std::string rest = unit.substr(1);
    if (rest.empty() || rest == "b" || rest == "ib") {
      switch (prefix) {
        case 'k': shift = 10; break;
        case 'm': shift = 20; break;
        case 'g': shift = 30; break;
        case 't': shift = 40; break;
        case 'p': shift = 50; break;
        default: break;
      }
    }
  }
  if (shift < 0) bad_size(text);

  const long double value = std::stold(number) * std::ldexp(1.0L, shift);
  DSTRAIN_USER_CHECK(value < 18446744073709551616.0L)
      << "size '" << text << "' is too large (more than 2^64 bytes)";
  const long double rounded = std::floor(value + 0.5L);
  DSTRAIN_USER_CHECK(shift > 0 || rounded == value)
      << "size '" << text << "' is not a whole number of bytes";
  return static_cast<uint64_t>(rounded);
}

}  // namespace dstrain
