#include "runtime/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>

#include "core/assert.h"
#include "runtime/unicode.h"

namespace d2o {
namespace {

// The regexes, in PCRE2 syntax. They are the patterns of the original tokenizers as llama.cpp
// runs them; where llama.cpp uses a hand-written splitter instead of its regex (GPT-2, Llama 3,
// Qwen2), the pattern here reproduces that splitter, e.g. GPT-2's ends in "|\s+" because the
// splitter falls back to taking a whole whitespace run.
constexpr const char* kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|)"
    R"(\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kDigit = R"(\p{N})";
constexpr const char* kDigits = R"(\p{N}+)";
constexpr const char* kDefaultPunct = R"([\p{P}\$\+<=>\^~\|]+)";
constexpr const char* kThreeAsciiDigits = R"([0-9][0-9][0-9])";

struct Spec {
  const char* name;
  std::vector<const char*> regexes;
  PreTokenizerTraits traits;
};

// Names are those of llama.cpp's converter (tokenizer.ggml.pre); a family shares regexes and
// flags. Flags: {ignore_merges, add_bos default, clean_spaces}.
const std::vector<Spec>& specs() {
  static const std::vector<Spec> kSpecs = [] {
    std::vector<Spec> s;
    auto add = [&](std::initializer_list<const char*> names, std::vector<const char*> rx,
                   PreTokenizerTraits t) {
      for (const char* n : names) s.push_back({n, rx, t});
    };
    add({"smollm", "command-r"}, {kDigit, kGpt2}, {false, false, false});
    add({"starcoder", "refact", "codeshell", "exaone", "minerva-7b"}, {kDigit, kGpt2},
        {false, false, true});
    add({"gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"}, {kGpt2}, {false, false, true});
    add({"trillion", "granite-docling"}, {kGpt2}, {false, false, false});
    add({"default"}, {kDefaultPunct, kGpt2, kDigits, kThreeAsciiDigits}, {false, false, true});
    add({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"},
        {kLlama3}, {true, true, true});
    add({"dbrx", "smaug-bpe"}, {kLlama3}, {false, false, true});
    add({"qwen2", "deepseek-r1-qwen", "hunyuan", "solar-open", "grok-2"}, {kQwen2},
        {false, false, false});
    add({"megrez", "stablelm2"}, {kQwen2}, {false, false, true});
    return s;
  }();
  return kSpecs;
}

// Stand-ins for non-ASCII code points, all two bytes in UTF-8, chosen so PCRE2 (any Unicode
// version) puts each in the intended class: ª is Lo, ² is No, ¡ Po, ¦ So, U+0300 Mn, NBSP is
// White_Space (\s), soft hyphen is Cf (in none of the classes a regex names).
uint32_t stand_in(unicode::CharClass c) {
  switch (c) {
    case unicode::CharClass::kLetter:
      return 0xAA;
    case unicode::CharClass::kNumber:
      return 0xB2;
    case unicode::CharClass::kPunctuation:
      return 0xA1;
    case unicode::CharClass::kSymbol:
      return 0xA6;
    case unicode::CharClass::kMark:
      return 0x300;
    case unicode::CharClass::kWhitespace:
      return 0xA0;
    case unicode::CharClass::kOther:
      break;
  }
  return 0xAD;
}

// Per-call scratch for split().
struct SplitScratch {
  std::vector<uint32_t> cps;         // decoded code points
  std::vector<uint32_t> text_off;    // [n+1] byte offset of each code point in out.text
  std::string subject;               // ASCII + stand-ins, what the regexes see
  std::vector<uint32_t> subj_off;    // [n+1] byte offset of each code point in subject
  std::vector<uint32_t> subj_to_cp;  // [subject.size()+1] code point index at a char boundary
  std::vector<uint32_t> pieces;      // piece lengths in code points
  std::vector<uint32_t> next;
};

}  // namespace

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

PreTokenizer::~PreTokenizer() = default;

std::vector<std::string> PreTokenizer::supported_names() {
  std::vector<std::string> names;
  for (const Spec& s : specs()) names.emplace_back(s.name);
  return names;
}

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::create(std::string_view name) {
  const Spec* spec = nullptr;
  for (const Spec& s : specs()) {
    if (name == s.name) spec = &s;
  }
  if (!spec) {
    std::string known;
    for (const std::string& n : supported_names()) known += (known.empty() ? "" : ", ") + n;
    return unsupported("unknown pre-tokenizer '" + std::string(name) +
                       "' (tokenizer.ggml.pre); supported: " + known);
  }
  std::unique_ptr<PreTokenizer> pt(new PreTokenizer());
  pt->name_ = spec->name;
  pt->traits_ = spec->traits;
  for (const char* pattern : spec->regexes) {
    auto rx = std::make_unique<Regex>();
    int err = 0;
    PCRE2_SIZE err_off = 0;
    rx->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                             PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
    if (!rx->code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return internal_error("pre-tokenizer regex does not compile: " +
                            std::string(reinterpret_cast<char*>(msg)));
    }
    rx->jit = pcre2_jit_compile(rx->code, PCRE2_JIT_COMPLETE) == 0;
    pt->regexes_.push_back(std::move(rx));
  }
  return pt;
}

Status PreTokenizer::split(std::string_view input, PreTokenized& out) const {
  SplitScratch s;
  unicode::decode_utf8_lenient(input, s.cps);
  const size_t n = s.cps.size();

  // Re-encoded text, the regex subject, and the offset maps between them.
  out.text.clear();
  out.text.reserve(input.size());
  s.subject.reserve(input.size() + n);
  s.text_off.resize(n + 1);
  s.subj_off.resize(n + 1);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t cp = s.cps[i];
    s.text_off[i] = static_cast<uint32_t>(out.text.size());
    s.subj_off[i] = static_cast<uint32_t>(s.subject.size());
    unicode::append_utf8(cp, out.text);
    if (cp < 0x80) {
      s.subject.push_back(static_cast<char>(cp));
    } else {
      unicode::append_utf8(stand_in(unicode::char_class(cp)), s.subject);
    }
  }
  s.text_off[n] = static_cast<uint32_t>(out.text.size());
  s.subj_off[n] = static_cast<uint32_t>(s.subject.size());
  s.subj_to_cp.assign(s.subject.size() + 1, 0);
  for (size_t i = 0; i <= n; ++i) s.subj_to_cp[s.subj_off[i]] = static_cast<uint32_t>(i);

