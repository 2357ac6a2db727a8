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

[[noreturn]] void bad_rate(std::string_view text, const std::string& flag) {
  DSTRAIN_USER_ERROR() << flag << " '" << text
                       << "' is not a bandwidth: write a positive number and a unit, such as "
                          "25GB/s (bytes), 200Gbit/s or 100G (bits)";
}

// 1e3 .. 1e12 for k, m, g, t; 0 for anything else.
double decimal_prefix(char c) {
  switch (std::tolower(static_cast<unsigned char>(c))) {
    case 'k': return 1e3;
    case 'm': return 1e6;
    case 'g': return 1e9;
    case 't': return 1e12;
    default: return 0;
  }
}

// 1 for a byte unit, 1/8 for a bit unit, 0 for neither. `unit` follows the prefix.
double bytes_per_unit(const std::string& unit) {
  const std::string folded = lower(unit);
  const bool byte_spelling = folded == "b" || folded == "b/s" || folded == "bps";
  if (byte_spelling && unit[0] == 'B') return 1;    // GB/s, GBps, GB
  if (byte_spelling || unit.empty()) return 0.125;  // Gb/s, Gbps, Gb, G
  for (const char* bits : {"bit", "bit/s", "bits", "bits/s"}) {
    if (folded == bits) return 0.125;
  }
  return 0;
}

}  // namespace

double parse_rate(std::string_view text, const std::string& flag) {
  size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  const std::string body(text.substr(begin, end - begin));
  size_t k = 0;
  while (k < body.size() && (std::isdigit(static_cast<unsigned char>(body[k])) || body[k] == '.')) {
    ++k;
  }
  const std::string number = body.substr(0, k);
  if (number.empty() || number.front() == '.' || number.back() == '.' ||
      number.find('.') != number.rfind('.')) {
    bad_rate(text, flag);
  }
  while (k < body.size() && body[k] == ' ') ++k;
  if (k >= body.size()) bad_rate(text, flag);  // no unit: bits or bytes?
  const double prefix = decimal_prefix(body[k]);
  const double per_unit = prefix > 0 ? bytes_per_unit(body.substr(k + 1)) : 0;
  const double value = std::stod(number) * prefix * per_unit;
  if (!(value > 0) || !std::isfinite(value)) bad_rate(text, flag);
  return value;
}

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
