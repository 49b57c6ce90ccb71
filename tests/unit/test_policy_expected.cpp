// Expected attention (kv/policy/score_expected.cpp, kv/query_window.h).
//   - The scorer against a naive double-precision computation that builds what the method states
//     (the mean rotation matrix as the mean of F explicit rotation matrices, the covariance
//     matrix, the quadratic forms, an explicit Hadamard matrix for rotated storage), on small
//     random caches: every storage type (f32, f16, q8_0, q4_0, q8_0r, q4_0r), MHA / GQA / MQA,
//     both RoPE layouts with a partial rotation, scaling and frequency factors, windows full,
//     wrapped and short, with and without the value weight; pooled for the prompt's compaction.
//   - The attention pass's recorded queries through a random-weight model: rotated back from their
//     positions (layer 0's query of a token is the same at every position), kept across passes
//     and decode steps, none in sliding-window layers.
//   - Real prompt compactions on every storage type: the slots h2o and d2o keep are those the
//     naive computation ranks first from the recorded queries; per-head budgets; decoding.
//   - Memory: what the cache holds and what the policy reserves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "kv/policy/composed.h"
#include "kv/policy/scorer.h"
#include "kv/policy/select.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

// ---- the naive computation -----------------------------------------------------------------

struct NaiveRope {
  bool neox = false;
  int n_rot = 0;
  double base = 10000.0, freq_scale = 1.0;
  std::vector<double> ff;  // empty: all 1
};

NaiveRope naive_rope(const RopeParams& r) {
  NaiveRope n;
  n.neox = r.type == RopeType::kNeox;
  n.n_rot = r.n_rot;
  n.base = r.freq_base;
  n.freq_scale = r.freq_scale;
  if (r.freq_factors) n.ff.assign(r.freq_factors, r.freq_factors + r.n_rot / 2);
  return n;
}

// RoPE's rotation matrix at position p, [d x d] row-major.
std::vector<double> rope_matrix(const NaiveRope& r, int d, double p) {
  std::vector<double> R(static_cast<size_t>(d * d), 0.0);
  for (int i = 0; i < d; ++i) R[static_cast<size_t>(i * d + i)] = 1.0;
  const int half = r.n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const double ff = r.ff.empty() ? 1.0 : r.ff[static_cast<size_t>(i)];
    const double ang = r.freq_scale * p * std::pow(r.base, -2.0 * i / r.n_rot) / ff;
    const int a = r.neox ? i : 2 * i, b = r.neox ? i + half : 2 * i + 1;
    R[static_cast<size_t>(a * d + a)] = std::cos(ang);
    R[static_cast<size_t>(a * d + b)] = -std::sin(ang);
    R[static_cast<size_t>(b * d + a)] = std::sin(ang);
    R[static_cast<size_t>(b * d + b)] = std::cos(ang);
  }
  return R;
}

// x rotated back from rotated storage: blocks of the largest power of two dividing d (at least
// 64), each multiplied by the normalised Sylvester Hadamard matrix, (-1)^popcount(i & j) / sqrt(b).
std::vector<double> unrotate(const std::vector<double>& x) {
  const int d = static_cast<int>(x.size());
  int b = 64;
  while (d % (2 * b) == 0) b *= 2;
  std::vector<double> y(x.size(), 0.0);
  for (int o = 0; o < d; o += b)
    for (int i = 0; i < b; ++i)
      for (int j = 0; j < b; ++j)
        y[static_cast<size_t>(o + i)] += ((__builtin_popcount(i & j) % 2) ? -1.0 : 1.0) /
                                         std::sqrt(static_cast<double>(b)) *
                                         x[static_cast<size_t>(o + j)];
  return y;
}

// The queries a window holds, [m][n_head][d], oldest first (the last `m` of it when m > 0).
std::vector<std::vector<double>> window_queries(const QueryWindow& w, int last = 0) {
  std::vector<std::vector<double>> q;
  const int from = last > 0 ? std::max(0, w.count() - last) : 0;
  for (int i = from; i < w.count(); ++i) {
    std::vector<double> row;
    for (int h = 0; h < w.n_head(); ++h)
      for (int k = 0; k < w.head_dim(); ++k) row.push_back(w.query(h, i)[k]);
    q.push_back(row);
  }
  return q;
}

