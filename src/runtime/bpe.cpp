#include "runtime/bpe.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "runtime/unicode.h"

namespace d2o {
namespace {

struct PairAfter {  // min-heap order
  bool operator()(const MergeScratch::Pair& a, const MergeScratch::Pair& b) const {
    return a.order > b.order;
  }
};
// priority: BPE merge rank, or SPM minus the score's order key; both fit in int32.
void heap_push(std::vector<MergeScratch::Pair>& h, int32_t priority, int32_t left, int32_t right,
               int32_t len) {
  const uint64_t order =
      (static_cast<uint64_t>(static_cast<uint32_t>(priority) ^ 0x80000000u) << 32) |
      static_cast<uint32_t>(left);
  h.push_back({order, right, len});
  std::push_heap(h.begin(), h.end(), PairAfter());
}
MergeScratch::Pair heap_pop(std::vector<MergeScratch::Pair>& h) {
  std::pop_heap(h.begin(), h.end(), PairAfter());
  MergeScratch::Pair p = h.back();
  h.pop_back();
  return p;
}
int32_t pair_left(const MergeScratch::Pair& p) {
  return static_cast<int32_t>(p.order & 0xFFFFFFFF);
}

// Integer with the order of the float (-0 == +0): the SentencePiece score as a heap priority.
int32_t score_key(float score) {
  int32_t bits;
  static_assert(sizeof(bits) == sizeof(score));
  std::memcpy(&bits, &score, sizeof(bits));
  return bits >= 0 ? bits
                   : static_cast<int32_t>(std::numeric_limits<int32_t>::min() - int64_t{bits});
}

// The byte token "<0xNN>" of byte b (SentencePiece and Gemma 4 byte fallback), or -1.
TokenId hex_byte_token(const Vocab& vocab, uint8_t b) {
  static const char* kHex = "0123456789ABCDEF";
  const char name[6] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
  return vocab.find(std::string_view(name, 6));
}

void link_symbols(MergeScratch& s, size_t n) {
  s.prev.resize(n);
  s.next.resize(n);
  for (size_t i = 0; i < n; ++i) {
    s.prev[i] = static_cast<int32_t>(i) - 1;
    s.next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
}

// Merges the right symbol of a pair into the left one.
void unlink_right(MergeScratch& s, int32_t left, int32_t right) {
  s.next[left] = s.next[right];
  if (s.next[right] >= 0) s.prev[s.next[right]] = left;
}

}  // namespace

int32_t BpeMerges::symbol_of(const Vocab& vocab, std::string_view text) const {
  const TokenId id = vocab.find(text);
  if (id >= 0) return id;
  auto it = extra_ids_.find(text);
  return it == extra_ids_.end() ? -1 : it->second;
}

int32_t BpeMerges::intern(const Vocab& vocab, std::string_view text) {
  const int32_t id = symbol_of(vocab, text);
  if (id >= 0) return id;
  const int32_t sid = vocab.n_vocab() + static_cast<int32_t>(extra_text_.size());
  extra_text_.emplace_back(text);
  extra_ids_.emplace(std::string(text), sid);
  return sid;
}

Result<BpeMerges> BpeMerges::build(const Vocab& vocab, const GgufFile& file) {
  const GgufValue* mv = file.find("tokenizer.ggml.merges");
  if (!mv) return not_found("byte-level BPE vocabulary without tokenizer.ggml.merges");
  if (mv->type != GgufType::kArray || mv->array_type != GgufType::kString) {
    return format_error("tokenizer.ggml.merges should be an array of strings");
  }
  if (mv->strings.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2)) {
    return format_error("tokenizer.ggml.merges has too many entries");
  }
  BpeMerges m;
  m.rules_.reserve(mv->strings.size());
  std::string joined;  // reused: no allocation per rule
  for (size_t rank = 0; rank < mv->strings.size(); ++rank) {
    const std::string_view line = mv->strings[rank];
    // "left right", split at the first space after the first byte (a piece may start with
    // one). Lines without a separator cannot apply to any pair and are skipped.
    const size_t sp = line.find(' ', 1);
    if (sp == std::string_view::npos || sp + 1 == line.size()) continue;
    const std::string_view left = line.substr(0, sp);
    const std::string_view right = line.substr(sp + 1);
    joined.assign(left);
    joined.append(right);
    const int32_t l = m.intern(vocab, left);
    const int32_t r = m.intern(vocab, right);
    const int32_t res = m.intern(vocab, joined);
    m.rules_.emplace(key(l, r), Rule{static_cast<int32_t>(rank), res});  // first rank wins
  }
  const auto& chars = unicode::byte_to_chars();
  for (int b = 0; b < 256; ++b) m.byte_symbol_[b] = m.symbol_of(vocab, chars[b]);
  return m;
}

void BpeMerges::emit(const Vocab& vocab, std::string_view word, const MergeScratch& s, int32_t i,
                     std::vector<TokenId>& out) const {
  const int32_t sym = s.sym[i];
  if (sym >= 0 && sym < vocab.n_vocab()) {
    out.push_back(sym);
    return;
  }
  // Not a token. Byte-level BPE: llama.cpp looks up each byte of the symbol's byte-character text
  // as a one-byte token and drops those that are not tokens either. UTF-8 BPE: each byte of the
  // symbol's text becomes its <0xNN> token (dropped when the vocabulary lacks it).
  std::string_view text;
  if (sym >= 0) {
    text = extra_text_[static_cast<size_t>(sym - vocab.n_vocab())];
  } else if (vocab.byte_encode) {
    text = unicode::byte_to_chars()[static_cast<uint8_t>(word[s.start[i]])];
  } else {
    text = word.substr(static_cast<size_t>(s.start[i]), static_cast<size_t>(s.len[i]));
  }
  for (char c : text) {
    const TokenId id = vocab.byte_encode ? vocab.find(std::string_view(&c, 1))
                                         : hex_byte_token(vocab, static_cast<uint8_t>(c));
    if (id >= 0) out.push_back(id);
  }
}

size_t BpeMerges::init_symbols(const Vocab& vocab, std::string_view word, MergeScratch& s) const {
  s.sym.clear();
  s.len.clear();
  s.start.clear();
  for (size_t off = 0; off < word.size();) {
    size_t len = 1;
    int32_t sym;
    if (vocab.byte_encode) {
      sym = byte_symbol_[static_cast<uint8_t>(word[off])];
    } else {
      // A UTF-8 character by its lead byte, as llama.cpp cuts them (not validated).
      len =
          std::min(unicode::utf8_len_from_lead(static_cast<uint8_t>(word[off])), word.size() - off);
      sym = symbol_of(vocab, word.substr(off, len));
    }
    s.sym.push_back(sym);
    s.len.push_back(static_cast<int32_t>(len));
    s.start.push_back(static_cast<int32_t>(off));
    off += len;
  }
  return s.sym.size();
}

void BpeMerges::encode_word(const Vocab& vocab, std::string_view word, MergeScratch& s,
                            std::vector<TokenId>& out) const {
  if (word.empty()) return;
  if (vocab.ignore_merges) {
    s.encoded.clear();
    const auto& chars = unicode::byte_to_chars();
    for (char c : word) s.encoded += chars[static_cast<uint8_t>(c)];
    const TokenId id = vocab.find(s.encoded);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (!vocab.byte_encode && word.find_first_not_of('\n') == std::string_view::npos) {
    // Gemma 4: a run of newlines that is a token is taken whole (its merges do not build them).
    if (const TokenId id = vocab.find(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const size_t n = init_symbols(vocab, word, s);
  link_symbols(s, n);
  s.heap.clear();
  auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || s.sym[l] < 0 || s.sym[r] < 0) return;
    auto it = rules_.find(key(s.sym[l], s.sym[r]));
    if (it == rules_.end()) return;
    heap_push(s.heap, it->second.rank, l, r, s.len[l] + s.len[r]);
  };
  for (size_t i = 1; i < n; ++i) try_pair(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));
  while (!s.heap.empty()) {
    const MergeScratch::Pair p = heap_pop(s.heap);
    const int32_t l = pair_left(p);
    // Stale entry: one side was merged away or has grown since the pair was queued.
    if (s.len[l] == 0 || s.len[p.right] == 0 || s.len[l] + s.len[p.right] != p.len) continue;
    s.sym[l] = rules_.find(key(s.sym[l], s.sym[p.right]))->second.result;
    s.len[l] = p.len;
    s.len[p.right] = 0;
    unlink_right(s, l, p.right);
    try_pair(s.prev[l], l);
    try_pair(l, s.next[l]);
  }
  for (int32_t i = 0; i >= 0; i = s.next[i]) emit(vocab, word, s, i, out);
}

namespace {

bool valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const unicode::Utf8Step st = unicode::utf8_scan(text.substr(i));
    if (!st.valid) return false;
    i += st.length;
  }
  return true;
}

// One run of the SentencePiece merge over `text`.
void spm_merge(const Vocab& vocab, std::string_view text, MergeScratch& s,
               std::vector<TokenId>& out) {
  // Symbols are UTF-8 characters by their lead byte (llama.cpp does not validate them).
  s.start.clear();
  s.len.clear();
  for (size_t off = 0; off < text.size();) {
    const size_t len =
        std::min(unicode::utf8_len_from_lead(static_cast<uint8_t>(text[off])), text.size() - off);
    s.start.push_back(static_cast<int32_t>(off));
    s.len.push_back(static_cast<int32_t>(len));
    off += len;
  }
  const size_t n = s.start.size();
  if (n == 0) return;
  link_symbols(s, n);
  s.heap.clear();
  auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const int32_t len = s.len[l] + s.len[r];
    const TokenId id = vocab.find(text.substr(static_cast<size_t>(s.start[l]), len));
    if (id < 0) return;
    heap_push(s.heap, -score_key(vocab.score[id]), l, r, len);  // highest score first
  };
  for (size_t i = 1; i < n; ++i) try_pair(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));
  while (!s.heap.empty()) {
    const MergeScratch::Pair p = heap_pop(s.heap);
    const int32_t l = pair_left(p);
    if (s.len[l] == 0 || s.len[p.right] == 0 || s.len[l] + s.len[p.right] != p.len) continue;
    s.len[l] = p.len;
    s.len[p.right] = 0;
    unlink_right(s, l, p.right);
    try_pair(s.prev[l], l);
    try_pair(l, s.next[l]);
  }
  for (int32_t i = 0; i >= 0; i = s.next[i]) {
    const std::string_view piece = text.substr(static_cast<size_t>(s.start[i]), s.len[i]);
    const TokenId id = vocab.find(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // Byte fallback: <0xNN>, else the byte itself as a token, else <unk>.
    for (char c : piece) {
      TokenId t = hex_byte_token(vocab, static_cast<uint8_t>(c));
      if (t < 0) t = vocab.find(std::string_view(&c, 1));
      if (t < 0) t = vocab.unk;
      if (t >= 0) out.push_back(t);
    }
  }
}

}  // namespace

