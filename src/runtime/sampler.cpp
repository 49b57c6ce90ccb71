#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace d2o {

Status SamplerParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f || temperature > 100.0f) {
    return invalid_argument("temperature must be in [0, 100] (0 = greedy)");
  }
  if (top_k < 0) return invalid_argument("top-k must be >= 0 (0 = off)");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return invalid_argument("top-p must be in (0, 1]");
  if (!(min_p >= 0.0f && min_p < 1.0f)) return invalid_argument("min-p must be in [0, 1)");
  if (!(repeat_penalty > 0.0f && repeat_penalty <= 10.0f)) {
    return invalid_argument("repeat penalty must be in (0, 10] (1 = off)");
  }
  if (repeat_last_n < 0) return invalid_argument("repeat-last-n must be >= 0");
  return {};
}

Sampler::Sampler(const SamplerParams& params, int n_vocab)
    : params_(params), n_vocab_(n_vocab), rng_state_(initial_rng_state(params.seed)) {
  cands_.reserve(static_cast<size_t>(n_vocab));
  work_.resize(static_cast<size_t>(n_vocab));
}

double Sampler::next_uniform() {
  // splitmix64: tiny, fast, and identical everywhere (unlike std:: distributions).
  uint64_t z = (rng_state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

namespace {

// Index of the first maximum (what std::max_element returns), with 16 independent running maxima
// so the compiler can keep them in vector registers: a batch of greedy requests samples one row
// of n_vocab logits each per step.
int32_t argmax_first(const float* x, int n) {
  constexpr int kLanes = 16;
  float m = x[0];
  int i = 0;
  if (n >= kLanes) {
    float lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = x[l];
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lane[l] = x[i + l] > lane[l] ? x[i + l] : lane[l];
    }
    for (int l = 0; l < kLanes; ++l) m = lane[l] > m ? lane[l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (int j = 0; j < n; ++j) {
    if (x[j] == m) return j;
  }
  return static_cast<int32_t>(std::max_element(x, x + n) - x);  // NaN logits: as before
}

}  // namespace

int32_t Sampler::sample(const float* logits, std::span<const int32_t> history) {
  const bool penalty =
      params_.repeat_penalty != 1.0f && params_.repeat_last_n > 0 && !history.empty();
  if (params_.temperature <= 0.0f && !penalty) return argmax_first(logits, n_vocab_);
  float* l = work_.data();
  std::copy(logits, logits + n_vocab_, l);

  // Repetition penalty (each distinct recent token once): shrink positive logits, grow negative.
  if (penalty) {
    const size_t n = std::min(history.size(), static_cast<size_t>(params_.repeat_last_n));
    for (size_t i = history.size() - n; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t < 0 || t >= n_vocab_) continue;
      bool seen = false;
      for (size_t k = history.size() - n; k < i; ++k) seen = seen || history[k] == t;
      if (seen) continue;
      l[t] = l[t] > 0 ? l[t] / params_.repeat_penalty : l[t] * params_.repeat_penalty;
    }
  }

  if (params_.temperature <= 0.0f) return argmax_first(l, n_vocab_);

  cands_.clear();
  for (int32_t i = 0; i < n_vocab_; ++i) cands_.push_back({i, l[i], 0.0f});
  auto by_logit = [](const Cand& a, const Cand& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  size_t n = cands_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < n) {
    n = static_cast<size_t>(params_.top_k);
    std::partial_sort(cands_.begin(), cands_.begin() + static_cast<ptrdiff_t>(n), cands_.end(), by_logit);
  } else {
    std::sort(cands_.begin(), cands_.end(), by_logit);
  }
  // Softmax with temperature over the n best.
  const float m = cands_[0].logit;
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cands_[i].p = std::exp((cands_[i].logit - m) / params_.temperature);
    sum += cands_[i].p;
  }
  for (size_t i = 0; i < n; ++i) cands_[i].p = static_cast<float>(cands_[i].p / sum);
  // Top-p: smallest prefix with mass >= top_p.
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += cands_[i].p;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
  }
  // Min-p: drop tokens below min_p times the best probability.
  if (params_.min_p > 0.0f) {
    const float thr = params_.min_p * cands_[0].p;
    size_t keep = 1;
    while (keep < n && cands_[keep].p >= thr) ++keep;
    n = keep;
  }
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) total += cands_[i].p;
  double r = next_uniform() * total;
  for (size_t i = 0; i < n; ++i) {
    r -= cands_[i].p;
    if (r < 0.0) return cands_[i].id;
  }
  return cands_[n - 1].id;
}

void log_probs(const float* logits, int n_vocab, int32_t token, int top_n, TokenLogprob& out) {
  out.token = token;
  out.top.clear();
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n_vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  if (std::isfinite(mx)) {
    for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  }
  const double lse = static_cast<double>(mx) + std::log(sum);
  auto lp = [&](int32_t id) { return static_cast<float>(static_cast<double>(logits[id]) - lse); };
  out.logprob = lp(token);
  top_n = std::clamp(top_n, 0, std::min(kMaxTopLogprobs, n_vocab));
  if (top_n == 0) return;
  // A min-heap of the best top_n seen: its front is the weakest (lowest logit, then highest id).
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int32_t heap[kMaxTopLogprobs];
  int n = 0;
  for (int32_t i = 0; i < n_vocab; ++i) {
    if (n < top_n) {
      heap[n++] = i;
      std::push_heap(heap, heap + n, better);
    } else if (better(i, heap[0])) {
      std::pop_heap(heap, heap + n, better);
      heap[n - 1] = i;
      std::push_heap(heap, heap + n, better);
    }
  }
  std::sort_heap(heap, heap + n, better);  // most likely first
  out.top.reserve(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) out.top.emplace_back(heap[k], lp(heap[k]));
}

}  // namespace d2o