struct NaiveArgs {
  std::vector<std::vector<double>> queries;  // [m][n_head * d], before RoPE
  int n_head = 0;
  double scale = 0.125;
  NaiveRope rope;
  int64_t next = 0;
  int future = 512;
  bool value_norm = true;
};

// Expected attention of every slot of head g of L, as the method states it.
std::vector<double> naive_expected(const KvLayer& L, int g, const NaiveArgs& a) {
  const int d = L.head_dim(), n = L.n_slot(g), G = L.n_head_kv();
  const int m = static_cast<int>(a.queries.size());
  std::vector<std::vector<double>> keys(static_cast<size_t>(n)), vals(static_cast<size_t>(n));
  std::vector<float> row(static_cast<size_t>(d));
  for (int j = 0; j < n; ++j) {
    L.load_key(g, j, row.data());
    keys[static_cast<size_t>(j)].assign(row.begin(), row.end());
    if (L.type().rot_k) keys[static_cast<size_t>(j)] = unrotate(keys[static_cast<size_t>(j)]);
    L.load_value(g, j, row.data());
    vals[static_cast<size_t>(j)].assign(row.begin(), row.end());
  }
  std::vector<double> e(static_cast<size_t>(n), 1.0 / n);
  if (m > 0) {
    std::vector<double> Rbar(static_cast<size_t>(d * d), 0.0);
    for (int t = 0; t < a.future; ++t) {
      const std::vector<double> R = rope_matrix(a.rope, d, static_cast<double>(a.next + t));
      for (size_t i = 0; i < R.size(); ++i) Rbar[i] += R[i] / a.future;
    }
    const int grp = a.n_head / G;
    std::fill(e.begin(), e.end(), 0.0);
    for (int r = 0; r < grp; ++r) {
      const int h = g * grp + r;
      auto q = [&](int i, int k) {
        return a.queries[static_cast<size_t>(i)][static_cast<size_t>(h * d + k)];
      };
      std::vector<double> mu(static_cast<size_t>(d), 0.0), sig(static_cast<size_t>(d * d), 0.0);
      for (int i = 0; i < m; ++i)
        for (int k = 0; k < d; ++k) mu[static_cast<size_t>(k)] += q(i, k) / m;
      for (int i = 0; i < m; ++i)
        for (int x = 0; x < d; ++x)
          for (int y = 0; y < d; ++y)
            sig[static_cast<size_t>(x * d + y)] +=
                (q(i, x) - mu[static_cast<size_t>(x)]) * (q(i, y) - mu[static_cast<size_t>(y)]) / m;
      std::vector<double> muf(static_cast<size_t>(d), 0.0), t1(static_cast<size_t>(d * d), 0.0),
          sf(static_cast<size_t>(d * d), 0.0);
      for (int x = 0; x < d; ++x)
        for (int y = 0; y < d; ++y)
          muf[static_cast<size_t>(x)] += Rbar[static_cast<size_t>(x * d + y)] * mu[static_cast<size_t>(y)];
      for (int x = 0; x < d; ++x)
        for (int y = 0; y < d; ++y)
          for (int k = 0; k < d; ++k)
            t1[static_cast<size_t>(x * d + y)] +=
                Rbar[static_cast<size_t>(x * d + k)] * sig[static_cast<size_t>(k * d + y)];
      for (int x = 0; x < d; ++x)
        for (int y = 0; y < d; ++y)
          for (int k = 0; k < d; ++k)
            sf[static_cast<size_t>(x * d + y)] +=
                t1[static_cast<size_t>(x * d + k)] * Rbar[static_cast<size_t>(y * d + k)];
      std::vector<double> z(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        const std::vector<double>& k = keys[static_cast<size_t>(j)];
        double lin = 0.0, quad = 0.0;
        for (int x = 0; x < d; ++x) {
          lin += muf[static_cast<size_t>(x)] * k[static_cast<size_t>(x)];
          for (int y = 0; y < d; ++y)
            quad += k[static_cast<size_t>(x)] * sf[static_cast<size_t>(x * d + y)] * k[static_cast<size_t>(y)];
        }
        z[static_cast<size_t>(j)] = a.scale * lin + 0.5 * a.scale * a.scale * quad;
      }
      const double zmax = *std::max_element(z.begin(), z.end());
      double sum = 0.0;
      for (double x : z) sum += std::exp(x - zmax);
      for (int j = 0; j < n; ++j)
        e[static_cast<size_t>(j)] += std::exp(z[static_cast<size_t>(j)] - zmax) / sum / grp;
    }
  }
  if (a.value_norm) {
    double num = 0.0, den = 0.0;
    std::vector<double> vn(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      double s = 0.0;
      for (double x : vals[static_cast<size_t>(j)]) s += x * x;
      vn[static_cast<size_t>(j)] = std::sqrt(s);
      num += e[static_cast<size_t>(j)] * vn[static_cast<size_t>(j)];
      den += e[static_cast<size_t>(j)];
    }
    for (int j = 0; j < n; ++j) e[static_cast<size_t>(j)] *= vn[static_cast<size_t>(j)] * den / num;
  }
  return e;
}

