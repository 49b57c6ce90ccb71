// The cold tier (kv/cold_tier.h): evicted slots kept as they were, the ones a turn's queries want
// chosen as a naive computation chooses them and put back at their places, the spec keys, and a
// conversation's turn through the engine (every token is in one tier or the other).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "common/random_model.h"
#include "common/test_util.h"
#include "core/fp16.h"
#include "kv/cold_tier.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

constexpr int kHd = 64;

// One layer, two KV heads, F32 storage: n slots at positions 0..n-1, rows from `rng`.
KvCache filled_cache(int n, test::Xorshift& rng, std::vector<float>& k, std::vector<float>& v) {
  KvCache c(KvCacheConfig(1, 2, kHd, KvType::kF32));
  k.resize(static_cast<size_t>(n) * 2 * kHd);
  v.resize(k.size());
  for (float& x : k) x = rng.uniform(1.0f);
  for (float& x : v) x = rng.uniform(1.0f);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  std::iota(pos.begin(), pos.end(), 0);
  EXPECT_TRUE(c.reserve(0, n, true).ok());
  c.append(0, k.data(), v.data(), pos.data(), n);
  return c;
}

const float* row(const std::vector<float>& x, int t, int h) {
  return x.data() + (static_cast<size_t>(t) * 2 + static_cast<size_t>(h)) * kHd;
}

CompactionPlan keep_plan(const std::vector<int32_t>& keep) {
  CompactionPlan p;
  p.reset(2, static_cast<int>(keep.size()));
  for (int h = 0; h < 2; ++h) std::copy(keep.begin(), keep.end(), p.keep_of(h));
  return p;
}

// The tier's storage follows the model's head size: q4_0r (the default) where the rotation
// takes the head, q4_0 where only its blocks divide it, F16 where neither does; a type that fits
// is kept as given.
TEST(ColdTier, ItsStorageTypeFollowsTheHeadSize) {
  struct Case {
    int head_dim;
    KvType given, want;
  };
  const KvType q4_0r = parse_kv_type("q4_0r").value(), q8_0r = parse_kv_type("q8_0r").value();
  for (const Case& c :
       {Case{64, q4_0r, q4_0r}, Case{256, q4_0r, q4_0r}, Case{32, q4_0r, KvType::kQ4_0},
        Case{96, q8_0r, KvType::kQ8_0}, Case{48, q4_0r, KvType::kF16},
        Case{48, KvType::kF32, KvType::kF32}, Case{32, KvType::kQ8_0, KvType::kQ8_0}}) {
    SCOPED_TRACE(std::to_string(c.head_dim) + " " + kv_type_name(c.given));
    KvCache cache(KvCacheConfig(2, 1, c.head_dim, KvType::kF16));
    ColdTierConfig cc;
    cc.place = ColdPlace::kMemory;
    cc.type = c.given;
    cache.enable_cold(cc);
    ASSERT_NE(cache.cold(), nullptr);
    EXPECT_EQ(cache.cold()->config().type, c.want) << kv_type_name(cache.cold()->config().type);
    EXPECT_TRUE(check_kv_type(cache.cold()->config().type, c.head_dim).ok());
  }
}

TEST(ColdTier, EvictedSlotsGoColdAndTheWantedComeBackAtTheirPlaces) {
  test::Xorshift rng(5);
  std::vector<float> k, v;
  KvCache c = filled_cache(12, rng, k, v);
  ColdTierConfig cc;
  cc.place = ColdPlace::kMemory;
  cc.type = KvType::kF32;
  cc.recall = 3;
  cc.kernel = 3;
  c.enable_cold(cc);
  const std::vector<int32_t> keep = {0, 1, 6, 10, 11};
  c.apply(0, keep_plan(keep));
  ColdTier& cold = *c.cold();
  const std::vector<int> evicted = {2, 3, 4, 5, 7, 8, 9};
  for (int h = 0; h < 2; ++h) EXPECT_EQ(cold.n_slots(0, h), 7);
  EXPECT_EQ(cold.rows_bytes(), size_t{7} * 2 * 2 * kHd * sizeof(float));

  // Queries: two rows per head, one much like token 3's key (head 0) or 8's (head 1), one noise.
  const float scale = 0.125f;
  std::vector<std::vector<float>> q(2, std::vector<float>(2 * kHd));
  for (int h = 0; h < 2; ++h) {
    for (int d = 0; d < kHd; ++d) {
      q[h][d] = 4.0f * row(k, h == 0 ? 3 : 8, h)[d] + rng.uniform(0.1f);
      q[h][kHd + d] = rng.uniform(0.5f);
    }
  }
  // Naive: each query's softmax over the cold keys; a slot's score the most any query gives it,
  // then the best over its neighbours (kernel 3) in position order; the best 3, newer on ties.
  std::vector<std::vector<int>> want(2);
  for (int h = 0; h < 2; ++h) {
    std::vector<double> best(evicted.size(), 0.0);
    for (int r = 0; r < 2; ++r) {
      std::vector<double> l(evicted.size());
      double z = 0;
      for (size_t i = 0; i < evicted.size(); ++i) {
        double s = 0;
        for (int d = 0; d < kHd; ++d) s += q[h][r * kHd + d] * row(k, evicted[i], h)[d];
        l[i] = scale * s;
      }
      const double m = *std::max_element(l.begin(), l.end());
      for (double x : l) z += std::exp(x - m);
      for (size_t i = 0; i < evicted.size(); ++i)
        best[i] = std::max(best[i], std::exp(l[i] - m) / z);
    }
    std::vector<double> pooled(best.size());
    for (size_t i = 0; i < best.size(); ++i) {
      pooled[i] = best[i];
      if (i > 0) pooled[i] = std::max(pooled[i], best[i - 1]);
      if (i + 1 < best.size()) pooled[i] = std::max(pooled[i], best[i + 1]);
    }
    std::vector<int> order(evicted.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (pooled[a] != pooled[b]) return pooled[a] > pooled[b];
      return a > b;
    });
    for (int i = 0; i < 3; ++i) want[h].push_back(evicted[order[i]]);
    std::sort(want[h].begin(), want[h].end());
  }
  EXPECT_NE(want[0], want[1]);  // the heads want different tokens

  std::vector<ColdRecall> got(2);
  for (int h = 0; h < 2; ++h) {
    cold.recall(0, h, q[h].data(), 2, scale, 3, got[h]);
    cold.note_recalled(got[h].count());
    ASSERT_EQ(got[h].count(), 3);
    EXPECT_EQ(std::vector<int>(got[h].pos.begin(), got[h].pos.end()), want[h]) << h;
    EXPECT_EQ(cold.n_slots(0, h), 4);
  }
  EXPECT_EQ(cold.recalled_slots(), 6);

  ASSERT_TRUE(c.insert_recalled(0, got).ok());
  const KvLayer& L = c.layer(0);
  std::vector<float> x(kHd);
  for (int h = 0; h < 2; ++h) {
    std::vector<int> held(keep.begin(), keep.end());
    held.insert(held.end(), want[h].begin(), want[h].end());
    std::sort(held.begin(), held.end());
    ASSERT_EQ(L.n_slot(h), 8);
    for (int j = 0; j < 8; ++j) {
      ASSERT_EQ(L.pos(h)[j], held[static_cast<size_t>(j)]) << h << " " << j;
      L.load_key(h, j, x.data());
      EXPECT_TRUE(std::equal(x.begin(), x.end(), row(k, held[static_cast<size_t>(j)], h)));
      L.load_value(h, j, x.data());
      EXPECT_TRUE(std::equal(x.begin(), x.end(), row(v, held[static_cast<size_t>(j)], h)));
    }
  }
  // A copy holds the same tier; clear() empties it.
  KvCache d(c.config());
  d.enable_cold(cc);
  ASSERT_TRUE(d.copy_from(c).ok());
  EXPECT_EQ(d.cold()->total_slots(), 8);
  d.clear();
  EXPECT_EQ(d.cold()->total_slots(), 0);
  EXPECT_EQ(c.cold()->total_slots(), 8);
}