void BpeMerges::encode_word_cached(const Vocab& vocab, std::string_view word, MergeScratch& s,
                                   std::vector<TokenId>& out) const {
  if (word.size() > 64) {  // long words are rare and costly to key
    encode_word(vocab, word, s, out);
    return;
  }
  auto it = s.word_cache.find(word);
  if (it == s.word_cache.end()) {
    if (s.word_cache.size() > (size_t{1} << 16)) {  // bound the memory of the cache
      s.word_cache.clear();
      s.word_tokens.clear();
    }
    const size_t b = s.word_tokens.size();
    encode_word(vocab, word, s, s.word_tokens);
    it = s.word_cache.emplace(std::string(word), std::make_pair(b, s.word_tokens.size())).first;
  }
  out.insert(out.end(), s.word_tokens.begin() + static_cast<ptrdiff_t>(it->second.first),
             s.word_tokens.begin() + static_cast<ptrdiff_t>(it->second.second));
}

void spm_encode(const Vocab& vocab, std::string_view text, MergeScratch& s,
                std::vector<TokenId>& out) {
  if (!vocab.spm_words_independent || !valid_utf8(text)) {
    spm_merge(vocab, text, s, out);
    return;
  }
  // Merges cannot cross the start of a run of U+2581 (see Vocab::spm_words_independent): merge
  // each word (a run of spaces and what follows up to the next run) on its own, which gives the
  // same tokens, and reuse the result for repeated words.
  const std::string_view space = "\xE2\x96\x81";
  size_t begin = 0;
  auto flush = [&](size_t end) {
    const std::string_view word = text.substr(begin, end - begin);
    auto it = s.word_cache.find(word);
    if (it == s.word_cache.end()) {
      if (s.word_cache.size() > (size_t{1} << 16)) {  // bound the memory of the cache
        s.word_cache.clear();
        s.word_tokens.clear();
      }
      const size_t b = s.word_tokens.size();
      spm_merge(vocab, word, s, s.word_tokens);
      it = s.word_cache.emplace(std::string(word), std::make_pair(b, s.word_tokens.size())).first;
    }
    out.insert(out.end(), s.word_tokens.begin() + static_cast<ptrdiff_t>(it->second.first),
               s.word_tokens.begin() + static_cast<ptrdiff_t>(it->second.second));
    begin = end;
  };
  for (size_t q = text.find(space, 1); q != std::string_view::npos; q = text.find(space, q + 3)) {
    if (q >= 3 && text.substr(q - 3, 3) == space) continue;  // inside a run of spaces
    size_t c = q - 1;  // start of the character before the run
    while (c > 0 && (static_cast<uint8_t>(text[c]) & 0xC0) == 0x80) --c;
    const std::string_view prev = text.substr(c, q - c);
    if (std::find(vocab.spm_space_glue.begin(), vocab.spm_space_glue.end(), prev) ==
        vocab.spm_space_glue.end()) {
      flush(q);
    }
  }
  flush(text.size());
}

}  // namespace d2o
