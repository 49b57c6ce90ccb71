// Pre-tokenizers of byte-level BPE vocabularies: split text into words before BPE merges.
//
// A GGUF names its pre-tokenizer in `tokenizer.ggml.pre` ("smollm", "llama-bpe", "qwen2",
// "gpt-2", "default", ...). Each is a list of regexes applied in turn, as llama.cpp does: the
// first splits the whole text into matches and the gaps between them, each later regex splits
// every piece again, never across piece boundaries (lookaheads see a piece's end as the end of
// the text). The regexes run on PCRE2 (UTF + UCP, JIT when available).
//
// Exactness: llama.cpp classifies code points with its own Unicode 15.1 tables. So that the
// PCRE2 build's Unicode version does not matter, a regex that names Unicode classes (\p{L},
// \p{N}, ...) never sees non-ASCII text: every non-ASCII code point is replaced by a stand-in of
// the same class (a letter by U+00AA, a number by U+00B2, whitespace by U+00A0, ...; see
// unicode.h) before matching, and matches are mapped back to the original text. A regex that
// names characters instead (DeepSeek's letter and CJK ranges) sees the code points themselves,
// with \s meaning ASCII whitespace and every other whitespace character written as U+000B, as
// llama.cpp's std::wregex path does. ASCII is matched as is in both.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"

namespace d2o {

// Behaviour flags that llama.cpp ties to the pre-tokenizer name.
struct PreTokenizerTraits {
  bool ignore_merges = false;  // a word that is itself a token is emitted whole (Llama 3)
  bool add_bos = false;        // default for tokenizer.ggml.add_bos_token when absent
  bool clean_spaces = true;    // detokenizer removes " ," " ." ... (clean_up_tokenization_spaces)
  // true: words are merged as GPT-2 byte characters; false (Gemma 4): as UTF-8 characters, with
  // spaces written as U+2581 before splitting and <0xNN> byte tokens for what no token covers.
  bool byte_encode = true;
};

// Result of splitting: `text` is the input re-encoded from its decoded code points (equal to
// the input when that is valid UTF-8; invalid bytes become U+FFFD), cut into words that end at
// the byte offsets `word_ends` (increasing, the last one is text.size()).
struct PreTokenized {
  std::string text;
  std::vector<uint32_t> word_ends;
};

class PreTokenizer {
 public:
  // Errors: kUnsupported for a name this build does not know (the message lists the known ones).
  static Result<std::unique_ptr<PreTokenizer>> create(std::string_view name);
  // Names accepted by create(), for messages and tests.
  static std::vector<std::string> supported_names();
  // Gemma 4's (tokenizer model "gemma4"): runs of newlines and the text between them, no other
  // split, words not byte-encoded (traits().byte_encode is false).
  static Result<std::unique_ptr<PreTokenizer>> create_gemma4();

  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  const std::string& name() const { return name_; }
  const PreTokenizerTraits& traits() const { return traits_; }
  // Thread-safe (const, per-call scratch). Errors: kResourceExhausted if the regex engine
  // gives up (it has no match limit here, so only on memory exhaustion).
  Status split(std::string_view input, PreTokenized& out) const;

 private:
  struct Regex;
  PreTokenizer() = default;
  static Result<std::unique_ptr<PreTokenizer>> compile(std::string_view name,
                                                       const std::vector<const char*>& regexes,
                                                       const PreTokenizerTraits& traits);

  std::string name_;
  PreTokenizerTraits traits_;
  std::vector<std::unique_ptr<Regex>> regexes_;
};

}  // namespace d2o