// Avg pooling over `kernel` (zero padding counted) of the first n values.
std::vector<double> naive_pool_avg(const std::vector<double>& x, int n, int kernel) {
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = j - kernel / 2; i <= j + kernel / 2; ++i)
      if (i >= 0 && i < n) out[static_cast<size_t>(j)] += static_cast<float>(x[static_cast<size_t>(i)]);
    out[static_cast<size_t>(j)] /= kernel;
  }
  return out;
}

// `kept` (positions of a head holding positions 0..n-1 before the compaction) is [0, sinks),
// [end, n) and `top` candidates of [sinks, end) that the scores s rank first: none evicted
// scores more than any kept one, up to 1e-5 of the largest score (near-ties of the float
// computation against the double one may go either way; pooled expected attention has plateaus).
void expect_ranked_first(const std::set<int>& kept, const std::vector<double>& s, int sinks,
                         int end, int top, int n) {
  for (int j = 0; j < sinks; ++j) EXPECT_TRUE(kept.count(j)) << "sink " << j;
  for (int j = end; j < n; ++j) EXPECT_TRUE(kept.count(j)) << "recent " << j;
  double lo_kept = 1e300, hi_evicted = -1e300, hi = 0.0;
  int n_kept = 0;
  for (int j = sinks; j < end; ++j) {
    hi = std::max(hi, s[static_cast<size_t>(j)]);
    if (kept.count(j)) {
      ++n_kept;
      lo_kept = std::min(lo_kept, s[static_cast<size_t>(j)]);
    } else {
      hi_evicted = std::max(hi_evicted, s[static_cast<size_t>(j)]);
    }
  }
  EXPECT_EQ(n_kept, top);
  EXPECT_GE(lo_kept, hi_evicted - 1e-5 * hi) << "a candidate kept scores below one evicted";
  EXPECT_EQ(static_cast<int>(kept.size()), sinks + top + (n - end));
}

// ---- the scorer on random caches ------------------------------------------------------------

struct Case {
  KvType type;
  int n_head_kv;
  bool neox;
  int cap, pushed;  // the window's capacity, the queries pushed into it
  int n;            // slots
  int64_t next;
  int future;
  bool value_norm;
  float scale;
};

