// Small vocabularies written with GgufWriter, for the tokenizer fuzz targets and their seeds.
//
// Merges are learned (textbook BPE: most frequent adjacent pair first) from a few lines of text
// that mix ASCII words, digits, punctuation, runs of spaces and multi-byte characters, so the
// fuzzers reach real merges of every kind without a vocabulary file from outside.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gguf/gguf_writer.h"
#include "runtime/pretokenizer.h"
#include "runtime/unicode.h"

namespace d2o::fuzz {

inline const char* kTrainingText =
    "the quick brown fox jumps over the lazy dog, then the dog sleeps.\n"
    "In 2024 there were 1234567 tokens; they're all here   and there!\n"
    "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 "
    "\xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 it's   we've  I'm\t\ttab\r\n"
    "for (int i = 0; i < n; ++i) { x += y[i] * 2; }\n";

// Splits UTF-8 text into characters (invalid bytes as single bytes).
inline std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = unicode::utf8_len_from_lead(static_cast<uint8_t>(s[i]));
    if (n == 0 || i + n > s.size()) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// The training text with its spaces written as U+2581 (SentencePiece and Gemma 4).
inline std::string training_text_escaped() {
  std::string escaped;
  for (char c : std::string(kTrainingText)) {
    escaped += c == ' ' ? "\xE2\x96\x81" : std::string(1, c);
  }
  return escaped;
}

// Learns up to n_merges merges over the given symbol sequence; returns the merged pairs in order.
inline std::vector<std::pair<std::string, std::string>> learn_merges(std::vector<std::string> sym,
                                                                     int n_merges) {
  std::vector<std::pair<std::string, std::string>> merges;
  for (int k = 0; k < n_merges; ++k) {
    std::map<std::pair<std::string, std::string>, int> count;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      if (sym[i] == "\n" || sym[i + 1] == "\n") continue;  // words do not cross lines
      ++count[{sym[i], sym[i + 1]}];
    }
    std::pair<std::string, std::string> best;
    int best_n = 1;
    for (const auto& [p, n] : count) {
      if (n > best_n) best = p, best_n = n;
    }
    if (best_n < 2) break;
    merges.push_back(best);
    std::vector<std::string> next;
    for (size_t i = 0; i < sym.size(); ++i) {
      if (i + 1 < sym.size() && sym[i] == best.first && sym[i + 1] == best.second) {
        next.push_back(sym[i] + sym[i + 1]);
        ++i;
      } else {
        next.push_back(sym[i]);
      }
    }
    sym = std::move(next);
  }
  return merges;
}

// Byte-level BPE ("gpt2") with the named pre-tokenizer: the 256 byte characters, learned merges,
// three control tokens and one user-defined token.
inline GgufWriter bpe_vocab_writer(const std::string& pre) {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  const auto& b2c = unicode::byte_to_chars();
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(b2c[b]);
    types.push_back(1);
  }
  std::vector<std::string> sym;
  for (unsigned char c : std::string(kTrainingText)) sym.push_back(c == '\n' ? "\n" : b2c[c]);
  std::vector<std::string> merges;
  for (const auto& [a, b] : learn_merges(sym, 120)) {
    merges.push_back(a + " " + b);
    tokens.push_back(a + b);
    types.push_back(1);
  }
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    tokens.push_back(s);
    types.push_back(3);  // CONTROL
  }
  tokens.push_back("<tool>");
  types.push_back(4);  // USER_DEFINED
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", pre);
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merges);
  const uint32_t eot = static_cast<uint32_t>(tokens.size()) - 4;
  w.add_u32("tokenizer.ggml.bos_token_id", eot);
  w.add_u32("tokenizer.ggml.eos_token_id", eot);
  return w;
}

// SentencePiece BPE ("llama"): <unk>, <s>, </s>, the 256 <0xNN> byte tokens, the characters of
// the training text and learned merges, scored so that earlier merges win.
inline GgufWriter spm_vocab_writer() {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    tokens.push_back(name);
    types.push_back(6);  // BYTE
    scores.push_back(0);
  }
  std::vector<std::string> sym = utf8_chars(training_text_escaped());
  std::map<std::string, int> seen;
  for (const std::string& c : sym) {
    if (c == "\n" || seen.count(c)) continue;
    seen[c] = 1;
    tokens.push_back(c);
    types.push_back(1);
    scores.push_back(-1000);
  }
  float score = 0;
  for (const auto& [a, b] : learn_merges(sym, 120)) {
    if (seen.count(a + b)) continue;
    seen[a + b] = 1;
    tokens.push_back(a + b);
    types.push_back(1);
    scores.push_back(score -= 1);
  }
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_f32_array("tokenizer.ggml.scores", scores);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_u32("tokenizer.ggml.unknown_token_id", 0);
  return w;
}

// Gemma 4's BPE ("gemma4"): <pad>, <eos>, <bos>, <unk>, the 256 <0xNN> byte tokens, newline
// runs, the characters of the training text (spaces as U+2581) and merges learned over it.
inline GgufWriter gemma4_vocab_writer() {
  std::vector<std::string> tokens = {"<pad>", "<eos>", "<bos>", "<unk>"};
  std::vector<int32_t> types = {3, 3, 3, 2};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    tokens.push_back(name);
    types.push_back(6);  // BYTE
  }
  std::vector<std::string> sym = utf8_chars(training_text_escaped());
  std::map<std::string, int> seen = {{"\n", 1}, {"\n\n", 1}};
  tokens.insert(tokens.end(), {"\n", "\n\n"});
  types.insert(types.end(), {1, 1});
  for (const std::string& c : sym) {
    if (seen.count(c)) continue;
    seen[c] = 1;
    tokens.push_back(c);
    types.push_back(1);
  }
  std::vector<std::string> merges;
  for (const auto& [a, b] : learn_merges(sym, 120)) {
    merges.push_back(a + " " + b);
    if (seen.count(a + b)) continue;
    seen[a + b] = 1;
    tokens.push_back(a + b);
    types.push_back(1);
  }
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "gemma4");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merges);
  w.add_u32("tokenizer.ggml.bos_token_id", 2);
  w.add_u32("tokenizer.ggml.eos_token_id", 1);
  w.add_u32("tokenizer.ggml.unknown_token_id", 3);
  w.add_u32("tokenizer.ggml.padding_token_id", 0);
  w.add_bool("tokenizer.ggml.add_space_prefix", false);
  return w;
}

// Every vocabulary the tokenizer fuzzer uses: one BPE per pre-tokenizer name, then the SPM one,
// then Gemma 4's.
inline std::vector<std::pair<std::string, std::vector<uint8_t>>> all_vocabs() {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
  for (const std::string& pre : PreTokenizer::supported_names()) {
    out.emplace_back("bpe-" + pre, bpe_vocab_writer(pre).to_bytes());
  }
  out.emplace_back("spm", spm_vocab_writer().to_bytes());
  out.emplace_back("gemma4", gemma4_vocab_writer().to_bytes());
  return out;
}

}  // namespace d2o::fuzz
