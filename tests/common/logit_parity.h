// Logit parity helpers shared by the model tests: run a token sequence through the engine and
// compare its log-probabilities with a reference's top-k (llama.cpp's, written by
// scripts/gen_reference_fixtures.py and scripts/gen_gemma3_reference.py).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "common/reference.h"
#include "runtime/engine.h"

namespace d2o::test {

// Runs `tokens` as one chunk on a fresh full-cache sequence and returns all logits.
inline std::vector<float> all_logits(Engine& engine, const std::vector<int32_t>& tokens) {
  const int n_vocab = engine.model().hparams().n_vocab;
  std::vector<float> out(tokens.size() * static_cast<size_t>(n_vocab));
  // F32 cache, as the references were computed (scripts/gen_reference_fixtures.py).
  Sequence seq(engine.model().hparams(), KvType::kF32, nullptr);
  BatchEntry be;
  be.seq = &seq;
  be.tokens = tokens;
  be.logits_from = 0;
  Status s = engine.forward({&be, 1}, [&](int, int t, const float* l) {
    std::copy(l, l + n_vocab, out.begin() + static_cast<ptrdiff_t>(t) * n_vocab);
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

// The same fed in passes of `chunk` tokens (1: token by token), as a prompt prefilled in chunks
// and then decoded; sliding-window layers drop what no later query can see between passes.
inline std::vector<float> all_logits_chunked(Engine& engine, const std::vector<int32_t>& tokens,
                                      size_t chunk) {
  const int n_vocab = engine.model().hparams().n_vocab;
  std::vector<float> out(tokens.size() * static_cast<size_t>(n_vocab));
  Sequence seq(engine.model().hparams(), KvType::kF32, nullptr);
  for (size_t at = 0; at < tokens.size(); at += chunk) {
    BatchEntry be;
    be.seq = &seq;
    be.tokens = std::span<const int32_t>(tokens).subspan(at, std::min(chunk, tokens.size() - at));
    be.logits_from = 0;
    Status s = engine.forward({&be, 1}, [&](int, int t, const float* l) {
      std::copy(l, l + n_vocab, out.begin() + static_cast<ptrdiff_t>(at + static_cast<size_t>(t)) * n_vocab);
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  return out;
}

inline void log_softmax(const float* x, int n, std::vector<double>* out) {
  out->resize(static_cast<size_t>(n));
  const double m = *std::max_element(x, x + n);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(x[i] - m);
  const double lse = m + std::log(s);
  for (int i = 0; i < n; ++i) (*out)[static_cast<size_t>(i)] = x[i] - lse;
}

struct ParityStats {
  double kl = 0;      // mean bucketed KL(reference || d2o)
  double top1 = 0;    // top-1 agreement
};

// Runs every reference prompt through d2o and compares with the reference's top-k log-probs.
// KL(reference || d2o) is summed over the reference's top-k tokens plus one bucket for the rest
// (a slightly coarser measure than the full sum, never larger than it); the generating script
// computes llama.cpp's own spreads with exactly this formula.
inline ParityStats compare(Engine& engine, const ReferenceLogits& ref, const char* label) {
  const int n_vocab = static_cast<int>(ref.n_vocab);
  int64_t agree = 0, total = 0;
  double kl_sum = 0;
  std::vector<double> lq;
  for (uint32_t p = 0; p < ref.n_prompts; ++p) {
    const auto logits = all_logits(engine, ref.tokens[p]);
    int64_t agree_p = 0;
    double kl_p = 0;
    for (uint32_t t = 0; t < ref.n_pos; ++t) {
      const float* row = logits.data() + static_cast<size_t>(t) * n_vocab;
      log_softmax(row, n_vocab, &lq);
      const TopK& top = ref.top[p][t];
      const int argmax = static_cast<int>(std::max_element(row, row + n_vocab) - row);
      agree_p += static_cast<uint32_t>(argmax) == top.id[0];
      double kl = 0, p_top = 0, q_top = 0;
      for (uint32_t i = 0; i < ref.k; ++i) {
        const double lp = top.logp[i];
        const double lqi = lq[top.id[i]];
        kl += std::exp(lp) * (lp - lqi);
        p_top += std::exp(lp);
        q_top += std::exp(lqi);
      }
      const double p_rest = std::max(1e-12, 1.0 - p_top), q_rest = std::max(1e-12, 1.0 - q_top);
      kl += p_rest * std::log(p_rest / q_rest);
      kl_p += kl;
    }
    std::printf("%s, prompt %u: top-1 agreement %.2f%%, mean KL %.3e\n", label, p, 100.0 * agree_p / ref.n_pos,
                kl_p / ref.n_pos);
    agree += agree_p;
    kl_sum += kl_p;
    total += ref.n_pos;
  }
  ParityStats st{kl_sum / static_cast<double>(total), static_cast<double>(agree) / static_cast<double>(total)};
  std::printf("%s: top-1 agreement %.2f%%, mean KL %.3e over %lld positions\n", label, 100 * st.top1, st.kl,
              static_cast<long long>(total));
  return st;
}

inline double json_number(const std::string& json, const std::string& object, const std::string& key) {
  const size_t at = json.find("\"" + object + "\"");
  const size_t k = json.find("\"" + key + "\":", at);
  return std::stod(json.substr(k + key.size() + 3));
}

}  // namespace d2o::test
