#include "model/moe.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <span>

#include "core/assert.h"
#include "core/timer.h"
#include "ops/matmul.h"
#include "ops/ops.h"

namespace d2o {

namespace {

// llama.cpp clamps the sum of the chosen probabilities to the smallest normal half (2^-14)
// before dividing by it.
constexpr float kMinWeightSum = 6.103515625e-5f;

// One row's routing: the softmax of its router logits p[0, ne) (in place), the k most probable
// experts (ties: the lower index) into choice, most probable first, and their probabilities
// renormalised to sum 1 into weight. p is overwritten.
void moe_route_row(float* p, int ne, int k, int* choice, float* weight) {
  float mx = p[0];
  for (int e = 1; e < ne; ++e) mx = std::max(mx, p[e]);
  double sum = 0.0;
  for (int e = 0; e < ne; ++e) {
    p[e] = std::exp(p[e] - mx);
    sum += p[e];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int e = 0; e < ne; ++e) p[e] *= inv;
  float chosen = 0.0f;
  for (int j = 0; j < k; ++j) {
    int best = 0;
    for (int e = 1; e < ne; ++e)
      if (p[e] > p[best]) best = e;
    choice[j] = best;
    weight[j] = p[best];
    chosen += p[best];
    p[best] = -1.0f;  // taken (probabilities are >= 0)
  }
  const float denom = std::max(chosen, kMinWeightSum);
  for (int j = 0; j < k; ++j) weight[j] /= denom;
}

}  // namespace

void MoeFfn::ensure(const ModelHParams& h, int max_rows) {
  k_ = h.n_expert_used;
  offset_.resize(static_cast<size_t>(h.n_expert) + 1);
  cursor_.resize(static_cast<size_t>(h.n_expert));
  if (max_rows <= rows_cap_) return;
  const size_t n = static_cast<size_t>(max_rows);
  const size_t nk = n * static_cast<size_t>(k_);
  probs_.resize(n * static_cast<size_t>(h.n_expert));
  choice_.resize(nk);
  weight_.resize(nk);
  slot_.resize(nk);
  slot_row_.resize(nk);
  xg_.resize(nk * static_cast<size_t>(h.n_embd));
  gate_.resize(nk * static_cast<size_t>(h.n_ff_exp));
  up_.resize(nk * static_cast<size_t>(h.n_ff_exp));
  rows_cap_ = max_rows;
}

void MoeFfn::run(const ModelHParams& h, const MoeWeights& w, float* xn, int n, ThreadPool& pool,
                 ForwardTimings& t) {
  D2O_ASSERT(n <= rows_cap_ && k_ == h.n_expert_used);
  route(h, w, xn, n, pool, t);
  group(h, xn, n, pool);
  run_experts(h, w, pool, t);
  combine(h, xn, n, pool);
}

// probs_ = the router's logits of every row, then each row's choice and weights.
void MoeFfn::route(const ModelHParams& h, const MoeWeights& w, const float* xn, int n,
                   ThreadPool& pool, ForwardTimings& t) {
  const int ne = h.n_expert;
  Stopwatch s;
  matmul(w.router, xn, n, probs_.data(), pool);  // [n, n_expert]
  t.matmul_s += s.seconds();
  pool.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      moe_route_row(probs_.data() + r * ne, ne, k_, choice_.data() + r * k_,
                    weight_.data() + r * k_);
    }
  });
}

// The (row, rank) pairs sorted by expert (a counting sort, rows in order within an expert), and
// each pair's input row copied to its slot of xg_.
void MoeFfn::group(const ModelHParams& h, const float* xn, int n, ThreadPool& pool) {
  const int nk = n * k_;
  std::fill(offset_.begin(), offset_.end(), 0);
  for (int a = 0; a < nk; ++a) ++offset_[static_cast<size_t>(choice_[a]) + 1];
  for (int e = 0; e < h.n_expert; ++e) offset_[e + 1] += offset_[e];
  std::copy(offset_.begin(), offset_.end() - 1, cursor_.begin());
  for (int a = 0; a < nk; ++a) {
    const int s = cursor_[static_cast<size_t>(choice_[a])]++;
    slot_[a] = s;
    slot_row_[s] = a / k_;
  }
  const int n_embd = h.n_embd;
  pool.parallel_for(nk, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t s = b; s < end; ++s) {
      const float* src = xn + static_cast<int64_t>(slot_row_[s]) * n_embd;
      std::copy(src, src + n_embd, xg_.data() + s * n_embd);
    }
  });
}

// Every chosen expert on its rows: gate and up, SwiGLU, down (into its slots of xg_). Experts
// with the same number of rows share one parallel region (in a decode step, all of them).
void MoeFfn::run_experts(const ModelHParams& h, const MoeWeights& w, ThreadPool& pool,
                         ForwardTimings& t) {
  const int n_embd = h.n_embd, n_ff = h.n_ff_exp;
  constexpr int kMaxGroup = 8;  // two products per expert, matmul_many takes at most 16
  auto rows_of = [&](int e) { return offset_[e + 1] - offset_[e]; };
  std::array<MatmulCall, 2 * kMaxGroup> calls;
  int e = 0;
  while (e < h.n_expert) {
    const int m = rows_of(e);
    if (m == 0) {
      ++e;
      continue;
    }
    int ids[kMaxGroup];
    int g = 0;
    for (; e < h.n_expert && g < kMaxGroup; ++e) {
      const int me = rows_of(e);
      if (me == 0) continue;
      if (me != m) break;
      ids[g++] = e;
    }
    for (int i = 0; i < g; ++i) {
      const ExpertWeights& x = w.experts[static_cast<size_t>(ids[i])];
      const int64_t s0 = offset_[ids[i]];
      calls[2 * i] = {&x.gate, xg_.data() + s0 * n_embd, gate_.data() + s0 * n_ff};
      calls[2 * i + 1] = {&x.up, xg_.data() + s0 * n_embd, up_.data() + s0 * n_ff};
    }
    Stopwatch s;
    matmul_many(std::span<const MatmulCall>(calls.data(), 2 * g), m, pool);
    t.matmul_s += s.seconds();
    // The group's slots are contiguous (the experts between them have none).
    const int64_t first = offset_[ids[0]], count = offset_[ids[g - 1] + 1] - first;
    pool.parallel_for(count, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = first + b; r < first + end; ++r)
        swiglu(gate_.data() + r * n_ff, up_.data() + r * n_ff, n_ff, gate_.data() + r * n_ff);
    });
    for (int i = 0; i < g; ++i) {
      const int64_t s0 = offset_[ids[i]];
      calls[i] = {&w.experts[static_cast<size_t>(ids[i])].down, gate_.data() + s0 * n_ff,
                  xg_.data() + s0 * n_embd};
    }
    s.reset();
    matmul_many(std::span<const MatmulCall>(calls.data(), g), m, pool);
    t.matmul_s += s.seconds();
  }
}

// xn[r] = sum over row r's experts, in the order chosen, of weight * the expert's output.
void MoeFfn::combine(const ModelHParams& h, float* xn, int n, ThreadPool& pool) {
  const int n_embd = h.n_embd;
  pool.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      float* out = xn + r * n_embd;
      for (int j = 0; j < k_; ++j) {
        const float* y = xg_.data() + static_cast<int64_t>(slot_[r * k_ + j]) * n_embd;
        const float wj = weight_[r * k_ + j];
        if (j == 0) {
          for (int i = 0; i < n_embd; ++i) out[i] = wj * y[i];
        } else {
          for (int i = 0; i < n_embd; ++i) out[i] += wj * y[i];
        }
      }
    }
  });
}

}  // namespace d2o