// A tier of 35 slots of one layer (40 slots, all but 4 sinks and the last evicted, F32, kernel 3)
// and 3 queries near slots 9, 20 and 31, for the ranking tests: `best(k, lse_hot)` is what a
// naive double computation recalls, the k best by the window's attention summed over queries and
// pooled over 3 neighbours (newer on ties), each query's softmax over the cold slots (lse_hot
// null: recall_ranking=sum) or over the whole context (lse_hot: each query's log-sum-exp outside
// the tier, recall_ranking=whole).
struct RankingCase {
  static constexpr int kN = 40, kQ = 3;
  static constexpr float kScale = 0.125f;
  test::Xorshift rng{11};
  std::vector<float> k, v, q;
  std::vector<int> evicted;
  KvCache c;

  explicit RankingCase(RecallRanking ranking) : c(filled_cache(kN, rng, k, v)) {
    ColdTierConfig cc;
    cc.place = ColdPlace::kMemory;
    cc.type = KvType::kF32;
    cc.kernel = 3;
    cc.ranking = ranking;
    c.enable_cold(cc);
    c.apply(0, keep_plan({0, 1, 2, 3, kN - 1}));
    for (int t = 4; t < kN - 1; ++t) evicted.push_back(t);
    q.resize(static_cast<size_t>(kQ) * kHd);
    for (int r = 0; r < kQ; ++r) {
      for (int d = 0; d < kHd; ++d)
        q[static_cast<size_t>(r) * kHd + d] = 2.0f * row(k, 9 + 11 * r, 0)[d] + rng.uniform(0.3f);
    }
  }

  std::vector<int> best(int count, const float* lse_hot) const {
    std::vector<double> sum(evicted.size(), 0.0);
    for (int r = 0; r < kQ; ++r) {
      std::vector<double> l(evicted.size());
      for (size_t i = 0; i < evicted.size(); ++i) {
        double dot = 0;
        for (int d = 0; d < kHd; ++d)
          dot += q[static_cast<size_t>(r) * kHd + d] * row(k, evicted[i], 0)[d];
        l[i] = kScale * dot;
      }
      double z = 0;
      for (double x : l) z += std::exp(x);
      if (lse_hot) z += std::exp(double(lse_hot[r]));
      for (size_t i = 0; i < l.size(); ++i) sum[i] += std::exp(l[i]) / z;
    }
    std::vector<double> pooled(sum.size());
    for (size_t i = 0; i < sum.size(); ++i) {
      pooled[i] = sum[i] + (i > 0 ? sum[i - 1] : 0.0) + (i + 1 < sum.size() ? sum[i + 1] : 0.0);
    }
    std::vector<int> order(evicted.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (pooled[a] != pooled[b]) return pooled[a] > pooled[b];
      return a > b;
    });
    // (no near-ties at the cut: float sums rank as the double ones)
    const double at_cut = pooled[static_cast<size_t>(order[static_cast<size_t>(count - 1)])];
    EXPECT_GT((at_cut - pooled[static_cast<size_t>(order[static_cast<size_t>(count)])]) / at_cut,
              1e-4);
    std::vector<int> want;
    for (int i = 0; i < count; ++i) want.push_back(evicted[static_cast<size_t>(order[i])]);
    std::sort(want.begin(), want.end());
    return want;
  }
};

// recall_ranking=sum: a slot's score is the window's softmax share summed over its queries, then
// over its neighbours (kernel 3) in position order; the best 4, newer on ties. A recall of every
// slot ranks nothing and brings all back in position order.
TEST(ColdTier, RankingBySumTakesWhatTheWindowAttendsToMostAndEverythingWhenAsked) {
  RankingCase rc(RecallRanking::kSum);
  ColdTier& cold = *rc.c.cold();
  ColdRecall got;
  cold.recall(0, 0, rc.q.data(), RankingCase::kQ, RankingCase::kScale, 4, got);
  EXPECT_EQ(std::vector<int>(got.pos.begin(), got.pos.end()), rc.best(4, nullptr));
  // Every slot of head 1, whatever the queries: all of them, in position order, rows intact.
  cold.recall(0, 1, rc.q.data(), RankingCase::kQ, RankingCase::kScale, 1000, got);
  EXPECT_EQ(std::vector<int>(got.pos.begin(), got.pos.end()), rc.evicted);
  EXPECT_EQ(cold.n_slots(0, 1), 0);
  for (int j = 0; j < got.count(); ++j) {
    EXPECT_TRUE(std::equal(got.k.begin() + j * kHd, got.k.begin() + (j + 1) * kHd,
                           row(rc.k, rc.evicted[static_cast<size_t>(j)], 1)));
  }
}

