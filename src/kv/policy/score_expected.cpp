// expected_attention: the attention that future queries are expected to give each slot (Devoto et
// al. 2025, "Expected Attention", query-agnostic: no attention matrix, no question needed).
//
// Per KV head g, for each query head h of its group, from the layer's recorded queries q_1..q_m
// (the last `window` the sequence fed, before RoPE; KvCache::queries):
//   mu = mean q_i,  Sigma = (1/m) sum (q_i - mu)(q_i - mu)^T                 (population)
//   Rbar = the mean over positions p in [next, next + F) of RoPE's rotation R(p): block diagonal,
//          per pair i the 2x2 rotation [[C, -S], [S, C]] with C, S the means of cos(p theta_i)
//          and sin(p theta_i) (a closed form), the model's pairing (normal or NeoX) and angles
//   mu_f = Rbar mu,  Sigma_f = Rbar Sigma Rbar^T
//   z_j = scale * mu_f . k_j + scale^2 / 2 * k_j^T Sigma_f k_j   (k_j: slot j's key as cached,
//          after RoPE at its own position; + log(1 + merged_j) with proportional attention)
//   e_j = mean over the group's heads of softmax over the head's slots [0, n) of z
// then, with value_weight=norm, e_j |v_j| / vbar, vbar = sum e_j |v_j| / sum e_j (the value's
// norm relative to the expected-attention-weighted mean: kvpress's ranking within a head, on the
// scale of attention so that heads=ada compares heads as it compares attention). Higher keeps.
//
// The quadratic form is never built: k^T Sigma_f k = (1/m) sum_i (c_i . k)^2 with c_i =
// Rbar (q_i - mu), so each key costs (m + 1) dot products per query head, formed by the
// attention's score kernels on the keys as stored (any storage type). Rotated key storage
// (kv/kv_rotation.h) keeps H k: mu_f and the c_i are rotated by H too (orthonormal, so the dots
// are those of the unrotated vectors). Decisions: the statistics are those of the last `window`
// queries (kvpress takes the whole prompt's but its first n_sink); the softmax runs over every
// slot of the head, the sinks included (kvpress leaves its sinks out, then keeps them); a layer
// with no recorded queries scores every slot alike (1 / n, then the value weight).
#include <algorithm>
#include <cmath>

#include "kv/attention_kernels.h"
#include "kv/kv_rotation.h"
#include "kv/policy/scorer.h"
#include "kv/policy/select.h"
#include "kv/policy/spec_keys.h"
#include "ops/hadamard.h"

namespace d2o {

namespace {

// Keys whose dots are formed per kernel call (the dots of one tile stay in the core's cache).
constexpr int kKeyTile = 256;

// Mean over p in [a, a + F) of (cos p theta, sin p theta): sum_p e^{i p theta} =
// e^{i (a + (F - 1) / 2) theta} sin(F theta / 2) / sin(theta / 2).
void mean_rotation(double theta, double a, int F, double* c, double* s) {
  const double half = 0.5 * theta;
  const double sh = std::sin(half);
  if (std::fabs(sh) < 1e-12) {
    // theta a multiple of 2 pi (or 0): every position turns by the same angle.
    *c = std::cos(a * theta);
    *s = std::sin(a * theta);
    return;
  }
  const double amp = std::sin(F * half) / (F * sh);
  const double phi = (a + 0.5 * (F - 1)) * theta;
  *c = amp * std::cos(phi);
  *s = amp * std::sin(phi);
}

class ExpectedAttention final : public Scorer {
 public:
  ExpectedAttention(const PolicyConfig& cfg, bool pooled)
      : future_(cfg.future),
        value_norm_(cfg.value_weight == ValueWeight::kNorm),
        mass_(cfg.merger == Merger::kD2o && cfg.mass),
        pooled_(pooled),
        kernel_(cfg.kernel),
        pool_(cfg.pool) {}
  bool reads_queries() const override { return true; }

  // Pooled (the prompt's compaction): the prefix [0, end) pooled as window attention is.
  const float* score(const HeadView& h, int first, int end, SelectScratch& sc,
                     float* out) const override {
    expected(h, sc);
    if (pooled_) {
      pool_window(sc.ea_e.data(), end, kernel_, pool_, out);
      return out;
    }
    (void)first;
    return sc.ea_e.data();
  }

 private:
  // sc.ea_e[0, h.n) = the expected attention of every slot of the head.
  void expected(const HeadView& h, SelectScratch& sc) const;
  // The rows of query head qh: [mu_f, c_1, ..., c_m] (the turned mean, the turned centred
  // queries), in the storage's space.
  void turned_rows(const QueryWindow& W, int qh, const KvLayer& L, SelectScratch& sc,
                   float* rows) const;
  // e[0, h.n): the expected attention from the recorded queries W, averaged over the query
  // heads of the group.
  void from_queries(const HeadView& h, const QueryWindow& W, SelectScratch& sc, float* e) const;
  // e[j] times the value's norm over the e-weighted mean norm.
  void weight_by_value_norm(const HeadView& h, SelectScratch& sc, float* e) const;