void check_case(const Case& c, uint32_t seed) {
  constexpr int kHd = 64, kHeads = 4;
  SCOPED_TRACE(std::string(kv_type_name(c.type)) + " G=" + std::to_string(c.n_head_kv) +
               (c.neox ? " neox" : " norm") + " cap=" + std::to_string(c.cap) + " pushed=" +
               std::to_string(c.pushed) + " n=" + std::to_string(c.n) + " next=" +
               std::to_string(c.next) + " F=" + std::to_string(c.future) +
               (c.value_norm ? " vnorm" : ""));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  KvCache cache(KvCacheConfig{1, c.n_head_kv, kHd, c.type});
  std::vector<float> k(static_cast<size_t>(c.n) * c.n_head_kv * kHd), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 1.5f * nd(rng) + (i % kHd < 4 ? 2.0f : 0.0f);  // a few large channels, as keys have
    v[i] = nd(rng) * (1.0f + static_cast<float>(i % 7) * 0.1f);
  }
  std::vector<int32_t> pos(static_cast<size_t>(c.n));
  for (int j = 0; j < c.n; ++j) pos[static_cast<size_t>(j)] = j;
  ASSERT_TRUE(cache.reserve(0, c.n, true).ok());
  cache.append(0, k.data(), v.data(), pos.data(), c.n);

  RopeParams rope;
  std::vector<float> ff(kHd / 4, 1.0f);
  if (c.neox) {
    rope.type = RopeType::kNeox;
    rope.n_rot = kHd / 2;  // a partial rotation: dims 32.. do not turn
    rope.freq_base = 1e6f;
    rope.freq_scale = 0.5f;
    for (size_t i = 0; i < ff.size(); ++i) ff[i] = 1.0f + static_cast<float>(i) * 0.25f;
    rope.freq_factors = ff.data();
  } else {
    rope.n_rot = kHd;
  }
  rope.head_dim = kHd;
  QueryWindow& w = cache.queries_for_attention(0);
  w.configure(kHeads, kHd, c.cap, c.scale, rope);
  std::vector<float> q(static_cast<size_t>(c.pushed) * kHeads * kHd);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.3f * nd(rng) + (i % 3 == 0 ? 0.8f : -0.2f);
  // In two pushes, the ring wraps when pushed > cap.
  w.push(q.data(), c.pushed / 2);
  w.push(q.data() + static_cast<size_t>(c.pushed / 2) * kHeads * kHd, c.pushed - c.pushed / 2);
  ASSERT_EQ(w.count(), std::min(c.cap, c.pushed));

  PolicyConfig cfg;
  cfg.future = c.future;
  cfg.value_weight = c.value_norm ? ValueWeight::kNorm : ValueWeight::kNone;
  cfg.kernel = 5;
  const std::unique_ptr<Scorer> plain = make_expected_attention(cfg);
  const std::unique_ptr<Scorer> pooled = make_expected_attention_pooled(cfg);
  EXPECT_TRUE(plain->reads_queries());
  NaiveArgs a;
  // The window keeps the last min(cap, pushed) of the queries pushed.
  for (int i = std::max(0, c.pushed - c.cap); i < c.pushed; ++i)
    a.queries.emplace_back(q.begin() + static_cast<ptrdiff_t>(i) * kHeads * kHd,
                           q.begin() + static_cast<ptrdiff_t>(i + 1) * kHeads * kHd);
  a.n_head = kHeads;
  a.scale = c.scale;
  a.rope = naive_rope(rope);
  a.next = c.next;
  a.future = c.future;
  a.value_norm = c.value_norm;
  SelectScratch sc;
  std::vector<float> out(static_cast<size_t>(c.n), -1.0f);
  for (int g = 0; g < c.n_head_kv; ++g) {
    SCOPED_TRACE("head " + std::to_string(g));
    HeadView h;
    h.layer = &cache.layer(0);
    h.head = g;
    h.n = c.n;
    h.S = c.n / 2;
    h.next = c.next;
    h.queries = &cache.queries(0);
    const std::vector<double> want = naive_expected(cache.layer(0), g, a);
    const int first = 3, end = c.n - 5;
    const float* got = plain->score(h, first, end, sc, out.data());
    double sum = 0.0;
    for (int j = 0; j < c.n; ++j) sum += want[static_cast<size_t>(j)];
    for (int j = first; j < end; ++j)
      ASSERT_NEAR(got[j], want[static_cast<size_t>(j)], 2e-5 * want[static_cast<size_t>(j)] + 1e-9)
          << "slot " << j;
    EXPECT_NEAR(sum, 1.0, 1e-9);  // (the value weight keeps the scale of attention)
    // Pooled (the prompt's compaction): the prefix [0, end) pooled over the kernel.
    const std::vector<double> pw = naive_pool_avg(want, end, cfg.kernel);
    const float* gp = pooled->score(h, first, end, sc, out.data());
    for (int j = 0; j < end; ++j)
      ASSERT_NEAR(gp[j], pw[static_cast<size_t>(j)], 2e-5 * pw[static_cast<size_t>(j)] + 1e-9)
          << "pooled slot " << j;
  }
}