// recall_ranking=whole: each query's attention over the cold slots is its share of a softmax
// over the whole context (given as its log-sum-exp outside the tier), so a query that looks at
// the hot slots adds little and one that looks into the tier decides; then summed and pooled as
// by sum. The naive double computation chooses the same 4, and not those sum chooses.
TEST(ColdTier, RankingByTheWholeContextWeighsEachQueryByWhatItGivesTheTier) {
  RankingCase rc(RecallRanking::kWhole);
  // Query 0 gives almost all its attention to the hot slots, query 2 almost none.
  const std::vector<float> lse_hot = {12.0f, 1.0f, -20.0f};
  const std::vector<int> want = rc.best(4, lse_hot.data());
  EXPECT_NE(want, rc.best(4, nullptr));  // the weighing changes the choice here
  ColdRecall got;
  rc.c.cold()->recall(0, 0, rc.q.data(), RankingCase::kQ, RankingCase::kScale, 4, got,
                      lse_hot.data());
  EXPECT_EQ(std::vector<int>(got.pos.begin(), got.pos.end()), want);
}

// The log-sum-exp recall_ranking=whole weighs queries by: each window query over the hot slots
// of its KV head (F16 rows, through the layer's row map after a compaction) and over the pass's
// own keys up to its row, as a naive double computation gives it.
TEST(ColdTier, HotLogSumExpCountsTheHotSlotsAndTheTurnUpToEachQuery) {
  test::Xorshift rng(13);
  const int n = 30, rows = 9, w = 4, group = 2, G = 2;
  KvCache c(KvCacheConfig(1, G, kHd, KvType::kF16));
  std::vector<float> k(static_cast<size_t>(n) * G * kHd), v(k.size());
  for (float& x : k) x = rng.uniform(1.0f);
  for (float& x : v) x = rng.uniform(1.0f);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  std::iota(pos.begin(), pos.end(), 0);
  ASSERT_TRUE(c.reserve(0, n, true).ok());
  c.append(0, k.data(), v.data(), pos.data(), n);
  const std::vector<int32_t> keep = {0, 1, 5, 8, 13, 21, 29};
  c.apply(0, keep_plan(keep));
  // The pass: `rows` keys of its own, the window its last w rows.
  std::vector<float> turn(static_cast<size_t>(rows) * G * kHd);
  for (float& x : turn) x = rng.uniform(1.0f);
  std::vector<float> qs(static_cast<size_t>(w) * group * kHd);
  for (float& x : qs) x = rng.uniform(2.0f);
  const float scale = 0.3f;
  for (int g = 0; g < G; ++g) {
    HotLse a;
    a.layer = &c.layer(0);
    a.g = g;
    a.hd = kHd;
    a.kv_dim = G * kHd;
    a.group = group;
    a.r0 = 0;
    a.r_first = rows - w;
    a.scale = scale;
    a.k = turn.data();
    std::vector<float> lse(static_cast<size_t>(w) * group);
    hot_log_sum_exp(a, qs.data(), 0, 3, lse.data());  // any split gives the same
    hot_log_sum_exp(a, qs.data(), 3, w * group, lse.data());
    for (int i = 0; i < w; ++i) {
      for (int j = 0; j < group; ++j) {
        const float* q = qs.data() + static_cast<size_t>(i * group + j) * kHd;
        double z = 0;
        auto add = [&](const float* key, bool half) {
          double dot = 0;
          for (int d = 0; d < kHd; ++d)
            dot += double(q[d]) * (half ? double(fp16_to_fp32(fp32_to_fp16(key[d]))) : key[d]);
          z += std::exp(scale * dot);
        };
        for (int32_t t : keep) add(row(k, t, g), true);
        for (int r = 0; r <= rows - w + i; ++r)
          add(turn.data() + (static_cast<size_t>(r) * G + g) * kHd, false);
        EXPECT_NEAR(lse[static_cast<size_t>(i * group + j)], std::log(z), 1e-4)
            << "g=" << g << " i=" << i << " j=" << j;
      }
    }
  }
}

// A tier longer than the tile of keys a recall scores at once (256): the slots wanted in the
// first, a middle and the last, partial tile come back, as the naive softmax over all of them
// chooses.
TEST(ColdTier, ARecallScoresEveryTileOfALongTier) {
  test::Xorshift rng(9);
  std::vector<float> k, v;
  const int n = 700;
  KvCache c = filled_cache(n, rng, k, v);
  ColdTierConfig cc;
  cc.place = ColdPlace::kMemory;
  cc.type = KvType::kF32;
  cc.kernel = 1;
  c.enable_cold(cc);
  c.apply(0, keep_plan({0, 1, 2, 3}));
  ColdTier& cold = *c.cold();
  ASSERT_EQ(cold.n_slots(0, 0), n - 4);
  const std::vector<int> wanted = {10, 300, 690};  // tiles 0, 1 and the last
  const float scale = 0.125f;
  const int n_q = static_cast<int>(wanted.size());
  std::vector<float> q(static_cast<size_t>(n_q) * kHd);
  for (int r = 0; r < n_q; ++r) {
    for (int d = 0; d < kHd; ++d)
      q[static_cast<size_t>(r) * kHd + d] = 6.0f * row(k, wanted[static_cast<size_t>(r)], 0)[d];
  }
  // Naive: the best softmax share any query gives each cold slot, the best 3.
  std::vector<std::pair<double, int>> best;
  for (int t = 4; t < n; ++t) best.push_back({0.0, t});
  for (int r = 0; r < n_q; ++r) {
    std::vector<double> l;
    for (int t = 4; t < n; ++t) {
      double dot = 0;
      for (int d = 0; d < kHd; ++d) dot += q[static_cast<size_t>(r) * kHd + d] * row(k, t, 0)[d];
      l.push_back(scale * dot);
    }
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (double x : l) z += std::exp(x - m);
    for (size_t i = 0; i < l.size(); ++i)
      best[i].first = std::max(best[i].first, std::exp(l[i] - m) / z);
  }
  std::sort(best.begin(), best.end(), [](auto a, auto b) { return a.first > b.first; });
  std::vector<int> want = {best[0].second, best[1].second, best[2].second};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(want, wanted);
  ColdRecall got;
  cold.recall(0, 0, q.data(), n_q, scale, 3, got);
  EXPECT_EQ(std::vector<int>(got.pos.begin(), got.pos.end()), want);
}

