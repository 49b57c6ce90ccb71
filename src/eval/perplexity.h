// Perplexity with the common chunked protocol: split the token stream into chunks of n_ctx
// tokens, run each chunk from an empty cache, and score only the second half of each chunk (every
// scored token has at least n_ctx/2 tokens of context). With add_bos, each chunk's first token is
// replaced by BOS. This is the protocol of llama.cpp's perplexity tool, so figures compare directly.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "d2o/status.h"
#include "runtime/engine.h"

namespace d2o {

struct PerplexityParams {
  int n_ctx = 2048;
  int max_chunks = 0;      // 0: all
  bool add_bos = false;
  TokenId bos = -1;
  KvType kv_type = KvType::kF16;
};

struct PerplexityResult {
  int n_chunks = 0;
  int64_t n_scored = 0;
  double nll_sum = 0;            // natural log
  std::vector<double> chunk_ppl; // running estimate after each chunk
  double ppl() const;
  double stderr_nll = 0;         // standard error of the mean NLL
};

// log-softmax probability of `target` in `logits` (n values), computed in double.
double log_prob(const float* logits, int n, TokenId target);

Result<PerplexityResult> perplexity(Engine& engine, std::span<const TokenId> tokens, const PerplexityParams& p,
                                    const std::function<void(int chunk, double running_ppl)>& progress);

}  // namespace d2o