TEST(ExpectedAttention, MatchesTheNaiveComputationOnEveryStorageType) {
  const KvType types[] = {KvType::kF32, KvType::kF16, KvType::kQ8_0, KvType::kQ4_0,
                          KvType{KvElemType::kQ8_0, KvElemType::kQ8_0, true, true},
                          KvType{KvElemType::kQ4_0, KvElemType::kF16, true, false}};
  uint32_t seed = 1;
  for (const KvType& t : types) {
    for (int G : {4, 2, 1}) {
      for (bool neox : {false, true}) {
        const int v = static_cast<int>(seed % 3);
        Case c;
        c.type = t;
        c.n_head_kv = G;
        c.neox = neox;
        c.cap = v == 0 ? 8 : v == 1 ? 16 : 1;
        c.pushed = v == 0 ? 13 : v == 1 ? 5 : 3;  // wrapped, not full, one query
        c.n = 37;
        c.next = neox ? 5000 : 37;
        c.future = v == 2 ? 7 : 512;
        c.value_norm = (seed % 2) == 0;
        c.scale = neox ? 0.2f : 0.125f;
        check_case(c, seed++);
      }
    }
  }
  // More slots than a tile of keys (256) in one call.
  check_case({KvType::kF16, 2, false, 16, 40, 300, 300, 512, true, 0.125f}, 99);
  check_case({KvType{KvElemType::kQ4_0, KvElemType::kQ4_0, true, true}, 1, true, 32, 32, 270,
              12345, 64, true, 0.125f},
             100);
}

// No recorded queries (a layer whose policy never asked, or a fresh cache): every slot alike.
TEST(ExpectedAttention, WithoutQueriesEverySlotScoresAlike) {
  KvCache cache(KvCacheConfig{1, 2, 8, KvType::kF32});
  std::vector<float> k(10 * 16, 0.5f), v(10 * 16, 1.0f);
  std::vector<int32_t> pos(10);
  std::iota(pos.begin(), pos.end(), 0);
  ASSERT_TRUE(cache.reserve(0, 10, true).ok());
  cache.append(0, k.data(), v.data(), pos.data(), 10);
  PolicyConfig cfg;
  const auto s = make_expected_attention(cfg);
  SelectScratch sc;
  std::vector<float> out(10);
  HeadView h;
  h.layer = &cache.layer(0);
  h.n = 10;
  h.S = 5;
  for (const QueryWindow* w : {static_cast<const QueryWindow*>(nullptr), &cache.queries(0)}) {
    h.queries = w;
    const float* got = s->score(h, 0, 10, sc, out.data());
    for (int j = 0; j < 10; ++j) EXPECT_FLOAT_EQ(got[j], 0.1f);
  }
}

// ---- through the engine -----------------------------------------------------------------------

// Compacts nothing; asks the attention pass to record the last `w` queries.
class QueryRecorder final : public KvPolicy {
 public:
  explicit QueryRecorder(int w) : w_(w) {}
  std::string spec() const override { return "query-recorder"; }
  StatsNeeds needs() const override {
    StatsNeeds n;
    n.queries = w_;
    return n;
  }
  Status compact(KvCache&, PolicyState&, const PassInfo&) const override { return {}; }
  int64_t peak_slots(int64_t, int64_t n_total, int) const override { return n_total; }
  int64_t peak_slots_for(const FeedPlan& f) const override {
    return std::max(f.n_prompt, f.n_total);
  }

 private:
  int w_;
};

Status feed(Engine& engine, Sequence& seq, std::span<const TokenId> tokens) {
  BatchEntry be;
  be.seq = &seq;
  be.tokens = tokens;
  return engine.forward({&be, 1}, [](int, int, const float*) {});
}