class ColdTierPlace : public ::testing::TestWithParam<ColdPlace> {};

TEST_P(ColdTierPlace, QuantisedRotatedRowsComeBackCloseAndTheBoundDropsTheOldest) {
  test::Xorshift rng(9);
  std::vector<float> k, v;
  KvCache c = filled_cache(2000, rng, k, v);
  ColdTierConfig cc;
  cc.place = GetParam();  // q4_0r by default
  cc.max_slots = 1000;
  c.enable_cold(cc);
  ASSERT_TRUE(c.cold()->ok()) << c.cold()->error();
  std::vector<int32_t> keep = {0, 1999};
  c.apply(0, keep_plan(keep));
  // 1998 evicted; bounded at 1000 (+ its slack) by dropping the oldest arrivals.
  const int64_t n = c.cold()->n_slots(0, 0);
  EXPECT_GE(n, 1000);
  EXPECT_LE(n, 1125);
  const size_t row_pair = 2 * kv_row_bytes(KvElemType::kQ4_0, kHd);
  if (GetParam() == ColdPlace::kMemory) {
    EXPECT_EQ(c.cold()->rows_bytes(), static_cast<size_t>(n) * 2 * row_pair);
    EXPECT_EQ(c.cold()->disk_bytes(), 0);
  } else {
    // On disk: at most a staging tail per head in memory, the rest in the file.
    EXPECT_LT(c.cold()->rows_bytes(), static_cast<size_t>(2 * ColdTier::kFlushRecords) * row_pair);
    EXPECT_GT(c.cold()->disk_bytes(), 0);
  }
  // A copy recalls the same.
  KvCache d(c.config());
  d.enable_cold(cc);
  ASSERT_TRUE(d.copy_from(c).ok());
  std::vector<float> q(kHd);
  for (int x = 0; x < kHd; ++x) q[x] = 5.0f * row(k, 1990, 1)[x];
  ColdRecall r, r2;
  c.cold()->recall(0, 1, q.data(), 1, 0.125f, 1, r);
  d.cold()->recall(0, 1, q.data(), 1, 0.125f, 1, r2);
  ASSERT_EQ(r.count(), 1);
  EXPECT_EQ(r.pos, r2.pos);
  EXPECT_EQ(r.k, r2.k);
  EXPECT_EQ(r.v, r2.v);
  EXPECT_EQ(c.cold()->n_slots(0, 1), n - 1);
  EXPECT_GT(r.pos[0], 1998 - n);  // only the newest arrivals are left
  // Q4_0 of rows in [-1, 1]: within a quantisation step of the original.
  const float* want = row(k, r.pos[0], 1);
  for (int x = 0; x < kHd; ++x) EXPECT_NEAR(r.k[x], want[x], 0.2f) << x;
  // Turn after turn (each recall rewrites the head on disk), the file keeps a bounded share of
  // garbage, and every slot not recalled is still there and comes back, whatever its place.
  int64_t recalled = 1;
  int64_t most = 0;
  for (int turn = 0; turn < 40; ++turn) {
    for (int h = 0; h < 2; ++h) {
      ColdRecall one;
      c.cold()->recall(0, h, q.data(), 1, 0.125f, 1, one);
      recalled += h == 1 ? one.count() : 0;
    }
    c.cold()->note_turn();
    most = std::max(most, c.cold()->disk_bytes());
    EXPECT_LE(c.cold()->disk_bytes(), 3 * 2 * n * 84 + (int64_t{1} << 20));
  }
  // (Without the rewrite the file would hold 40 x 2 rewrites of about n records by now.)
  if (GetParam() == ColdPlace::kDisk) {
    EXPECT_GT(most, 2 * n * 84);
  }
  ColdRecall rest;
  c.cold()->recall(0, 1, q.data(), 1, 0.125f, 100000, rest);
  EXPECT_EQ(rest.count(), n - recalled);
  EXPECT_EQ(c.cold()->lost_slots(), 0);
  c.clear();
  EXPECT_EQ(c.cold()->total_slots(), 0);
}

INSTANTIATE_TEST_SUITE_P(Places, ColdTierPlace,
                         ::testing::Values(ColdPlace::kMemory, ColdPlace::kDisk),
                         [](const ::testing::TestParamInfo<ColdPlace>& i) {
                           return std::string(i.param == ColdPlace::kDisk ? "disk" : "memory");
                         });

