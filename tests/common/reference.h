// Readers for the llama.cpp reference files written by scripts/gen_reference_fixtures.py (into
// <cache>/test-data/reference by scripts/setup.sh --test-data, or by the parity tests).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/test_util.h"

namespace d2o::test {

struct TopK {
  std::vector<uint32_t> id;  // [k], most probable first
  std::vector<float> logp;   // [k]
};

struct ReferenceLogits {
  uint32_t n_prompts = 0, n_pos = 0, k = 0, n_vocab = 0;
  std::vector<std::vector<int32_t>> tokens;  // [prompt][pos]
  std::vector<std::vector<TopK>> top;        // [prompt][pos]
};

inline bool read_reference_logits(const std::string& path, ReferenceLogits* r) {
  const std::string b = read_file(path);
  if (b.size() < 20 || b.compare(0, 4, "D2OL") != 0) return false;
  size_t at = 4;
  auto u32 = [&]() {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    at += 4;
    return v;
  };
  r->n_prompts = u32();
  r->n_pos = u32();
  r->k = u32();
  r->n_vocab = u32();
  // Top-k ids are uint16, or uint32 when the vocabulary has more than 65536 tokens (Gemma 3).
  const size_t id_bytes = r->n_vocab > 65536 ? 4 : 2;
  const size_t need = at + size_t{r->n_prompts} * r->n_pos * 4 +
                      size_t{r->n_prompts} * r->n_pos * r->k * (id_bytes + 4);
  if (b.size() != need) return false;
  r->tokens.assign(r->n_prompts, std::vector<int32_t>(r->n_pos));
  for (auto& t : r->tokens) {
    std::memcpy(t.data(), b.data() + at, 4 * t.size());
    at += 4 * t.size();
  }
  r->top.assign(r->n_prompts, std::vector<TopK>(r->n_pos));
  for (auto& prompt : r->top) {
    for (TopK& t : prompt) {
      t.id.resize(r->k);
      t.logp.resize(r->k);
      for (uint32_t i = 0; i < r->k; ++i) {
        if (id_bytes == 4) {
          std::memcpy(&t.id[i], b.data() + at + 4 * i, 4);
        } else {
          uint16_t v;
          std::memcpy(&v, b.data() + at + 2 * i, 2);
          t.id[i] = v;
        }
      }
      at += id_bytes * r->k;
      std::memcpy(t.logp.data(), b.data() + at, 4 * r->k);
      at += 4 * r->k;
    }
  }
  return true;
}

struct ReferenceFullLogits {
  std::vector<int32_t> tokens;
  uint32_t n_vocab = 0;
  std::vector<float> logits;  // [tokens, n_vocab]
};

inline bool read_reference_full_logits(const std::string& path, ReferenceFullLogits* r) {
  const std::string b = read_file(path);
  if (b.size() < 12 || b.compare(0, 4, "D2OR") != 0) return false;
  uint32_t n, v;
  std::memcpy(&n, b.data() + 4, 4);
  std::memcpy(&v, b.data() + 8, 4);
  if (b.size() != 12 + size_t{n} * 4 + size_t{n} * v * 4) return false;
  r->n_vocab = v;
  r->tokens.resize(n);
  std::memcpy(r->tokens.data(), b.data() + 12, 4 * size_t{n});
  r->logits.resize(size_t{n} * v);
  std::memcpy(r->logits.data(), b.data() + 12 + 4 * size_t{n}, 4 * r->logits.size());
  return true;
}

}  // namespace d2o::test
