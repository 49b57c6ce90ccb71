#include "runtime/unicode.h"

#include <memory>

namespace d2o::unicode {
namespace {

struct UnicodeRange {
  uint32_t first;
  uint8_t cls;
};
#include "runtime/unicode_tables.inc"

// Two-stage lookup table built once from the ranges: 4352 blocks of 256 code points, identical
// blocks shared (about 60 KB in all).
class ClassTable {
 public:
  ClassTable() {
    constexpr uint32_t kBlocks = (kMaxCodePoint + 1) / 256;
    index_.resize(kBlocks);
    std::array<uint8_t, 256> block{};
    uint32_t r = 0;
    for (uint32_t b = 0; b < kBlocks; ++b) {
      for (uint32_t k = 0; k < 256; ++k) {
        const uint32_t cp = b * 256 + k;
        while (r + 1 < kUnicodeRangeCount && kUnicodeRanges[r + 1].first <= cp) ++r;
        block[k] = kUnicodeRanges[r].cls;
      }
      index_[b] = intern(block);
    }
  }
  CharClass get(uint32_t cp) const {
    if (cp > kMaxCodePoint) return CharClass::kOther;
    return static_cast<CharClass>(blocks_[index_[cp >> 8]][cp & 255]);
  }

 private:
  uint16_t intern(const std::array<uint8_t, 256>& block) {
    // The last few blocks repeat (unassigned planes, CJK), so checking recent ones is enough
    // to keep the table small; exact deduplication is not needed.
    for (size_t i = blocks_.size(); i-- > 0 && blocks_.size() - i <= 8;) {
      if (blocks_[i] == block) return static_cast<uint16_t>(i);
    }
    blocks_.push_back(block);
    return static_cast<uint16_t>(blocks_.size() - 1);
  }
  std::vector<uint16_t> index_;
  std::vector<std::array<uint8_t, 256>> blocks_;
};

const ClassTable& class_table() {
  static const ClassTable table;
  return table;
}

bool is_cont(uint8_t b) {
  return (b & 0xC0) == 0x80;
}

}  // namespace

CharClass char_class(uint32_t cp) {
  if (cp < 0x80) {
    // ASCII is hot: answer without the table (same classes as the generated data).
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kWhitespace;
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp < 0x20 || cp == 0x7F) return CharClass::kOther;
    switch (cp) {
      case '$':
      case '+':
      case '<':
      case '=':
      case '>':
      case '^':
      case '`':
      case '|':
      case '~':
        return CharClass::kSymbol;
      default:
        return CharClass::kPunctuation;
    }
  }
  return class_table().get(cp);
}

void decode_utf8_lenient(std::string_view text, std::vector<uint32_t>& out) {
  out.clear();
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b0 = s[i];
    uint32_t cp = kReplacementChar;
    size_t len = 1;
    if (b0 < 0x80) {
      cp = b0;
    } else if ((b0 & 0x40) == 0) {
      // stray continuation byte: invalid
    } else if ((b0 & 0x20) == 0) {
      if (i + 1 < n && is_cont(s[i + 1])) {
        cp = ((b0 & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
        len = 2;
      }
    } else if ((b0 & 0x10) == 0) {
      if (i + 2 < n && is_cont(s[i + 1]) && is_cont(s[i + 2])) {
        cp = ((b0 & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
        len = 3;
      }
    } else if ((b0 & 0x08) == 0) {
      if (i + 3 < n && is_cont(s[i + 1]) && is_cont(s[i + 2]) && is_cont(s[i + 3])) {
        const uint32_t v = ((b0 & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) |
                           ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
        if (v <= kMaxCodePoint) {
          cp = v;
          len = 4;
        }
      }
    }
    out.push_back(cp);
    i += len;
  }
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | ((cp >> 18) & 0x07)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

Utf8Step utf8_scan(std::string_view text) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  if (n == 0) return {0, false};
  const uint8_t b0 = s[0];
  if (b0 < 0x80) return {1, true};
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte (RFC 3629 table)
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {1, false};
  }
  for (size_t k = 1; k < need; ++k) {
    if (k >= n) return {0, false};  // valid so far, incomplete
    const uint8_t b = s[k];
    const bool ok = (k == 1) ? (b >= lo && b <= hi) : is_cont(b);
    if (!ok) return {k, false};
  }
  return {need, true};
}

const std::array<std::string, 256>& byte_to_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      std::string s;
      append_utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(next++), s);
      t[b] = s;
    }
    return t;
  }();
  return table;
}

int char_to_byte(uint32_t cp) {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[printable ? b : next++] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return cp < table.size() ? table[cp] : -1;
}

}  // namespace d2o::unicode
