// Vocab: a tokenizer's data as read from GGUF metadata (tokenizer.ggml.*), validated.
//
// Holds the token strings, scores and attributes, the special token ids and the flags that decide
// how text is encoded and decoded. Loading reproduces llama.cpp's conventions, including its
// fix-ups for converters that mark special tokens wrongly: tokens whose text is a known
// end-of-turn marker ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", ...) become CONTROL and
// end-of-generation, the FIM/EOT/EOM ids are found by text when the metadata lacks them, and
// Phi-3 special tokens strip the whitespace to their right.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"

namespace d2o {

using TokenId = int32_t;

// Token attributes (bit flags), as llama.cpp derives them from tokenizer.ggml.token_type.
enum TokenAttr : uint32_t {
  kAttrUndefined = 0,
  kAttrUnknown = 1u << 0,
  kAttrUnused = 1u << 1,
  kAttrNormal = 1u << 2,
  kAttrControl = 1u << 3,
  kAttrUserDefined = 1u << 4,
  kAttrByte = 1u << 5,
  kAttrLstrip = 1u << 7,  // parse_special: swallow whitespace to the left of the token
  kAttrRstrip = 1u << 8,  // ... and to the right
};

enum class VocabType {
  kBpe,  // tokenizer.ggml.model = "gpt2": byte-level BPE with merges; "gemma4": BPE over UTF-8
  kSpm,  // tokenizer.ggml.model = "llama": SentencePiece BPE with scores
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>>;

struct Vocab {
  VocabType type = VocabType::kBpe;
  std::string model;      // tokenizer.ggml.model
  std::string pre;        // tokenizer.ggml.pre ("default" when absent, "gemma4" for Gemma 4)
  std::string gguf_name;  // general.name (Phi-3 detection)

  std::vector<std::string> text;  // [n_vocab] raw vocabulary strings
  std::vector<float> score;       // [n_vocab] SPM merge priority (0 when absent)
  std::vector<uint32_t> attr;     // [n_vocab] TokenAttr bits
  TokenMap text_to_id;            // a text listed twice maps to its last id, as in llama.cpp

  TokenId bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, sep = -1, pad = -1, mask = -1;
  TokenId fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;

  bool add_bos = false;
  bool add_eos = false;
  bool add_space_prefix = false;  // SPM: a space is put before the text (and removed by decode)
  bool clean_spaces = false;      // decode removes the space in " ,", " .", " 's", ...
  bool ignore_merges = false;     // BPE: a word that is a token is taken whole
  // BPE: true for GPT-2 byte characters; false (Gemma 4) for UTF-8 characters with U+2581 for
  // spaces, where <0xNN> byte tokens stand for what no token covers.
  bool byte_encode = true;
  // SPM: characters c such that some token contains c followed by U+2581 (c != U+2581). A merge
  // can cross the start of a run of spaces only after such a character, so valid UTF-8 text can be
  // merged word by word elsewhere (see spm_encode). Gemma: {">"}; Llama 2: none.
  bool spm_words_independent = false;  // false: the set is unknown or too large to bother
  std::vector<std::string> spm_space_glue;

  std::vector<uint8_t> is_eog;          // [n_vocab] end-of-generation flags
  std::vector<TokenId> special_tokens;  // CONTROL / USER_DEFINED / UNKNOWN, longest text first
  std::vector<std::string> piece;       // [n_vocab] output bytes of each token (special rendered)

  int32_t n_vocab() const { return static_cast<int32_t>(text.size()); }
  TokenId find(std::string_view s) const {
    auto it = text_to_id.find(s);
    return it == text_to_id.end() ? -1 : it->second;
  }
};

// Reads and validates the vocabulary. `pre_traits_*` are the pre-tokenizer's defaults for the
// flags (BPE only); the caller resolves the pre-tokenizer name first.
struct VocabDefaults {
  bool add_bos = false;
  bool clean_spaces = true;
  bool ignore_merges = false;
  bool byte_encode = true;
};
// Errors: kNotFound (no tokenizer metadata), kUnsupported (tokenizer model), kFormatError
// (malformed arrays, wrong types, sizes).
Result<std::string> read_tokenizer_model(const GgufFile& file);
Result<Vocab> load_vocab(const GgufFile& file, const VocabDefaults& defaults);

}  // namespace d2o