  int future_;
  bool value_norm_, mass_, pooled_;
  int kernel_;
  PoolKind pool_;
};

void ExpectedAttention::turned_rows(const QueryWindow& W, int qh, const KvLayer& L,
                                    SelectScratch& sc, float* rows) const {
  const int hd = L.head_dim(), m = W.count(), half = W.n_rot() / 2;
  // [2, head_dim]: the mean, then one centred query.
  if (sc.ea_mean.size() < 2 * static_cast<size_t>(hd)) sc.ea_mean.resize(2 * static_cast<size_t>(hd));
  double* mu = sc.ea_mean.data();
  double* centred = mu + hd;
  std::fill_n(mu, hd, 0.0);
  for (int i = 0; i < m; ++i) {
    const float* q = W.query(qh, i);
    for (int d = 0; d < hd; ++d) mu[d] += q[d];
  }
  for (int d = 0; d < hd; ++d) mu[d] /= m;
  // Pair i's dims: (2i, 2i + 1) (normal) or (i, i + n_rot / 2) (NeoX); dims past n_rot do not
  // turn (Rbar is the identity there).
  const bool neox = W.rope_type() == RopeType::kNeox;
  auto turn = [&](const double* x, float* y) {
    for (int d = 2 * half; d < hd; ++d) y[d] = static_cast<float>(x[d]);
    for (int i = 0; i < half; ++i) {
      const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const double c = sc.ea_rot[2 * static_cast<size_t>(i)];
      const double s = sc.ea_rot[2 * static_cast<size_t>(i) + 1];
      y[a] = static_cast<float>(c * x[a] - s * x[b]);
      y[b] = static_cast<float>(s * x[a] + c * x[b]);
    }
  };
  turn(mu, rows);
  for (int i = 0; i < m; ++i) {
    const float* q = W.query(qh, i);
    for (int d = 0; d < hd; ++d) centred[d] = q[d] - mu[d];
    turn(centred, rows + static_cast<size_t>(1 + i) * hd);
  }
  if (L.type().rot_k) {
    // Keys are stored as H k: dots with H x are those with x.
    hadamard_blocks(rows, static_cast<int64_t>(m + 1) * hd, kv_rot_block_k(hd));
  }
}

void ExpectedAttention::expected(const HeadView& h, SelectScratch& sc) const {
  const KvLayer& L = *h.layer;
  const int n = h.n, hd = L.head_dim(), G = L.n_head_kv();
  if (n <= 0) return;
  if (sc.ea_e.size() < static_cast<size_t>(n)) sc.ea_e.resize(static_cast<size_t>(n));
  float* e = sc.ea_e.data();
  const QueryWindow* W = h.queries;
  const bool usable = W && !W->empty() && W->head_dim() == hd && W->n_head() % G == 0;
  if (!usable) {
    std::fill_n(e, n, n > 0 ? 1.0f / static_cast<float>(n) : 0.0f);
  } else {
    from_queries(h, *W, sc, e);
  }
  if (value_norm_) weight_by_value_norm(h, sc, e);
}

void ExpectedAttention::from_queries(const HeadView& h, const QueryWindow& W, SelectScratch& sc,
                                     float* e) const {
  const KvLayer& L = *h.layer;
  const int g = h.head, n = h.n, hd = L.head_dim(), G = L.n_head_kv();
  const int grp = W.n_head() / G, m = W.count(), per = m + 1, R = grp * per;
  // The mean rotation of every pair over the future positions.
  const int half = W.n_rot() / 2;
  sc.ea_rot.resize(2 * static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    mean_rotation(W.theta()[i], static_cast<double>(h.next), future_,
                  &sc.ea_rot[2 * static_cast<size_t>(i)],
                  &sc.ea_rot[2 * static_cast<size_t>(i) + 1]);
  }
  const size_t rows_n = static_cast<size_t>(R) * static_cast<size_t>(hd);
  if (sc.ea_rows.size() < rows_n) sc.ea_rows.resize(rows_n);
  for (int r = 0; r < grp; ++r) {
    turned_rows(W, g * grp + r, L, sc,
                sc.ea_rows.data() + static_cast<size_t>(r) * per * static_cast<size_t>(hd));
  }
  // Logits z[r][j] of each query head of the group, tile by tile of keys.
  const size_t zn = static_cast<size_t>(grp) * static_cast<size_t>(n);
  if (sc.ea_z.size() < zn) sc.ea_z.resize(zn);
  const size_t dn = static_cast<size_t>(R) * kKeyTile;
  if (sc.ea_dots.size() < dn) sc.ea_dots.resize(dn);
  sc.ea_q.resize(static_cast<size_t>(R));
  sc.ea_s.resize(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    sc.ea_q[static_cast<size_t>(r)] = sc.ea_rows.data() + static_cast<size_t>(r) * hd;
    sc.ea_s[static_cast<size_t>(r)] = sc.ea_dots.data() + static_cast<size_t>(r) * kKeyTile;
  }
  const attn::Kernels& kern = attn::best_kernels();
  const float scale = W.scale();
  const float quad = 0.5f * scale * scale / static_cast<float>(m);
  const int32_t* merged = L.merged(g);
  for (int j0 = 0; j0 < n; j0 += kKeyTile) {
    const int nk = std::min(kKeyTile, n - j0);
    attn::KvRows k{L.key_base(g), L.key_row_bytes(), L.type().k};
    k.idx = L.rows(g) + j0;
    kern.scores(sc.ea_q.data(), R, k, nk, hd, 1.0f, sc.ea_s.data());
    for (int r = 0; r < grp; ++r) {
      const float* mu_dot = sc.ea_s[static_cast<size_t>(r) * per];
      float* z = sc.ea_z.data() + static_cast<size_t>(r) * n + j0;
      for (int j = 0; j < nk; ++j) z[j] = scale * mu_dot[j];
      for (int i = 1; i < per; ++i) {
        const float* c = sc.ea_s[static_cast<size_t>(r) * per + i];
        for (int j = 0; j < nk; ++j) z[j] += quad * c[j] * c[j];
      }
      if (mass_) {
        for (int j = 0; j < nk; ++j) {
          if (merged[j0 + j] > 0) z[j] += std::log1p(static_cast<float>(merged[j0 + j]));
        }
      }
    }
  }
  // Softmax of each query head over the slots, averaged over the group.
  std::fill_n(e, n, 0.0f);
  for (int r = 0; r < grp; ++r) {
    const float* z = sc.ea_z.data() + static_cast<size_t>(r) * n;
    const float zmax = *std::max_element(z, z + n);
    double sum = 0.0;
    for (int j = 0; j < n; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
    const double w = 1.0 / (sum * grp);
    for (int j = 0; j < n; ++j)
      e[j] += static_cast<float>(std::exp(static_cast<double>(z[j] - zmax)) * w);
  }
}

void ExpectedAttention::weight_by_value_norm(const HeadView& h, SelectScratch& sc, float* e) const {
  const KvLayer& L = *h.layer;
  const int g = h.head, n = h.n, hd = L.head_dim();
  // The value's norm relative to the expected-attention-weighted mean norm.
  if (sc.row.size() < static_cast<size_t>(hd)) sc.row.resize(static_cast<size_t>(hd));
  if (sc.ea_z.size() < static_cast<size_t>(n)) sc.ea_z.resize(static_cast<size_t>(n));
  float* vn = sc.ea_z.data();  // (the logits are spent)
  double num = 0.0, den = 0.0;
  for (int j = 0; j < n; ++j) {
    L.load_value(g, j, sc.row.data());
    double s = 0.0;
    for (int d = 0; d < hd; ++d) s += static_cast<double>(sc.row[static_cast<size_t>(d)]) * sc.row[static_cast<size_t>(d)];
    vn[j] = static_cast<float>(std::sqrt(s));
    num += static_cast<double>(e[j]) * vn[j];
    den += e[j];
  }
  if (!(num > 0.0)) return;  // every value zero: the expected attention alone
  const double k = den / num;
  for (int j = 0; j < n; ++j) e[j] = static_cast<float>(e[j] * (vn[j] * k));
}

}  // namespace

std::unique_ptr<Scorer> make_expected_attention(const PolicyConfig& cfg) {
  return std::make_unique<ExpectedAttention>(cfg, false);
}

std::unique_ptr<Scorer> make_expected_attention_pooled(const PolicyConfig& cfg) {
  return std::make_unique<ExpectedAttention>(cfg, true);
}

}  // namespace d2o

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kValueWeightWords = {"norm", "none"};

// Expected attention's own keys are shown (and meaningful) only where it is read.
bool expected_shown(const PolicyConfig& c) {
  return reads_queries(c);
}
}  // namespace

// Expected attention's keys: how far ahead the queries are expected (future=) and whether a
// slot's score is weighted by its value's norm (value_weight=).
std::vector<KeyDef> expected_keys() {
  return {
      int_def<&PolicyConfig::future, 1, 1 << 16>("future", nullptr, expected_shown),
      word_def<&PolicyConfig::value_weight, kValueWeightWords>("value_weight", nullptr,
                                                               expected_shown),
  };
}

}  // namespace d2o::spec_detail
