// Sampler: turns a row of logits into the next token.
//
// Order (as common engines apply them): repetition penalty over the last tokens, then greedy when
// temperature <= 0; else top-k, temperature, top-p, min-p, and a draw from the remaining
// distribution with a seeded generator (same seed and inputs, same tokens, on every platform).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "d2o/status.h"

namespace d2o {

struct SamplerParams {
  float temperature = 0.0f;     // <= 0: greedy
  int top_k = 40;               // <= 0: off
  float top_p = 0.95f;          // >= 1: off
  float min_p = 0.05f;          // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off; > 1 discourages repeating recent tokens
  int repeat_last_n = 64;       // how many recent tokens the penalty looks at
  uint64_t seed = 0;

  // Errors for values outside their ranges.
  Status validate() const;
};

// A token's log-probability under a row of logits and the most likely tokens': log-softmax of the
// raw logits (before any penalty or temperature), the log-sum-exp accumulated in double.
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // most likely first (ties: lower id first)
};

// The most alternatives log_probs() returns.
inline constexpr int kMaxTopLogprobs = 20;

// Fills `out` for `token` (0 <= token < n_vocab) and the top_n (0..kMaxTopLogprobs) most likely
// tokens of the row: one pass for the maximum, one for the sum, one partial selection of top_n
// (a heap of top_n entries, so O(n_vocab log top_n)). The token's value and an alternative's
// are computed alike, so the same token gets the same float in both.
void log_probs(const float* logits, int n_vocab, int32_t token, int top_n, TokenLogprob& out);

class Sampler {
 public:
  Sampler(const SamplerParams& params, int n_vocab);

  // history: the tokens so far (prompt and generated), for the repetition penalty.
  int32_t sample(const float* logits, std::span<const int32_t> history);

  const SamplerParams& params() const { return params_; }

  // The random generator's state. A scheduler sampling many requests keeps one Sampler (one
  // workspace of n_vocab floats and candidates, instead of one per request) and switches it
  // between requests with set_stream(); each request's draws are then exactly those of a
  // Sampler of its own.
  uint64_t rng_state() const { return rng_state_; }
  static uint64_t initial_rng_state(uint64_t seed) { return seed ^ 0x9E3779B97F4A7C15ull; }
  void set_stream(const SamplerParams& params, uint64_t rng_state) {
    params_ = params;
    rng_state_ = rng_state;
  }

 private:
  double next_uniform();  // in [0, 1)

  SamplerParams params_;
  int n_vocab_;
  uint64_t rng_state_;
  struct Cand {
    int32_t id;
    float logit;
    float p;
  };
  std::vector<Cand> cands_;
  std::vector<float> work_;
};

}  // namespace d2o
