// Unicode helpers for the tokenizer: code point classes, UTF-8 decoding and encoding, and the
// GPT-2 byte <-> character mapping of byte-level BPE vocabularies.
//
// Everything here mirrors what llama.cpp does, because token ids must match it exactly:
//  - char_class() uses Unicode 15.1 general categories (the version of llama.cpp's tables), with
//    the White_Space property taking precedence, so a word splits the same way for every code
//    point, whatever Unicode version the regex library was built with.
//  - decode_utf8_lenient() accepts what llama.cpp accepts (overlong forms, surrogates) and turns
//    each byte it cannot decode into U+FFFD, one per byte, as llama.cpp does before BPE.
// Output-side code (StreamDecoder) uses the strict validator utf8_scan() instead.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace d2o::unicode {

inline constexpr uint32_t kReplacementChar = 0xFFFD;
inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// What a pre-tokenizer regex can tell apart. Values are used by the generated table.
enum class CharClass : uint8_t {
  kOther = 0,        // controls, format chars, private use, surrogates, unassigned
  kLetter = 1,       // \p{L}
  kNumber = 2,       // \p{N}
  kPunctuation = 3,  // \p{P}
  kSymbol = 4,       // \p{S}
  kMark = 5,         // \p{M}
  kWhitespace = 6,   // White_Space property (\s): checked before the category
};

CharClass char_class(uint32_t cp);
inline bool is_whitespace(uint32_t cp) {
  return char_class(cp) == CharClass::kWhitespace;
}

// Length of a UTF-8 sequence from its first byte alone, as llama.cpp's unicode_len_utf8:
// 1 for ASCII and stray continuation bytes, 2 for 0xC0-0xDF, 3 for 0xE0-0xEF, 4 for 0xF0-0xFF.
inline size_t utf8_len_from_lead(uint8_t lead) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

// Decodes `text` the way llama.cpp does before pre-tokenization: a lead byte whose sequence is
// malformed or truncated becomes U+FFFD and decoding resumes at the next byte. Overlong forms and
// surrogates are accepted; values above U+10FFFF (which llama.cpp cannot re-encode) become U+FFFD.
void decode_utf8_lenient(std::string_view text, std::vector<uint32_t>& out);

// Appends the UTF-8 form of `cp` (<= U+10FFFF; surrogates are encoded as 3 bytes like any other
// BMP value, as llama.cpp does).
void append_utf8(uint32_t cp, std::string& out);

// Strict UTF-8 scanning for output. Looks at the sequence starting at text[0]:
//  - returns {n, true} when the first n bytes form one valid character;
//  - returns {n, false} when the first n >= 1 bytes are invalid (the "maximal subpart" that
//    should become one U+FFFD);
//  - returns {0, false} when the bytes are a valid but incomplete prefix (more may follow).
struct Utf8Step {
  size_t length;
  bool valid;
};
Utf8Step utf8_scan(std::string_view text);

// GPT-2 byte-level BPE: every byte value is written as one printable character (printable
// Latin-1 bytes as themselves, the other 68 as U+0100...U+0143 in byte order).
const std::array<std::string, 256>& byte_to_chars();  // UTF-8 of the character for each byte
int char_to_byte(uint32_t cp);                        // inverse mapping, -1 when not a byte char

}  // namespace d2o::unicode