double max_abs_diff(const float* a, const float* b, int n) {
  double m = 0.0;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// Layer 0's query of a token depends on the token alone (its input is the token's embedding), so
// the queries recorded for one token at different positions, rotated back by their own
// positions, must be one vector; in the window in order, across passes and decode steps.
TEST(ExpectedAttentionEngine, RecordsEachQueryRotatedBackFromItsPosition) {
  for (const char* arch : {"llama", "qwen2"}) {
    SCOPED_TRACE(arch);
    test::RandomModelConfig cfg = std::string(arch) == "qwen2" ? test::random_qwen2_config()
                                                               : test::RandomModelConfig();
    cfg.n_layer = 2;
    auto model = test::load_random_model(cfg, std::string("expected_rec_") + arch + ".gguf");
    ASSERT_NE(model, nullptr);
    ThreadPool pool(2);
    Engine engine(*model, pool, EngineOptions{});
    std::vector<TokenId> prompt = test::random_model_tokens(40, model->hparams().n_vocab);
    const TokenId T = prompt[5];
    for (int p : {18, 26, 33, 39}) prompt[static_cast<size_t>(p)] = T;
    constexpr int kW = 24;  // positions 16..39: both passes
    Sequence seq(model->hparams(), KvType::kF16, std::make_shared<QueryRecorder>(kW));
    ASSERT_TRUE(feed(engine, seq, std::span<const TokenId>(prompt.data(), 20)).ok());
    ASSERT_TRUE(feed(engine, seq, std::span<const TokenId>(prompt.data() + 20, 20)).ok());
    const QueryWindow& w = seq.cache().queries(0);
    ASSERT_EQ(w.count(), kW);
    ASSERT_EQ(w.n_head(), model->hparams().n_head);
    ASSERT_EQ(w.head_dim(), model->hparams().head_dim);
    EXPECT_EQ(w.scale(), model->desc().layers[0].attn_scale);
    const int hd = w.head_dim();
    for (int h = 0; h < w.n_head(); ++h) {
      const float* ref = w.query(h, 18 - 16);
      double norm = 0.0;
      for (int k = 0; k < hd; ++k) norm = std::max(norm, std::fabs(static_cast<double>(ref[k])));
      for (int p : {26, 33, 39})
        EXPECT_LT(max_abs_diff(w.query(h, p - 16), ref, hd), 1e-4 * norm) << "head " << h << " pos " << p;
      // Another token's query is another vector.
      EXPECT_GT(max_abs_diff(w.query(h, 20 - 16), ref, hd), 1e-2 * norm);
    }
    // A decode step pushes its query and drops the oldest.
    ASSERT_TRUE(feed(engine, seq, std::span<const TokenId>(&T, 1)).ok());
    ASSERT_EQ(w.count(), kW);
    for (int h = 0; h < w.n_head(); ++h) {
      const float* ref = w.query(h, 39 - 17);  // (the window now starts at position 17)
      double norm = 0.0;
      for (int k = 0; k < hd; ++k) norm = std::max(norm, std::fabs(static_cast<double>(ref[k])));
      EXPECT_LT(max_abs_diff(w.query(h, kW - 1), ref, hd), 1e-4 * norm) << "head " << h;
    }
  }
}

// Gemma 3: its sliding-window layers are never compacted, so they record nothing.
TEST(ExpectedAttentionEngine, SlidingLayersRecordNothing) {
  auto model = test::load_random_model(test::random_gemma3_config(), "expected_gemma3.gguf");
  ASSERT_NE(model, nullptr);
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> prompt = test::random_model_tokens(30, model->hparams().n_vocab);
  for (const char* spec : {"h2o:ratio=0.3,scorer=expected_attention,window=8",
                           "d2o:ratio=0.3,prompt_ranking=expected,window=8"}) {
    SCOPED_TRACE(spec);
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok());
    Sequence seq(model->hparams(), KvType::kF16, std::shared_ptr<const KvPolicy>(std::move(*p)));
    ASSERT_TRUE(feed(engine, seq, prompt).ok());
    for (int t = 0; t < 3; ++t) ASSERT_TRUE(feed(engine, seq, {&prompt[static_cast<size_t>(t)], 1}).ok());
    const KvCacheConfig& cc = seq.cache().config();
    for (int il = 0; il < cc.n_layer; ++il) {
      const int want = cc.layer_compressible(il) && spec[0] == 'h' ? 8 : 0;
      EXPECT_EQ(seq.cache().queries(il).count(), want) << "layer " << il;
      if (cc.layer_compressible(il)) {
        EXPECT_LE(seq.cache().layer(il).n_slot(), 9) << "layer " << il;
      }
    }
  }
}

