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
// Qwen3.5: Qwen2's pattern with combining marks (\p{M}) kept inside words.
constexpr const char* kQwen35 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|)"
    R"(\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kDigit = R"(\p{N})";
constexpr const char* kDigits = R"(\p{N}+)";
constexpr const char* kDefaultPunct = R"([\p{P}\$\+<=>\^~\|]+)";
constexpr const char* kFalconPunct = R"([\p{P}\$\+<=>\^~\|`]+)";
constexpr const char* kThreeAsciiDigits = R"([0-9][0-9][0-9])";
// DeepSeek (LLM and Coder). The letter class is the set of cased letters that DeepSeek LLM's
// tokenizer names explicitly (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, Glagolitic,
// Coptic, Deseret, Osage, Old Hungarian, Warang Citi, Adlam and the fullwidth Latin forms);
// the CJK class covers U+0800-U+9FA5 and the Hangul syllables and Jamo.
constexpr const char* kLineBreak = "[\\r\\n]";
constexpr const char* kDeepseekLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})"
    R"(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A})"
    R"(\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556})"
    R"(\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF})"
    R"(\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D})"
    R"(\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4})"
    R"(\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4})"
    R"(\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124})"
    R"(\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F})"
    R"(\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4})"
    R"(\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F})"
    R"(\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17})"
    R"(\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3})"
    R"(\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF})"
    R"(\x{1E900}-\x{1E943}]+)";
// ASCII punctuation and letters (!-/ and :-~), their fullwidth forms, curly quotes and the CJK
// full stop and comma.
constexpr const char* kDeepseekPunct =
    R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)";
constexpr const char* kTrailingSpaces = R"(\s+\z)";
constexpr const char* kCjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";
constexpr const char* kSpaceLetters = R"(\s?\p{L}+)";
constexpr const char* kSpacePunct = R"(\s?\p{P}+)";
// Gemma 4: no word split; only runs of newlines are cut from the rest (BPE then merges whole
// lines, see BpeMerges).
constexpr const char* kNewlineRuns = R"([^\n]+|\n+)";

struct Spec {
  const char* name;
  std::vector<const char*> regexes;
  PreTokenizerTraits traits;
};

// Gemma 4 (tokenizer model "gemma4", not a tokenizer.ggml.pre name of byte-level BPE).
const Spec& gemma4_spec() {
  static const Spec kSpec{"gemma4", {kNewlineRuns}, {false, true, true, false}};
  return kSpec;
}

// Names are those of llama.cpp's converter (tokenizer.ggml.pre); a family shares regexes and
// flags. Flags: {ignore_merges, add_bos default, clean_spaces, byte_encode}.
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
    add({"qwen35"}, {kQwen35}, {false, false, false});
    add({"falcon"}, {kFalconPunct, kGpt2, kThreeAsciiDigits}, {false, false, true});
    add({"deepseek-llm"},
        {kLineBreak, kDeepseekLetters, kDeepseekPunct, kTrailingSpaces, kCjk, kDigits},
        {false, false, false});
    add({"deepseek-coder"}, {kLineBreak, kSpaceLetters, kSpacePunct, kCjk, kDigit},
        {false, false, false});
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

// What the regexes of one kind see (see the file comment): the text re-encoded with stand-ins
// (regexes that name Unicode classes) or with its own code points, non-ASCII whitespace written
// as U+000B (regexes that name characters), plus the maps between code points and bytes.
struct RegexSubject {
  bool built = false;
  std::string bytes;
  std::vector<uint32_t> off;    // [n+1] byte offset of each code point
  std::vector<uint32_t> to_cp;  // [bytes.size()+1] code point index at a character boundary
};

void build_subject(const std::vector<uint32_t>& cps, bool classes, RegexSubject& s) {
  const size_t n = cps.size();
  s.bytes.clear();
  s.bytes.reserve(2 * n);
  s.off.resize(n + 1);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t cp = cps[i];
    s.off[i] = static_cast<uint32_t>(s.bytes.size());
    if (cp < 0x80) {
      s.bytes.push_back(static_cast<char>(cp));
    } else if (classes) {
      unicode::append_utf8(stand_in(unicode::char_class(cp)), s.bytes);
    } else if (unicode::is_whitespace(cp)) {
      s.bytes.push_back('\x0B');
    } else {
      // A surrogate (accepted by the lenient decoder) is no valid UTF-8 for PCRE2; U+FFFD is
      // in none of the character classes named here either.
      const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
      unicode::append_utf8(surrogate ? unicode::kReplacementChar : cp, s.bytes);
    }
  }
  s.off[n] = static_cast<uint32_t>(s.bytes.size());
  s.to_cp.assign(s.bytes.size() + 1, 0);
  for (size_t i = 0; i <= n; ++i) s.to_cp[s.off[i]] = static_cast<uint32_t>(i);
  s.built = true;
}

// PCRE2 match state for one split() call: a match context whose JIT stack may grow large and
// whose step limit is lifted (backtracking over a long whitespace run in \s*[\r\n]+ costs steps
// in proportion to the run, and long inputs must never be refused).
class MatchState {
 public:
  MatchState()
      : mctx_(pcre2_match_context_create(nullptr)),
        jstack_(pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr)) {
    if (mctx_ && jstack_) pcre2_jit_stack_assign(mctx_, nullptr, jstack_);
    if (mctx_) pcre2_set_match_limit(mctx_, 0xFFFFFFFFu);
  }
  ~MatchState() {
    if (md_) pcre2_match_data_free(md_);
    if (jstack_) pcre2_jit_stack_free(jstack_);
    if (mctx_) pcre2_match_context_free(mctx_);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;

  void use(const pcre2_code* code) {
    if (md_) pcre2_match_data_free(md_);
    md_ = pcre2_match_data_create_from_pattern(code, nullptr);
    D2O_ASSERT(md_ != nullptr);
  }
  pcre2_match_data* data() const { return md_; }
  pcre2_match_context* context() const { return mctx_; }

 private:
  pcre2_match_context* mctx_ = nullptr;
  pcre2_jit_stack* jstack_ = nullptr;
  pcre2_match_data* md_ = nullptr;
};

