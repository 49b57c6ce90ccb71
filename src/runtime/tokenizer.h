// Tokenizer: text <-> token ids for the vocabulary stored in a GGUF file, exact against llama.cpp.
//
// Supports the two vocabulary kinds of LLM GGUFs:
//  - byte-level BPE (tokenizer.ggml.model = "gpt2"; SmolLM2, Llama 3, Qwen2, GPT-2, ...), with
//    the pre-tokenizer named by tokenizer.ggml.pre (see pretokenizer.h for the list);
//  - SentencePiece BPE (tokenizer.ggml.model = "llama"; Llama 2, Mistral, Phi-3), with scores,
//    U+2581 for spaces, a prefix space and <0xNN> byte fallback;
//  - Gemma 4's BPE (tokenizer.ggml.model = "gemma4"): ranked merges like byte-level BPE, but over
//    UTF-8 characters with U+2581 for spaces, lines merged whole and <0xNN> byte fallback.
// Other tokenizer models (WordPiece, Unigram, ...) are refused at load time, by name.
// Token ids, pieces and decoded text are those of llama.cpp's llama_tokenize /
// llama_token_to_piece / llama_detokenize (tests compare against its output). Text that is not
// valid UTF-8 is tokenized as llama.cpp does: for BPE each undecodable byte becomes U+FFFD.
//
// All methods are const and thread-safe once the tokenizer is built.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"

namespace d2o {

using TokenId = int32_t;

struct EncodeOptions {
  bool add_special = true;     // add BOS/EOS as the GGUF metadata says (add_bos_token ...)
  bool parse_special = false;  // text like "<|im_start|>" becomes that special/control token
};

class PreTokenizer;
class BpeMerges;
struct Vocab;

class Tokenizer {
 public:
  // Errors: kNotFound (no tokenizer metadata in the file), kUnsupported (tokenizer model or
  // pre-tokenizer this build does not know; the message lists the supported ones),
  // kFormatError (malformed tokenizer metadata).
  static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& file);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Roughly linear in the text length (a 1 MB text takes a fraction of a second).
  // Errors: kInvalidArgument for a text over 1 GiB.
  Result<std::vector<TokenId>> encode(std::string_view text, const EncodeOptions& opts) const;

  // Bytes of one token as it appears in output text (byte-level BPE decoded, SentencePiece
  // U+2581 -> space, <0xNN> byte tokens -> that byte; special/control tokens -> "" unless
  // render_special). A piece may be part of a UTF-8 character. Out-of-range ids: kInvalidArgument.
  Result<std::string> token_to_piece(TokenId id, bool render_special) const;
  // The pieces joined, then as llama_detokenize (with remove_special = false): SentencePiece
  // vocabularies drop the leading space of the first piece (the prefix space encode adds), and
  // vocabularies with clean_up_tokenization_spaces (GPT-2, Llama 3) drop the space before
  // ? ! . , 's 'm 're 've and around a lone '. Out-of-range ids: kInvalidArgument.
  Result<std::string> decode(const std::vector<TokenId>& ids, bool render_special) const;

  int32_t n_vocab() const;
  TokenId bos() const;  // -1 when absent
  TokenId eos() const;  // -1 when absent
  TokenId eot() const;  // end of turn (<|im_end|>, <|eot_id|>, <end_of_turn>, ...), -1 when absent
  // End of generation: EOS, EOT, EOM and the end-of-turn markers a vocabulary has
  // (<|im_end|>, <|eot_id|>, <end_of_turn>, <|endoftext|>, </s>, ...). False for invalid ids.
  bool is_eog(TokenId id) const;
  std::vector<TokenId> eog_tokens() const;
  // CONTROL token (rendered as "" unless render_special). False for invalid ids.
  bool is_control(TokenId id) const;
  bool add_bos() const;
  bool add_eos() const;
  // Raw vocabulary string; an empty string for an out-of-range id.
  const std::string& token_text(TokenId id) const;
  std::optional<TokenId> find_token(std::string_view text) const;

  const std::string& model() const;          // "gpt2", "llama" or "gemma4"
  const std::string& pre_tokenizer() const;  // tokenizer.ggml.pre ("" for SentencePiece)

 private:
  Tokenizer();
  struct Fragment {
    TokenId token;  // -1: raw text [offset, offset + length)
    size_t offset;
    size_t length;
  };
  // Splits out special tokens (user-defined ones always, control ones with parse_special),
  // longest first, as llama.cpp's tokenizer_st_partition.
  std::vector<Fragment> partition(std::string_view text, bool parse_special) const;

  std::unique_ptr<Vocab> vocab_;
  std::unique_ptr<PreTokenizer> pre_;  // BPE only
  std::unique_ptr<BpeMerges> merges_;  // BPE only
  std::string empty_;
};

// Streams decoded text without ever splitting a UTF-8 character: push() returns only complete
// characters; flush() returns what is left at the end (invalid bytes as U+FFFD). The text is
// the concatenated token pieces (no leading-space removal or space clean-up, unlike decode()),
// always valid UTF-8: byte sequences that cannot become a character are replaced by U+FFFD as
// soon as that is certain. An invalid token id yields U+FFFD.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool render_special = false);
  std::string push(TokenId id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool render_special_;
  std::string pending_;  // bytes of an incomplete character
};

}  // namespace d2o