  // Pieces, as lengths in code points; each regex splits every piece into matches and gaps.
  s.pieces.assign(1, static_cast<uint32_t>(n));
  if (n == 0) s.pieces.clear();
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jstack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
  if (mctx && jstack) pcre2_jit_stack_assign(mctx, nullptr, jstack);
  // Backtracking over a long whitespace run (\s*[\r\n]+) costs steps in proportion to the
  // run; lift the default limit of 10M steps so that long inputs are never refused.
  if (mctx) pcre2_set_match_limit(mctx, 0xFFFFFFFFu);
  Status status;
  for (const auto& rx : regexes_) {
    if (md) pcre2_match_data_free(md);
    md = pcre2_match_data_create_from_pattern(rx->code, nullptr);
    D2O_ASSERT(md != nullptr);
    s.next.clear();
    uint32_t start = 0;  // code point index of the current piece
    for (uint32_t len : s.pieces) {
      const uint32_t b0 = s.subj_off[start];
      const uint32_t b1 = s.subj_off[start + len];
      const auto* subj = reinterpret_cast<PCRE2_SPTR>(s.subject.data() + b0);
      const PCRE2_SIZE subj_len = b1 - b0;
      PCRE2_SIZE pos = 0;   // search position, bytes from b0
      PCRE2_SIZE done = 0;  // end of the last emitted piece, bytes from b0
      while (pos < subj_len) {
        const int rc = pcre2_match(rx->code, subj, subj_len, pos, PCRE2_NO_UTF_CHECK, md, mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          PCRE2_UCHAR msg[256];
          pcre2_get_error_message(rc, msg, sizeof(msg));
          status = resource_exhausted("pre-tokenizer regex failed: " +
                                      std::string(reinterpret_cast<char*>(msg)));
          break;
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        const PCRE2_SIZE m0 = ov[0], m1 = ov[1];
        if (m1 == m0) {
          // An empty match yields no word; step over one character and search again.
          pos = m0 + unicode::utf8_len_from_lead(static_cast<uint8_t>(subj[m0]));
          continue;
        }
        if (m0 > done) {
          s.next.push_back(s.subj_to_cp[b0 + m0] - s.subj_to_cp[b0 + done]);
        }
        s.next.push_back(s.subj_to_cp[b0 + m1] - s.subj_to_cp[b0 + m0]);
        done = pos = m1;
      }
      if (done < subj_len) s.next.push_back(s.subj_to_cp[b1] - s.subj_to_cp[b0 + done]);
      start += len;
      if (!status.ok()) break;
    }
    s.pieces.swap(s.next);
    if (!status.ok()) break;
  }
  if (md) pcre2_match_data_free(md);
  if (jstack) pcre2_jit_stack_free(jstack);
  if (mctx) pcre2_match_context_free(mctx);
  D2O_RETURN_IF_ERROR(status);

  out.word_ends.clear();
  out.word_ends.reserve(s.pieces.size());
  uint32_t cp_end = 0;
  for (uint32_t len : s.pieces) {
    cp_end += len;
    out.word_ends.push_back(s.text_off[cp_end]);
  }
  return Status();
}

}  // namespace d2o