class ExpectedAttentionCompaction : public test::RandomModelSuite<ExpectedAttentionCompaction> {
 public:
  // Head size 64, so that rotated storage (q4_0r) applies; GQA.
  static test::RandomModelConfig config() {
    test::RandomModelConfig c;
    c.n_layer = 2;
    c.n_embd = 256;
    c.n_head = 4;
    c.n_head_kv = 2;
    c.n_ff = 128;
    c.seed = 21;
    return c;
  }
  static const char* file() { return "expected_compaction.gguf"; }
};

// The slots the prompt's compaction keeps are those the naive computation ranks first, from the
// queries the attention pass recorded (a sequence that compacts nothing records the same); the
// sequence then decodes, every step evicting by its scorer (h2o) or by mean attention (d2o).
TEST_F(ExpectedAttentionCompaction, KeepsWhatTheNaiveComputationRanksFirstOnEveryStorageType) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const std::vector<TokenId> tokens = test::random_model_tokens(66, model_->hparams().n_vocab);
  const std::span<const TokenId> prompt(tokens.data(), 60);
  const KvType types[] = {KvType::kF16, KvType::kQ8_0, KvType::kQ4_0,
                          KvType{KvElemType::kQ4_0, KvElemType::kQ4_0, true, true}};
  for (const KvType& type : types) {
    SCOPED_TRACE(kv_type_name(type));
    Sequence rec(model_->hparams(), type, std::make_shared<QueryRecorder>(32));
    ASSERT_TRUE(feed(engine, rec, prompt).ok());
    struct Want {
      std::string spec;
      int sinks, top, recent, window, kernel;  // the prompt's compaction, S = 18 of 60
      bool vnorm;
    };
    const std::vector<Want> wants = {
        {"h2o:ratio=0.3,scorer=expected_attention", 0, 9, 9, 32, 1, true},
        {"h2o:ratio=0.3,scorer=expected_attention,value_weight=none,future=16", 0, 9, 9, 32, 1,
         false},
        {"d2o:ratio=0.3,prompt_ranking=expected,window=8", 4, 6, 8, 8, 21, true},
        {"h2o:ratio=0.3,prompt_ranking=expected,window=8,kernel=1,value_weight=none", 0, 10, 8, 8,
         1, false},
    };
    for (const Want& wt : wants) {
      SCOPED_TRACE(wt.spec);
      auto p = parse_kv_policy(wt.spec);
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      const auto* cp = dynamic_cast<const ComposedPolicy*>(p->get());
      ASSERT_NE(cp, nullptr);
      const PolicyConfig cfg = cp->config();
      Sequence seq(model_->hparams(), type, std::shared_ptr<const KvPolicy>(std::move(*p)));
      ASSERT_TRUE(feed(engine, seq, prompt).ok());
      for (int il = 0; il < model_->hparams().n_layer; ++il) {
        const KvLayer& R = rec.cache().layer(il);
        const KvLayer& L = seq.cache().layer(il);
        ASSERT_EQ(L.n_slot(), 18);
        NaiveArgs a;
        a.queries = window_queries(rec.cache().queries(il), wt.window);
        a.n_head = model_->hparams().n_head;
        a.scale = model_->desc().layers[static_cast<size_t>(il)].attn_scale;
        a.rope = naive_rope(model_->desc().layers[static_cast<size_t>(il)].rope);
        a.next = 60;
        a.future = cfg.future;
        a.value_norm = wt.vnorm;
        for (int g = 0; g < R.n_head_kv(); ++g) {
          std::vector<double> e = naive_expected(R, g, a);
          const int end = 60 - wt.recent;
          if (wt.kernel > 1) e = naive_pool_avg(e, end, wt.kernel);
          expect_ranked_first(std::set<int>(L.pos(g), L.pos(g) + L.n_slot()), e, wt.sinks, end,
                              wt.top, 60);
        }
      }
      // What the policy keeps of the recorded queries: h2o reads them at every step, d2o's
      // prompt compaction was their last reader.
      const bool keeps = cfg.scorer == "expected_attention";
      for (int il = 0; il < model_->hparams().n_layer; ++il)
        EXPECT_EQ(seq.cache().queries(il).count(), keeps ? cfg.window : 0);
      for (size_t t = 60; t < tokens.size(); ++t) {
        ASSERT_TRUE(feed(engine, seq, {&tokens[t], 1}).ok());
        for (int il = 0; il < model_->hparams().n_layer; ++il)
          ASSERT_EQ(seq.cache().layer(il).n_slot(), 18);
      }
    }
  }
}

