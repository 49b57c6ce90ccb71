#include "model/delta_net.h"

#include <cmath>

#include "core/assert.h"
#include "core/timer.h"
#include "ops/matmul.h"
#include "ops/ops.h"

namespace d2o {

namespace {

float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
// log(1 + e^x), linear above 20 as the reference computes it.
float softplus(float x) {
  return x > 20.0f ? x : std::log(1.0f + std::exp(x));
}

// x / sqrt(sum x^2 + eps) over n values, in place (the sum in double, as an RMSNorm with eps / n
// scaled by 1 / sqrt(n), the reference's formulation).
void l2_normalize(float* x, int n, float eps) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float fn = static_cast<float>(n);
  const float mean = static_cast<float>(sum / n);
  const float scale = 1.0f / std::sqrt(mean + eps / fn) / std::sqrt(fn);
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

}  // namespace

void DeltaNet::ensure(const ModelHParams& h, int max_rows) {
  if (max_rows <= rows_cap_) return;
  const size_t n = static_cast<size_t>(max_rows);
  mixed_.resize(n * static_cast<size_t>(h.ssm_conv_dim()));
  conv_.resize(n * static_cast<size_t>(h.ssm_conv_dim()));
  z_.resize(n * static_cast<size_t>(h.ssm_value_dim()));
  out_.resize(n * static_cast<size_t>(h.ssm_value_dim()));
  beta_.resize(n * static_cast<size_t>(h.ssm_n_v_head));
  gate_.resize(n * static_cast<size_t>(h.ssm_n_v_head));
  rows_cap_ = max_rows;
}

// conv_ rows of s = silu of each channel's kernel over [the conv state, mixed_ rows of s]; the
// state becomes the last d_conv - 1 inputs.
void DeltaNet::convolve(const ModelHParams& h, const DeltaNetWeights& w, const SeqRows& s,
                        float* state, ThreadPool& pool) {
  const int K = h.ssm_d_conv, cd = h.ssm_conv_dim(), n = s.r1 - s.r0;
  const float* mixed = mixed_.data() + static_cast<size_t>(s.r0) * cd;
  float* out = conv_.data() + static_cast<size_t>(s.r0) * cd;
  // Input p of the extended sequence: the state's rows first, then the pass's rows.
  auto input = [&](int p, int c) {
    return p < K - 1 ? state[static_cast<size_t>(p) * cd + c]
                     : mixed[static_cast<size_t>(p - (K - 1)) * cd + c];
  };
  pool.parallel_for(cd, 64, [&](int64_t c0, int64_t c1, int) {
    for (int c = static_cast<int>(c0); c < static_cast<int>(c1); ++c) {
      const float* kern = w.conv.data() + static_cast<size_t>(c) * K;  // [d_conv]
      for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int i = 0; i < K; ++i) sum += input(t + i, c) * kern[i];
        out[static_cast<size_t>(t) * cd + c] = silu(sum);
      }
      // The new state: inputs [n, n + K - 1) (in place: each read lies at or after its write).
      for (int j = 0; j < K - 1; ++j) state[static_cast<size_t>(j) * cd + c] = input(n + j, c);
    }
  });
}

// Per row: q and k heads L2-normalised in conv_, beta = sigmoid, g = softplus(alpha + dt) * a.
void DeltaNet::prepare_rows(const ModelHParams& h, const DeltaNetWeights& w, int n,
                            ThreadPool& pool) {
  const int cd = h.ssm_conv_dim(), S = h.ssm_head_dim, nk = h.ssm_n_k_head, nv = h.ssm_n_v_head;
  pool.parallel_for(n, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      float* c = conv_.data() + r * cd;
      for (int i = 0; i < 2 * nk; ++i) l2_normalize(c + i * S, S, h.rms_eps);
      float* beta = beta_.data() + r * nv;
      float* g = gate_.data() + r * nv;
      for (int hv = 0; hv < nv; ++hv) {
        beta[hv] = sigmoid(beta[hv]);
        g[hv] = softplus(g[hv] + w.dt_bias[static_cast<size_t>(hv)]) * w.a[static_cast<size_t>(hv)];
      }
    }
  });
}

// The delta rule over the rows of s, one task per value head; out_ = each head's o.
void DeltaNet::recur(const ModelHParams& h, const SeqRows& s, float* state, ThreadPool& pool) {
  const int cd = h.ssm_conv_dim(), S = h.ssm_head_dim, nk = h.ssm_n_k_head, nv = h.ssm_n_v_head;
  const int key_dim = h.ssm_key_dim(), vd = h.ssm_value_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(S));
  pool.parallel_for(nv, 1, [&](int64_t h0, int64_t h1, int) {
    for (int hv = static_cast<int>(h0); hv < static_cast<int>(h1); ++hv) {
      float* M = state + static_cast<size_t>(hv) * S * S;  // [S (v), S (k)]: row j, column i
      const int hk = hv % nk;  // value heads are tiled over the key heads
      for (int r = s.r0; r < s.r1; ++r) {
        const float* c = conv_.data() + static_cast<size_t>(r) * cd;
        DeltaRuleToken tok;
        tok.q = c + hk * S;
        tok.k = c + key_dim + hk * S;
        tok.v = c + 2 * key_dim + hv * S;
        tok.decay = std::exp(gate_.data()[static_cast<size_t>(r) * nv + hv]);
        tok.beta = beta_.data()[static_cast<size_t>(r) * nv + hv];
        tok.scale = scale;
        delta_rule_step(M, tok, S, out_.data() + static_cast<size_t>(r) * vd + hv * S);
      }
    }
  });
}

// out_ per row and head: rmsnorm(o) * ssm_norm * silu(z).
void DeltaNet::gate_rows(const ModelHParams& h, const DeltaNetWeights& w, int n, ThreadPool& pool) {
  const int S = h.ssm_head_dim, nv = h.ssm_n_v_head, vd = h.ssm_value_dim();
  pool.parallel_for(n, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      float* o = out_.data() + r * vd;
      const float* z = z_.data() + r * vd;
      for (int hv = 0; hv < nv; ++hv) rmsnorm(o + hv * S, w.norm.data(), h.rms_eps, S, o + hv * S);
      for (int i = 0; i < vd; ++i) o[i] *= silu(z[i]);
    }
  });
}

void DeltaNet::run(const ModelHParams& h, const DeltaNetWeights& w, int il, const UbatchInput& in,
                   float* xn, ThreadPool& pool, ForwardTimings& t) {
  const int n = static_cast<int>(in.tokens.size());
  D2O_ASSERT(n <= rows_cap_);
  Stopwatch sw;
  const MatmulCall calls[] = {{&w.qkv, xn, mixed_.data()},
                              {&w.gate, xn, z_.data()},
                              {&w.beta, xn, beta_.data()},
                              {&w.alpha, xn, gate_.data()}};
  matmul_many(calls, n, pool);
  t.matmul_s += sw.seconds();
  for (const SeqRows& s : in.seqs) {
    RecurrentState& rs = s.cache->recurrent_for_update();
    convolve(h, w, s, rs.conv[static_cast<size_t>(il)].data(), pool);
  }
  prepare_rows(h, w, n, pool);
  for (const SeqRows& s : in.seqs) {
    recur(h, s, s.cache->recurrent_for_update().delta[static_cast<size_t>(il)].data(), pool);
  }
  gate_rows(h, w, n, pool);
  Stopwatch so;
  matmul(w.out, out_.data(), n, xn, pool);
  t.matmul_s += so.seconds();
}

}  // namespace d2o
