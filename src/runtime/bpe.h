// Merge algorithms of the two vocabulary kinds, applied to one piece of text at a time.
//
// Byte-level BPE (GPT-2 style): a pre-tokenized word is written as byte characters, then the
// adjacent pair with the lowest merge rank (ties: leftmost) is merged until no pair has a rank.
// Gemma 4's BPE merges the same way but starts from the word's UTF-8 characters (spaces already
// written as U+2581) and falls back to <0xNN> byte tokens.
// SentencePiece BPE: the text (spaces already written as U+2581) starts as UTF-8 characters and
// the adjacent pair whose concatenation is the token with the highest score (ties: leftmost) is
// merged until no pair forms a token; what is left over falls back to <0xNN> byte tokens.
// Both use a priority queue over a linked list of symbols, O(n log n) in the piece length, with
// stale queue entries skipped when popped, as llama.cpp does, so the merge order is the same.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"
#include "runtime/vocab.h"

namespace d2o {

// Reusable buffers for one thread's encoding (avoids allocating per word).
struct MergeScratch {
  std::vector<int32_t> sym;    // BPE: symbol id of each symbol
  std::vector<int32_t> len;    // byte length of each symbol, 0 once merged into its left
  std::vector<int32_t> start;  // first byte of each symbol in the piece
  std::vector<int32_t> prev;   // linked list of live symbols, -1 at the ends
  std::vector<int32_t> next;
  // A queued pair of adjacent symbols. `order` packs (priority, left symbol) so that one integer
  // comparison gives the merge order: the smallest priority first, then the leftmost pair.
  // `len` is the pair's byte length when queued: since symbols only grow, a pair whose two
  // symbols are alive and still add up to `len` has not changed (otherwise it is stale).
  struct Pair {
    uint64_t order;
    int32_t right;
    int32_t len;
  };
  std::vector<Pair> heap;
  std::string encoded;  // BPE: the word as byte characters
  // Words already merged during this encode call -> their range in word_tokens.
  std::unordered_map<std::string, std::pair<size_t, size_t>, StringHash, std::equal_to<>>
      word_cache;
  std::vector<TokenId> word_tokens;
};

class BpeMerges {
 public:
  // Reads tokenizer.ggml.merges ("left right" per line, rank = position).
  static Result<BpeMerges> build(const Vocab& vocab, const GgufFile& file);

  size_t n_merges() const { return rules_.size(); }
  // Appends the tokens of one word (raw bytes, before byte-character encoding; for a vocabulary
  // without byte encoding, UTF-8 text with U+2581 for spaces).
  void encode_word(const Vocab& vocab, std::string_view word, MergeScratch& s,
                   std::vector<TokenId>& out) const;
  // Same, remembering words in s.word_cache (natural text repeats most words).
  void encode_word_cached(const Vocab& vocab, std::string_view word, MergeScratch& s,
                          std::vector<TokenId>& out) const;

 private:
  struct Rule {
    int32_t rank;
    int32_t result;  // symbol id of the merged text
  };
  // Symbol ids: token ids for texts in the vocabulary, n_vocab + k for merge pieces that are
  // not tokens (their text is extra_text_[k]).
  int32_t symbol_of(const Vocab& vocab, std::string_view text) const;
  int32_t intern(const Vocab& vocab, std::string_view text);
  static uint64_t key(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }
  // Fills s.sym / s.len / s.start with the word's initial symbols; returns their count.
  size_t init_symbols(const Vocab& vocab, std::string_view word, MergeScratch& s) const;
  void emit(const Vocab& vocab, std::string_view word, const MergeScratch& s, int32_t i,
            std::vector<TokenId>& out) const;

  std::vector<std::string> extra_text_;
  TokenMap extra_ids_;
  std::array<int32_t, 256> byte_symbol_{};
  std::unordered_map<uint64_t, Rule> rules_;
};

// SentencePiece BPE over `text` (already escaped: spaces as U+2581, prefix space added).
void spm_encode(const Vocab& vocab, std::string_view text, MergeScratch& s,
                std::vector<TokenId>& out);

}  // namespace d2o