// heads=ada shares a layer's slots over its KV heads by expected attention (one scale: each
// query head's expected attention sums to 1), on every storage type, prompt and decode steps.
TEST_F(ExpectedAttentionCompaction, SharesSlotsOverHeads) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const std::vector<TokenId> tokens = test::random_model_tokens(70, model_->hparams().n_vocab);
  const KvType types[] = {KvType::kF16, KvType::kQ8_0, KvType::kQ4_0,
                          KvType{KvElemType::kQ4_0, KvElemType::kQ4_0, true, true}};
  for (const KvType& type : types) {
    SCOPED_TRACE(kv_type_name(type));
    for (const char* spec : {"h2o:ratio=0.3,scorer=expected_attention,heads=ada",
                             "h2o:budget=20,scorer=expected_attention,heads=ada,floor=0.5",
                             "d2o:ratio=0.3,prompt_ranking=accumulated,scorer=expected_attention,"
                             "heads=ada"}) {
      SCOPED_TRACE(spec);
      auto p = parse_kv_policy(spec);
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      Sequence seq(model_->hparams(), type, std::shared_ptr<const KvPolicy>(std::move(*p)));
      ASSERT_TRUE(feed(engine, seq, std::span<const TokenId>(tokens.data(), 60)).ok());
      const int64_t S = seq.policy_state().budgets[0];
      for (size_t t = 60; t < tokens.size(); ++t) {
        ASSERT_TRUE(feed(engine, seq, {&tokens[t], 1}).ok());
        for (int il = 0; il < model_->hparams().n_layer; ++il)
          EXPECT_EQ(seq.cache().layer(il).held_slots(), S * 2) << "layer " << il;
      }
    }
  }
}

// Memory: the cache counts the recorded queries in what it holds; the policy reserves them (the
// last `window` tokens' queries of every compressible layer, whatever the slots).
TEST_F(ExpectedAttentionCompaction, RecordedQueriesAreCountedAndReserved) {
  ThreadPool pool(1);
  Engine engine(*model_, pool, EngineOptions{});
  const std::vector<TokenId> tokens = test::random_model_tokens(40, model_->hparams().n_vocab);
  const auto plain = parse_kv_policy("h2o:ratio=0.3").value();
  const auto ea = parse_kv_policy("h2o:ratio=0.3,scorer=expected_attention,window=16").value();
  const KvCacheConfig cc = kv_cache_config(model_->hparams(), KvType::kF16);
  const int hd = model_->hparams().head_dim, nh = model_->hparams().n_head;
  const size_t per_layer = static_cast<size_t>(16) * nh * hd * sizeof(float);
  const size_t angles = static_cast<size_t>(hd / 2) * sizeof(double);
  EXPECT_EQ(ea->state_bytes(cc, 100) - plain->state_bytes(cc, 100),
            static_cast<size_t>(cc.n_layer) * (per_layer + angles));
  Sequence seq(model_->hparams(), KvType::kF16,
               std::shared_ptr<const KvPolicy>(
                   parse_kv_policy("h2o:ratio=0.3,scorer=expected_attention,window=16").value()));
  ASSERT_TRUE(feed(engine, seq, tokens).ok());
  size_t q = 0;
  for (int il = 0; il < cc.n_layer; ++il) q += seq.cache().queries(il).bytes();
  EXPECT_EQ(q, static_cast<size_t>(cc.n_layer) * (per_layer + angles));
  EXPECT_EQ(seq.cache().bytes_held(),
            seq.cache().kv_bytes_allocated() + seq.cache().meta_bytes_allocated() + q);
}

}  // namespace
}  // namespace d2o