Status regex_failure(int rc) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof(msg));
  return resource_exhausted("pre-tokenizer regex failed: " +
                            std::string(reinterpret_cast<char*>(msg)));
}

// Splits one piece, code points [start, start + len), into matches of `code` and the gaps between
// them; appends the resulting lengths (in code points) to `next`.
Status split_piece(const pcre2_code* code, const RegexSubject& subj, uint32_t start, uint32_t len,
                   MatchState& ms, std::vector<uint32_t>& next) {
  const uint32_t b0 = subj.off[start];
  const uint32_t b1 = subj.off[start + len];
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subj.bytes.data() + b0);
  const PCRE2_SIZE text_len = b1 - b0;
  auto cp_at = [&](PCRE2_SIZE b) { return subj.to_cp[b0 + b]; };
  PCRE2_SIZE pos = 0;   // search position, bytes from b0
  PCRE2_SIZE done = 0;  // end of the last emitted piece, bytes from b0
  while (pos < text_len) {
    const int rc =
        pcre2_match(code, text, text_len, pos, PCRE2_NO_UTF_CHECK, ms.data(), ms.context());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return regex_failure(rc);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.data());
    const PCRE2_SIZE m0 = ov[0], m1 = ov[1];
    if (m1 == m0) {
      // An empty match yields no word; step over one character and search again.
      pos = m0 + unicode::utf8_len_from_lead(static_cast<uint8_t>(text[m0]));
      continue;
    }
    if (m0 > done) next.push_back(cp_at(m0) - cp_at(done));
    next.push_back(cp_at(m1) - cp_at(m0));
    done = pos = m1;
  }
  if (done < text_len) next.push_back(cp_at(text_len) - cp_at(done));
  return Status();
}

}  // namespace

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool classes = false;  // names Unicode classes (\p{...}): matched against stand-ins
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
  return compile(spec->name, spec->regexes, spec->traits);
}

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::create_gemma4() {
  const Spec& spec = gemma4_spec();
  return compile(spec.name, spec.regexes, spec.traits);
}

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::compile(std::string_view name,
                                                            const std::vector<const char*>& regexes,
                                                            const PreTokenizerTraits& traits) {
  std::unique_ptr<PreTokenizer> pt(new PreTokenizer());
  pt->name_ = name;
  pt->traits_ = traits;
  for (const char* pattern : regexes) {
    auto rx = std::make_unique<Regex>();
    // As in llama.cpp, a regex that names a Unicode class runs on the class stand-ins, with
    // Unicode semantics for \s and the classes; one that names characters runs on the code
    // points themselves, where \s is ASCII whitespace (other whitespace arrives as U+000B).
    rx->classes = std::string_view(pattern).find("\\p{") != std::string_view::npos;
    const uint32_t options = PCRE2_UTF | (rx->classes ? PCRE2_UCP : 0);
    int err = 0;
    PCRE2_SIZE err_off = 0;
    rx->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, options,
                             &err, &err_off, nullptr);
    if (!rx->code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return internal_error("pre-tokenizer regex does not compile: " +
                            std::string(reinterpret_cast<char*>(msg)));
    }
    pcre2_jit_compile(rx->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter
    pt->regexes_.push_back(std::move(rx));
  }
  return pt;
}

Status PreTokenizer::split(std::string_view input, PreTokenized& out) const {
  std::vector<uint32_t> cps;
  unicode::decode_utf8_lenient(input, cps);
  const size_t n = cps.size();

  // The re-encoded text and the byte offset of each code point in it.
  std::vector<uint32_t> text_off(n + 1);
  out.text.clear();
  out.text.reserve(input.size());
  for (size_t i = 0; i < n; ++i) {
    text_off[i] = static_cast<uint32_t>(out.text.size());
    unicode::append_utf8(cps[i], out.text);
  }
  text_off[n] = static_cast<uint32_t>(out.text.size());

  // Pieces, as lengths in code points; each regex splits every piece into matches and gaps.
  std::vector<uint32_t> pieces, next;
  if (n > 0) pieces.push_back(static_cast<uint32_t>(n));
  RegexSubject subjects[2];  // [0]: code points, [1]: class stand-ins
  MatchState ms;
  for (const auto& rx : regexes_) {
    RegexSubject& subj = subjects[rx->classes ? 1 : 0];
    if (!subj.built) build_subject(cps, rx->classes, subj);
    ms.use(rx->code);
    next.clear();
    uint32_t start = 0;  // code point index of the current piece
    for (uint32_t len : pieces) {
      D2O_RETURN_IF_ERROR(split_piece(rx->code, subj, start, len, ms, next));
      start += len;
    }
    pieces.swap(next);
  }

  out.word_ends.clear();
  out.word_ends.reserve(pieces.size());
  uint32_t cp_end = 0;
  for (uint32_t len : pieces) {
    cp_end += len;
    out.word_ends.push_back(text_off[cp_end]);
  }
  return Status();
}

}  // namespace d2o