TEST(ColdTierSpec, KeysParsePrintAndRefuseWhatCannotWork) {
  auto p = parse_kv_policy("d2o:cold=memory,recall=32");
  ASSERT_TRUE(p.ok()) << p.status().message();
  const std::string spec = (*p)->spec();
  EXPECT_NE(spec.find("cold=memory"), std::string::npos) << spec;
  EXPECT_NE(spec.find("cold_type=q4_0r"), std::string::npos) << spec;
  EXPECT_NE(spec.find("recall=32"), std::string::npos) << spec;
  auto again = parse_kv_policy(spec);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->spec(), spec);
  EXPECT_EQ((*p)->cold_tier().recall, 32);
  EXPECT_TRUE((*p)->cold_tier().enabled());
  // d2o has a tier on disk by default, printed with its keys; cold=none prints alone.
  auto dflt = parse_kv_policy("d2o");
  ASSERT_TRUE(dflt.ok());
  EXPECT_NE(
      (*dflt)->spec().find(
          ",cold=disk,cold_type=q8_0,cold_size=0,recall=512,recall_ranking=sum,recall_all_up_to="
          "2048"),
      std::string::npos)
      << (*dflt)->spec();
  EXPECT_EQ((*dflt)->cold_tier().place, ColdPlace::kDisk);
  EXPECT_EQ((*parse_kv_policy("d2o:recall=8"))->cold_tier().recall, 8);
  // recall_ranking=: sum unless told, always shown with a tier (specs recorded before it was
  // shown ranked by max: recorded_spec_today).
  EXPECT_EQ((*dflt)->cold_tier().ranking, RecallRanking::kSum);
  auto by_max = parse_kv_policy("d2o:recall=64,recall_ranking=max,recall_all_up_to=0");
  ASSERT_TRUE(by_max.ok()) << by_max.status().message();
  EXPECT_EQ((*by_max)->cold_tier().ranking, RecallRanking::kMax);
  EXPECT_NE((*by_max)->spec().find(",recall=64,recall_ranking=max,recall_all_up_to=0"),
            std::string::npos)
      << (*by_max)->spec();
  EXPECT_EQ((*parse_kv_policy((*by_max)->spec()))->spec(), (*by_max)->spec());
  EXPECT_EQ(
      recorded_spec_today(
          std::string((*by_max)->spec()).substr(0, (*by_max)->spec().find(",recall_ranking=max"))),
      (*by_max)->spec());
  EXPECT_FALSE(parse_kv_policy("d2o:recall_ranking=mean").ok());
  // cold_type=: q8_0 on disk, q4_0r in memory, unless told.
  auto type_of = [](const std::string& spec) {
    return std::string(kv_type_name((*parse_kv_policy(spec))->cold_tier().type));
  };
  EXPECT_EQ(type_of("d2o"), "q8_0");
  EXPECT_EQ(type_of("d2o:cold=disk"), "q8_0");
  EXPECT_EQ(type_of("snapkv:cold=disk"), "q8_0");
  EXPECT_EQ(type_of("d2o:cold=memory"), "q4_0r");
  EXPECT_EQ(type_of("d2o:cold=disk,cold_type=q4_0r"), "q4_0r");
  EXPECT_EQ(type_of("d2o:cold=memory,cold_type=f16"), "f16");
  // recall_all_up_to=: 2048 unless told, 0 turns it off; not without a tier.
  EXPECT_EQ((*dflt)->cold_tier().recall_all_up_to, 2048);
  EXPECT_EQ((*parse_kv_policy("d2o:recall_all_up_to=0"))->cold_tier().recall_all_up_to, 0);
  EXPECT_FALSE(parse_kv_policy("d2o:recall_all_up_to=-1").ok());
  EXPECT_FALSE(parse_kv_policy("d2o:recall_all_up_to=many").ok());
  EXPECT_FALSE(parse_kv_policy("d2o:cold=none,recall_all_up_to=8").ok());
  EXPECT_FALSE(parse_kv_policy("d2o:cold=none,recall_ranking=sum").ok());
  auto none = parse_kv_policy("d2o:cold=none");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE((*none)->cold_tier().enabled());
  const std::string none_spec = (*none)->spec();
  EXPECT_NE(none_spec.find(",cold=none"), std::string::npos) << none_spec;
  EXPECT_EQ(none_spec.find("recall="), std::string::npos) << none_spec;
  EXPECT_EQ((*parse_kv_policy(none_spec))->spec(), none_spec);
  // Where the configuration cannot have one, d2o's default tier is left out (cold=none).
  for (const char* spec :
       {"d2o:reading=paper", "d2o:prompt_ranking=accumulated",
        "d2o:heads=ada,prompt_ranking=accumulated", "d2o:reading=paper,prompt_ranking=window"}) {
    auto q = parse_kv_policy(spec);
    ASSERT_TRUE(q.ok()) << spec << ": " << q.status().message();
    EXPECT_FALSE((*q)->cold_tier().enabled()) << spec;
    EXPECT_NE((*q)->spec().find(",cold=none"), std::string::npos) << (*q)->spec();
  }
  // Without cold= the other presets' keys are not shown and they have no tier.
  auto plain = parse_kv_policy("h2o:prompt_ranking=window");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->spec().find("cold"), std::string::npos);
  EXPECT_FALSE((*plain)->cold_tier().enabled());
  EXPECT_TRUE(parse_kv_policy("snapkv:cold=memory,cold_type=q8_0,cold_size=4096").ok());
  for (const char* bad :
       {"d2o:cold=none,recall=8", "h2o:recall=8", "d2o:cold=memory,recall=0", "d2o:cold=tape",
        "d2o:cold=memory,cold_type=q5", "h2o:cold=memory", "d2o:cold=memory,heads=ada",
        "d2o:heads=ada,prompt_ranking=accumulated,cold=disk",
        "d2o:prompt_ranking=accumulated,recall=8", "streaming:cold=memory"}) {
    auto r = parse_kv_policy(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
}

std::vector<TokenId> random_tokens(int n, uint32_t seed) {
  std::vector<TokenId> p;
  test::Xorshift rng(seed);
  for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  return p;
}

// Through the engine: the prompt's compaction fills the tier, a turn recalls, and every token
// stays in exactly one tier (d2o drops what it evicts: merge=off).
class ColdTierEngine : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {};

TEST_P(ColdTierEngine, ATurnRecallsAndEveryTokenIsInOneTier) {
  const std::string arch = std::get<0>(GetParam());
  const std::string place = std::get<1>(GetParam());
  test::RandomModelConfig cfg;
  cfg.arch = arch;
  cfg.n_layer = 3;
  cfg.n_embd = 64;
  cfg.n_head = 4;
  cfg.n_head_kv = 2;
  cfg.seed = 21;
  if (arch == "gemma3") {
    cfg.n_layer = 7;  // five sliding layers (no tier there), then a global one, then one more
    cfg.head_dim = 16;
    cfg.sliding_window = 16;
  }
  auto model = test::load_random_model(cfg, "cold_tier_" + arch + ".gguf");
  ASSERT_NE(model, nullptr);
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  std::shared_ptr<const KvPolicy> pol(
      parse_kv_policy("d2o:ratio=0.25,window=8,kernel=3,cold=" + place +
                      ",cold_type=f16,recall=5,recall_all_up_to=0")
          .value());
  std::shared_ptr<const KvPolicy> hot(parse_kv_policy("d2o:ratio=0.25,window=8,kernel=3").value());
  Sequence s(model->hparams(), KvType::kF16, pol), t(model->hparams(), KvType::kF16, hot);
  auto feed = [&](Sequence& seq, std::span<const TokenId> tokens, std::vector<float>* logits) {
    BatchEntry be;
    be.seq = &seq;
    be.tokens = tokens;
    return engine.forward({&be, 1}, [&](int, int, const float* l) {
      if (logits) logits->assign(l, l + model->hparams().n_vocab);
    });
  };
  const std::vector<TokenId> prompt = random_tokens(96, 3), turn = random_tokens(20, 4);
  std::vector<float> ls, lt;
  ASSERT_TRUE(feed(s, prompt, &ls).ok());
  ASSERT_TRUE(feed(t, prompt, &lt).ok());
  EXPECT_EQ(ls, lt);  // the prompt's pass and compaction are those of the same policy without it
  const KvCache& c = s.cache();
  int compressible = 0;
  for (int il = 0; il < c.n_layer(); ++il) compressible += c.config().layer_compressible(il);
  ASSERT_GT(compressible, 0);
  auto check_tiers = [&](int64_t n_past) {
    for (int il = 0; il < c.n_layer(); ++il) {
      for (int g = 0; g < c.config().n_head_kv; ++g) {
        if (!c.config().layer_compressible(il)) {
          EXPECT_EQ(c.cold()->n_slots(il, g), 0);  // a sliding window drops, it never evicts
          continue;
        }
        EXPECT_EQ(c.layer(il).n_slot(g) + c.cold()->n_slots(il, g), n_past) << il << " " << g;
      }
    }
  };
  check_tiers(96);
  EXPECT_EQ(c.cold()->recall_turns(), 0);
  ASSERT_TRUE(feed(s, turn, &ls).ok());
  ASSERT_TRUE(feed(t, turn, &lt).ok());
  EXPECT_EQ(c.cold()->recall_turns(), 1);
  EXPECT_EQ(c.cold()->recalled_slots(), int64_t{5} * compressible * 2);
  check_tiers(116);
  for (int il = 0; il < c.n_layer(); ++il)
    EXPECT_EQ(c.layer(il).n_slot(), t.cache().layer(il).n_slot());  // the same hot budget
  // Decode steps recall nothing and keep every token somewhere.
  const TokenId one = 7;
  ASSERT_TRUE(feed(s, std::span<const TokenId>(&one, 1), &ls).ok());
  EXPECT_EQ(c.cold()->recall_turns(), 1);
  check_tiers(117);
  // A copy of the sequence continues alike.
  Sequence u(model->hparams(), KvType::kF16, pol);
  ASSERT_TRUE(u.copy_from(s).ok());
  std::vector<float> lu;
  const std::vector<TokenId> turn2 = random_tokens(12, 5);
  ASSERT_TRUE(feed(s, turn2, &ls).ok());
  ASSERT_TRUE(feed(u, turn2, &lu).ok());
  EXPECT_EQ(ls, lu);
  EXPECT_EQ(u.cache().cold()->recall_turns(), 2);
}

// A small random llama model and an engine over it; feed() runs one pass of a sequence, keeping
// the last row's logits when asked.
struct SmallModel {
  SmallModel(int n_layer, uint64_t seed, const char* file) {
    test::RandomModelConfig cfg;
    cfg.n_layer = n_layer;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.seed = seed;
    model = test::load_random_model(cfg, file);
    if (model) engine = std::make_unique<Engine>(*model, pool, EngineOptions{});
  }
  Status feed(Sequence& s, std::span<const TokenId> tokens, std::vector<float>* logits = nullptr) {
    BatchEntry be;
    be.seq = &s;
    be.tokens = tokens;
    return engine->forward({&be, 1}, [&](int, int, const float* l) {
      if (logits) logits->assign(l, l + model->hparams().n_vocab);
    });
  }
  std::unique_ptr<Model> model;
  ThreadPool pool{2};
  std::unique_ptr<Engine> engine;
};

// recall_all_up_to=: while a head's tier holds at most that many slots, a turn recalls all of
// them, as a recall= covering the tier does (the same logits); one slot more, and it recalls
// `recall` ranked ones.
TEST(ColdTierEngine, ATurnRecallsTheWholeTierWhileItIsSmall) {
  ColdTierConfig cc;
  cc.recall = 5;
  cc.recall_all_up_to = 72;
  EXPECT_EQ(cc.recall_count(72), 72);
  EXPECT_EQ(cc.recall_count(73), 5);
  EXPECT_EQ(cc.recall_count(3), 3);
  EXPECT_EQ(cc.max_recall(), 72);
  cc.recall_all_up_to = 0;
  EXPECT_EQ(cc.recall_count(4), 4);
  EXPECT_EQ(cc.recall_count(6), 5);
  EXPECT_EQ(cc.max_recall(), 5);
  SmallModel m(3, 21, "cold_tier_all.gguf");
  ASSERT_NE(m.model, nullptr);
  const std::vector<TokenId> prompt = random_tokens(96, 3), turn = random_tokens(20, 4);
  // After the prompt each head's tier holds 72 slots (96 at ratio 0.25 keep 24).
  struct Run {
    std::vector<float> logits;
    int64_t recalled = 0;
  };
  auto run = [&](const std::string& keys) {
    std::shared_ptr<const KvPolicy> pol(
        parse_kv_policy("d2o:ratio=0.25,window=8,kernel=3,cold=memory,cold_type=f16," + keys)
            .value());
    Sequence s(m.model->hparams(), KvType::kF16, pol);
    Run r;
    EXPECT_TRUE(m.feed(s, prompt).ok());
    EXPECT_EQ(s.cache().cold()->n_slots(0, 0), 72);
    EXPECT_TRUE(m.feed(s, turn, &r.logits).ok());
    r.recalled = s.cache().cold()->recalled_slots();
    return r;
  };
  const int64_t heads = 3 * 2;
  const Run all = run("recall=5,recall_all_up_to=72"), covering = run("recall=1000");
  const Run bounded = run("recall=5,recall_all_up_to=71");
  EXPECT_EQ(all.recalled, 72 * heads);
  EXPECT_EQ(all.logits, covering.logits);
  EXPECT_EQ(bounded.recalled, 5 * heads);
  EXPECT_NE(bounded.logits, all.logits);
}

// recall_reach=window: the rows of a turn before its window attend without the recall, and the
// window recalls after them. In one layer nothing else reads those rows, so the turn's last row,
// the recall and what the turn's compaction keeps are those of recall_reach=turn, bit for bit;
// over three layers the rows before the window feed the later layers' keys, and the turn's
// logits move. A turn no longer than the window recalls as a whole either way.
TEST(ColdTierEngine, ARecallThatReachesTheWindowOnlyLeavesTheRowsBeforeItAsTheyWere) {
  struct Run {
    std::vector<float> logits;
    int64_t recalled = 0;
    std::vector<std::vector<int32_t>> pos;
  };
  auto run = [](SmallModel& m, const std::string& keys, int n_turn) {
    std::shared_ptr<const KvPolicy> pol(
        parse_kv_policy("d2o:ratio=0.25,window=8,kernel=3,cold=memory,cold_type=f16,recall=6,"
                        "recall_all_up_to=0" +
                        keys)
            .value());
    Sequence s(m.model->hparams(), KvType::kF16, pol);
    Run r;
    EXPECT_TRUE(m.feed(s, random_tokens(96, 5)).ok());
    EXPECT_TRUE(m.feed(s, random_tokens(n_turn, 6), &r.logits).ok());
    r.recalled = s.cache().cold()->recalled_slots();
    for (int il = 0; il < s.cache().n_layer(); ++il) {
      const KvLayer& L = s.cache().layer(il);
      for (int g = 0; g < L.n_head_kv(); ++g) r.pos.emplace_back(L.pos(g), L.pos(g) + L.n_slot(g));
    }
    return r;
  };
  EXPECT_EQ(parse_kv_policy("d2o:cold=memory,recall_reach=window")
                    .value()
                    ->spec()
                    .find("recall_reach=window") == std::string::npos,
            false);
  EXPECT_EQ(
      parse_kv_policy("d2o:cold=memory,recall_reach=turn").value()->spec().find("recall_reach"),
      std::string::npos);
  EXPECT_FALSE(parse_kv_policy("d2o:cold=none,recall_reach=window").ok());
  EXPECT_FALSE(parse_kv_policy("d2o:cold=memory,recall_reach=some").ok());
  SmallModel one(1, 31, "cold_tier_reach1.gguf");
  ASSERT_NE(one.model, nullptr);
  const Run t1 = run(one, "", 20), w1 = run(one, ",recall_reach=window", 20);
  EXPECT_EQ(t1.recalled, 6 * 2);
  EXPECT_EQ(w1.recalled, t1.recalled);
  EXPECT_EQ(w1.logits, t1.logits);
  EXPECT_EQ(w1.pos, t1.pos);
  SmallModel three(3, 32, "cold_tier_reach3.gguf");
  ASSERT_NE(three.model, nullptr);
  const Run t3 = run(three, "", 20), w3 = run(three, ",recall_reach=window", 20);
  EXPECT_EQ(w3.recalled, 3 * 6 * 2);
  EXPECT_NE(w3.logits, t3.logits);
  // A turn of the window's length has no rows before it.
  EXPECT_EQ(run(three, ",recall_reach=window", 8).logits, run(three, "", 8).logits);
}

// A turn that recalls every cold slot ranks them, with the hot ones, by the turn's own window:
// what it keeps is what the same budget keeps when the context and the turn come as one prompt
// (the question before), slot for slot.
TEST(ColdTierEngine, ATurnThatRecallsEverythingKeepsWhatTheQuestionBeforeKeeps) {
  SmallModel m(3, 23, "cold_tier_rank.gguf");
  ASSERT_NE(m.model, nullptr);
  const std::string base = "d2o:budget=24,window=8,kernel=3";
  std::shared_ptr<const KvPolicy> pol(
      parse_kv_policy(base + ",cold=memory,cold_type=f16,recall=1000").value());
  std::shared_ptr<const KvPolicy> one(parse_kv_policy(base).value());
  Sequence s(m.model->hparams(), KvType::kF16, pol), t(m.model->hparams(), KvType::kF16, one);
  auto feed = [&](Sequence& seq, std::span<const TokenId> tokens) { return m.feed(seq, tokens); };
  const std::vector<TokenId> prompt = random_tokens(96, 7), turn = random_tokens(20, 8);
  std::vector<TokenId> whole = prompt;
  whole.insert(whole.end(), turn.begin(), turn.end());
  ASSERT_TRUE(feed(s, prompt).ok());
  ASSERT_TRUE(feed(s, turn).ok());
  ASSERT_TRUE(feed(t, whole).ok());
  ASSERT_EQ(s.cache().cold()->recall_turns(), 1);
  int64_t same = 0, total = 0;
  for (int il = 0; il < s.cache().n_layer(); ++il) {
    const KvLayer& a = s.cache().layer(il);
    const KvLayer& b = t.cache().layer(il);
    for (int g = 0; g < a.n_head_kv(); ++g) {
      ASSERT_EQ(a.n_slot(g), b.n_slot(g));
      const std::vector<int32_t> pa(a.pos(g), a.pos(g) + a.n_slot(g));
      const std::vector<int32_t> pb(b.pos(g), b.pos(g) + b.n_slot(g));
      for (int32_t p : pa) same += std::count(pb.begin(), pb.end(), p);
      total += a.n_slot(g);
      EXPECT_EQ(pa, pb) << "layer " << il << " head " << g;
    }
  }
  // Ranked by nothing (no window collected), the turn would keep the oldest slots instead.
  EXPECT_EQ(same, total);
}

// A turn that recalls is compacted layer by layer, right after each layer's attention, and each
// layer hands its recalled slots' memory back before the next one recalls: the turn's peak holds
// one layer's recall, not every layer's at once (the plans are those of a compaction after the
// pass: ATurnThatRecallsEverythingKeepsWhatTheQuestionBeforeKeeps).
TEST(ColdTierEngine, ATurnHoldsOneLayersRecallAtATime) {
  SmallModel m(4, 25, "cold_tier_peak.gguf");
  ASSERT_NE(m.model, nullptr);
  std::shared_ptr<const KvPolicy> pol(
      parse_kv_policy("d2o:budget=24,window=8,kernel=3,cold=memory,cold_type=f16,recall=1000")
          .value());
  Sequence s(m.model->hparams(), KvType::kF16, pol);
  auto feed = [&](std::span<const TokenId> tokens) { return m.feed(s, tokens); };
  const std::vector<TokenId> prompt = random_tokens(192, 9), turn = random_tokens(20, 10);
  // Turns of 16 (each compacted back to the budget, each recalling what its window wants).
  for (size_t i = 0; i < prompt.size(); i += 16)
    ASSERT_TRUE(feed(std::span<const TokenId>(prompt).subspan(i, 16)).ok());
  const KvCache& c = s.cache();
  const int64_t cold = c.cold()->n_slots(0, 0), turns = c.cold()->recall_turns();
  ASSERT_GT(cold, 150);
  s.cache().reset_peak();
  const size_t before = c.peak_bytes_allocated();  // the hot slots' allocation
  ASSERT_TRUE(feed(turn).ok());
  ASSERT_EQ(c.cold()->recall_turns(), turns + 1);
  // Every layer holding its budget, the turn and every recalled slot at once, against one layer
  // at a time (each layer's allocation may grow geometrically, to twice what it holds):
  const size_t L = static_cast<size_t>(m.model->hparams().n_layer);
  const size_t all_at_once = KvCache::bytes_for_slots(c.config(), 24 + 20 + cold);
  const size_t one_at_a_time =
      before + 2 * (KvCache::bytes_for_slots(c.config(), 20) +
                    KvCache::bytes_for_slots(c.config(), 24 + 20 + cold) / L);
  std::printf(
      "turn peak %zu bytes (hot before %zu); every layer's recall at once %zu; one layer's "
      "at a time at most %zu\n",
      c.peak_bytes_allocated(), before, all_at_once, one_at_a_time);
  EXPECT_LE(c.peak_bytes_allocated(), one_at_a_time);
  EXPECT_LT(c.peak_bytes_allocated(), all_at_once);
}

// What a memory pool reserves for such a turn (Scheduler::footprint): every layer its budget and
// a pass, one layer at a time the recall (KvCache::set_slot_limit's one_layer_extra). The turn
// runs within it, and fails without the extra.
TEST(ColdTierEngine, ASlotLimitWithOneLayersRecallHoldsTheTurn) {
  SmallModel m(4, 25, "cold_tier_peak.gguf");
  ASSERT_NE(m.model, nullptr);
  std::shared_ptr<const KvPolicy> pol(
      parse_kv_policy("d2o:budget=24,window=8,kernel=3,cold=memory,cold_type=f16,recall=100,"
                      "recall_all_up_to=0")
          .value());
  const std::vector<TokenId> prompt = random_tokens(192, 9), turn = random_tokens(20, 10);
  FeedPlan plan;  // (as a prompt of 212 tokens in passes of at most 20)
  plan.n_prompt = 212;
  plan.n_total = 212;
  plan.prompt_chunk = 20;
  plan.decode_chunk = 1;
  plan.n_head_kv = 2;
  const int64_t limit = pol->peak_slots_for(plan), extra = pol->one_layer_extra_for(plan);
  EXPECT_EQ(extra, 100);
  for (const bool with_extra : {true, false}) {
    SCOPED_TRACE(with_extra);
    Sequence s(m.model->hparams(), KvType::kF16, pol);
    ASSERT_TRUE(
        s.cache()
            .set_slot_limit(static_cast<int>(limit), with_extra ? static_cast<int>(extra) : 0)
            .ok());
    auto feed = [&](std::span<const TokenId> tokens) { return m.feed(s, tokens); };
    Status st;
    for (size_t i = 0; st.ok() && i < prompt.size(); i += 16)
      st = feed(std::span<const TokenId>(prompt).subspan(i, 16));
    if (st.ok()) st = feed(turn);
    EXPECT_EQ(st.ok(), with_extra) << st.to_string();
    if (!with_extra) continue;
    EXPECT_GT(s.cache().cold()->recalled_slots(), 0);
    EXPECT_LE(s.cache().peak_bytes_allocated(),
              KvCache::bytes_for_slots(s.cache().config(), limit) +
                  KvCache::bytes_for_one_layer(s.cache().config(), extra));
  }
}

// The tier's place changes where its slots are, not which: the same conversation gives the same
// logits in memory and on disk.
TEST(ColdTierPlaces, MemoryAndDiskGiveTheSameLogits) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head_kv = 2;
  cfg.seed = 31;
  auto model = test::load_random_model(cfg, "cold_tier_places.gguf");
  ASSERT_NE(model, nullptr);
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  auto run = [&](const char* place) {
    std::shared_ptr<const KvPolicy> pol(
        parse_kv_policy(
            std::string("d2o:ratio=0.2,window=8,kernel=5,cold_type=f16,recall=7,cold=") + place)
            .value());
    Sequence s(model->hparams(), KvType::kF16, pol);
    std::vector<float> all, l;
    for (int turn = 0; turn < 4; ++turn) {
      const std::vector<TokenId> tokens = random_tokens(turn == 0 ? 300 : 24, 40 + turn);
      BatchEntry be;
      be.seq = &s;
      be.tokens = tokens;
      EXPECT_TRUE(
          engine
              .forward({&be, 1},
                       [&](int, int, const float* x) { l.assign(x, x + model->hparams().n_vocab); })
              .ok());
      all.insert(all.end(), l.begin(), l.end());
    }
    EXPECT_EQ(s.cache().cold()->recall_turns(), 3);
    return all;
  };
  EXPECT_EQ(run("memory"), run("disk"));
}

INSTANTIATE_TEST_SUITE_P(ArchsPlaces, ColdTierEngine,
                         ::testing::Combine(::testing::Values("llama", "gemma3"),
                                            ::testing::Values("memory", "disk")));

}  // namespace
}  // namespace d2o
