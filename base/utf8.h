// Text from users and files on its way into a message. Messages are UTF-8 and Python decodes them strictly
// (a bad byte turns zoe's error into a UnicodeDecodeError), so an excerpt must not end inside a character
// and bytes that are not UTF-8 must not be copied through as they are.
#pragma once

#include "base/private.h"

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace zoe {

// Bytes in the well-formed UTF-8 sequence at s[at] (Unicode 15, table 3-7: no overlong forms, no
// surrogates, nothing above U+10FFFF); 0 when none starts there.
inline std::size_t utf8_sequence_at(std::string_view s, std::size_t at) {
  const auto byte = [&](std::size_t i) { return at + i < s.size() ? static_cast<unsigned char>(s[at + i]) : 0u; };
  const unsigned b0 = byte(0);
  if (at >= s.size()) return 0;
  if (b0 < 0x80) return 1;
  const auto cont = [&](std::size_t i, unsigned lo = 0x80, unsigned hi = 0xBF) {
    return byte(i) >= lo && byte(i) <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    return cont(1, lo, hi) && cont(2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    return cont(1, lo, hi) && cont(2) && cont(3) ? 4 : 0;
  }
  return 0;
}

inline bool utf8_valid(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence_at(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// `s` with every byte outside a well-formed sequence written as \xNN: valid UTF-8 that still shows the bytes.
inline std::string utf8_escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    if (const std::size_t n = utf8_sequence_at(s, i); n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02X", static_cast<unsigned char>(s[i]));
      out += hex;
      ++i;
    }
  }
  return out;
}

// At most `max_bytes` of `s`, cut before the character that would not fit whole.
inline std::string_view utf8_prefix(std::string_view s, std::size_t max_bytes) {
  std::size_t end = 0;
  while (end < s.size()) {
    const std::size_t n = utf8_sequence_at(s, end);
    const std::size_t step = n == 0 ? 1 : n;  // a stray byte is one unit: utf8_escaped shows it
    if (end + step > max_bytes) break;
    end += step;
  }
  return s.substr(0, end);
}

}  // namespace zoe
