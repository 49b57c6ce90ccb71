#include "eval/perplexity.h"

#include <algorithm>
#include <cmath>

namespace d2o {

double PerplexityResult::ppl() const { return n_scored ? std::exp(nll_sum / static_cast<double>(n_scored)) : 0.0; }

double log_prob(const float* logits, int n, TokenId target) {
  float m = logits[0];
  for (int i = 1; i < n; ++i) m = std::max(m, logits[i]);
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(logits[i]) - m);
  return static_cast<double>(logits[target]) - m - std::log(s);
}

Result<PerplexityResult> perplexity(Engine& engine, std::span<const TokenId> tokens, const PerplexityParams& p,
                                    const std::function<void(int, double)>& progress) {
  if (p.n_ctx < 16) return invalid_argument("perplexity context must be at least 16 tokens");
  const int64_t n_chunks_avail = static_cast<int64_t>(tokens.size()) / p.n_ctx;
  if (n_chunks_avail < 1) {
    return invalid_argument("the text has " + std::to_string(tokens.size()) + " tokens, fewer than one context of " +
                            std::to_string(p.n_ctx) + "; use a longer text or a smaller -c");
  }
  const int n_chunks = static_cast<int>(p.max_chunks > 0 ? std::min<int64_t>(p.max_chunks, n_chunks_avail) : n_chunks_avail);
  const ModelHParams& hp = engine.model().hparams();
  const int first = p.n_ctx / 2;
  PerplexityResult res;
  double sum_sq = 0.0;
  std::vector<TokenId> chunk(static_cast<size_t>(p.n_ctx));
  for (int c = 0; c < n_chunks; ++c) {
    const size_t start = static_cast<size_t>(c) * static_cast<size_t>(p.n_ctx);
    std::copy(tokens.begin() + static_cast<ptrdiff_t>(start), tokens.begin() + static_cast<ptrdiff_t>(start + p.n_ctx),
              chunk.begin());
    if (p.add_bos && p.bos >= 0) chunk[0] = p.bos;
    Sequence seq(hp, p.kv_type, nullptr);
    BatchEntry be;
    be.seq = &seq;
    be.tokens = chunk;
    be.logits_from = first;
    // Logits at position j predict token j + 1; score j in [first, n_ctx - 1).
    Status s = engine.forward({&be, 1}, [&](int, int j, const float* logits) {
      if (j < first || j >= p.n_ctx - 1) return;
      const double nll = -log_prob(logits, hp.n_vocab, tokens[start + static_cast<size_t>(j) + 1]);
      res.nll_sum += nll;
      sum_sq += nll * nll;
      ++res.n_scored;
    });
    D2O_RETURN_IF_ERROR(s);
    res.n_chunks = c + 1;
    res.chunk_ppl.push_back(res.ppl());
    if (progress) progress(c, res.ppl());
  }
  const double n = static_cast<double>(res.n_scored);
  const double mean = res.nll_sum / n;
  res.stderr_nll = n > 1 ? std::sqrt(std::max(0.0, sum_sq / n - mean * mean) / (n - 1)) : 0.0;
  return res;
}

}  // namespace d2o
