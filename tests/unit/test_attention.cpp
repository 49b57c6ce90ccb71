// Attention with statistics vs a plain double-precision reference; bit-identical results for any
// thread count; MHA, GQA and MQA; F32 and F16 storage; multi-tile and multi-block chunks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kv/attention.h"
#include "kv/attention_kernels.h"
#include "kv/kv_cache.h"
#include "unit/kv_test_access.h"

namespace d2o {
namespace {

struct Case {
  int n_head, n_head_kv, head_dim, n_old, n_tok;
  KvType type;
  ScoreAgg agg;
  int window_first;
  bool mass = false;  // proportional attention over random merged counts
  int sliding = 0;    // AttnInput::window (sliding-window attention)
};

// Fills a cache layer with n_old + n_tok random slots; returns the queries.
std::vector<float> fill(KvCache& cache, const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int kv_dim = c.n_head_kv * c.head_dim;
  const int total = c.n_old + c.n_tok;
  std::vector<float> k(static_cast<size_t>(total) * kv_dim), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  std::vector<int32_t> pos(static_cast<size_t>(total));
  for (int i = 0; i < total; ++i) pos[static_cast<size_t>(i)] = i;
  EXPECT_TRUE(cache.reserve(0, total, true).ok());
  cache.append(0, k.data(), v.data(), pos.data(), total);
  // Some prior statistics, so accumulation (not assignment) is checked.
  KvLayer& L = KvTestAccess::layer(cache, 0);
  for (int g = 0; g < c.n_head_kv; ++g)
    for (int j = 0; j < total; ++j)
      KvTestAccess::score(L, g)[j] = 0.25f * static_cast<float>(j % 3);
  // Merged counts (read only with mass=on): most slots plain, some standing for many tokens.
  for (int g = 0; g < c.n_head_kv; ++g)
    for (int j = 0; j < total; ++j)
      KvTestAccess::merged(L, g)[j] = (j * 7 + g) % 5 == 0 ? j % 40 : 0;
  std::vector<float> q(static_cast<size_t>(c.n_tok) * c.n_head * c.head_dim);
  for (auto& x : q) x = 2.0f * nd(rng);  // sharper distributions
  return q;
}

void run_case(const Case& c) {
  SCOPED_TRACE("H=" + std::to_string(c.n_head) + " G=" + std::to_string(c.n_head_kv) +
               " old=" + std::to_string(c.n_old) + " tok=" + std::to_string(c.n_tok) +
               " agg=" + score_agg_name(c.agg) + " sliding=" + std::to_string(c.sliding));
  KvCacheConfig cfg{1, c.n_head_kv, c.head_dim, c.type};
  KvCache ref_cache(cfg), cache(cfg);
  auto q = fill(ref_cache, c, 7);
  fill(cache, c, 7);
  AttnStatsRequest req;
  req.accumulate = true;
  req.agg = c.agg;
  req.window_first = c.window_first;
  req.mass = c.mass;
  const size_t out_n = static_cast<size_t>(c.n_tok) * c.n_head * c.head_dim;
  std::vector<float> out_ref(out_n), out(out_n);
  AttnInput in{q.data(), out_ref.data(), c.n_tok, c.n_head,
               1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  in.window = c.sliding;
  attention_reference(in, ref_cache.layer_for_attention(0), req);

  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    SCOPED_TRACE(kernel_isa_name(isa));
    std::vector<float> first_out, first_score, first_window;
    for (int threads : {1, 2, 3}) {
      KvCache run_cache(cfg);
      fill(run_cache, c, 7);
      ThreadPool pool(threads);
      AttnScratch scratch;
      in.out = out.data();
      attention_forward_isa(in, run_cache.layer_for_attention(0), req, pool, scratch, isa);
      const KvLayer& L = run_cache.layer(0);
      const KvLayer& R = ref_cache.layer(0);
      for (size_t i = 0; i < out_n; ++i)
        ASSERT_NEAR(out[i], out_ref[i], 2e-5f * (1.0f + std::fabs(out_ref[i]))) << i;
      std::vector<float> score, window;
      for (int g = 0; g < c.n_head_kv; ++g) {
        for (int j = 0; j < L.n_slot(); ++j) {
          ASSERT_NEAR(L.score(g)[j], R.score(g)[j], 1e-5f * (1.0f + R.score(g)[j]))
              << g << "," << j;
          ASSERT_NEAR(L.window(g)[j], R.window(g)[j], 1e-5f) << g << "," << j;
          score.push_back(L.score(g)[j]);
          window.push_back(L.window(g)[j]);
        }
      }
      if (threads == 1) {
        first_out = out;
        first_score = score;
        first_window = window;
      } else {
        EXPECT_EQ(out, first_out) << "output differs between 1 and " << threads << " threads";
        EXPECT_EQ(score, first_score);
        EXPECT_EQ(window, first_window);
      }
    }
  }
}

TEST(Attention, MatchesReferenceAcrossLayouts) {
  const std::vector<Case> cases = {
      {4, 4, 16, 0, 1, KvType::kF32, ScoreAgg::kSum, 1 << 30},     // MHA, first token
      {4, 4, 16, 10, 5, KvType::kF32, ScoreAgg::kSum, 2},          // MHA chunk with window
      {6, 2, 32, 300, 1, KvType::kF32, ScoreAgg::kSum, 0},         // GQA decode over 2 tiles
      {6, 2, 32, 0, 37, KvType::kF16, ScoreAgg::kMean, 30},        // GQA prefill, 3 query blocks
      {4, 1, 64, 513, 20, KvType::kF16, ScoreAgg::kMax, 1 << 30},  // MQA, multi-tile, 2 blocks
      {9, 3, 64, 700, 3, KvType::kF16, ScoreAgg::kSum, 1},         // SmolLM2 shape
      {8, 2, 128, 40, 17, KvType::kF16, ScoreAgg::kSum, 5},        // head_dim 128
      {4, 1, 256, 30, 6, KvType::kF32, ScoreAgg::kMean, 2},        // Gemma-like MQA, head_dim 256
      {2, 2, 24, 5, 7, KvType::kF16, ScoreAgg::kMax, 0},           // odd head_dim (scalar path)
  };
  for (const Case& c : cases) run_case(c);
}

// Proportional attention (D2O mass=on): log(1 + merged) added to each slot's logit.
TEST(Attention, MassBiasMatchesReference) {
  const std::vector<Case> cases = {
      {6, 2, 32, 300, 1, KvType::kF32, ScoreAgg::kSum, 0, true},   // decode over 2 tiles
      {9, 3, 64, 700, 3, KvType::kF16, ScoreAgg::kSum, 1, true},   // SmolLM2 shape
      {4, 1, 64, 513, 20, KvType::kF16, ScoreAgg::kMax, 5, true},  // MQA, 2 query blocks
      {2, 2, 24, 5, 7, KvType::kF32, ScoreAgg::kMean, 0, true},    // odd head_dim
  };
  for (const Case& c : cases) run_case(c);
}

// Sliding-window attention (Gemma 3's local layers): each query sees its last `window` slots. Some
// rows see nothing of the first chunks of slots (1000 old slots, window 8: three whole tiles
// masked), others a part of a tile; statistics of masked slots stay untouched.
TEST(Attention, SlidingWindowMatchesReference) {
  const std::vector<Case> cases = {
      {4, 2, 32, 300, 40, KvType::kF32, ScoreAgg::kSum, 30, false, 50},   // window inside a tile
      {4, 1, 256, 575, 1, KvType::kF16, ScoreAgg::kSum, 0, false, 512},  // Gemma decode
      {4, 1, 256, 511, 512, KvType::kF16, ScoreAgg::kSum, 500, false, 512},  // Gemma prefill
      {6, 2, 32, 0, 700, KvType::kF32, ScoreAgg::kMean, 1 << 30, false, 300},  // masked tiles
      {4, 4, 16, 1000, 20, KvType::kF32, ScoreAgg::kMax, 3, false, 8},      // 3 tiles masked
      {2, 2, 24, 5, 7, KvType::kF16, ScoreAgg::kSum, 0, false, 3},          // odd head_dim
      // Gemma 3's window and grouping in passes longer than the window, after another pass (the
      // masking does not depend on the head size: 64 rather than 256 keeps the reference fast).
      {4, 1, 64, 0, 600, KvType::kF16, ScoreAgg::kSum, 1 << 30, false, 512},
      {4, 1, 64, 511, 424, KvType::kF16, ScoreAgg::kSum, 1 << 30, false, 512},
      {4, 1, 64, 513, 512, KvType::kF16, ScoreAgg::kSum, 1 << 30, false, 512},
      {4, 1, 64, 0, 1024, KvType::kF16, ScoreAgg::kSum, 1 << 30, false, 512},
  };
  for (const Case& c : cases) run_case(c);
}

// Dropping the slots no query can see any more (KvCache::drop_oldest) changes nothing: attention
// over the dropped layer equals attention over the whole one, and the kept slots keep their
// positions and statistics.
TEST(Attention, SlidingWindowDropOldestKeepsResults) {
  const int W = 16, H = 4, G = 2, hd = 32;
  KvCacheConfig cfg{1, G, hd, KvType::kF32, {W}};
  const Case c{H, G, hd, 200, 1, KvType::kF32, ScoreAgg::kSum, 0, false, W};
  KvCache whole(cfg), dropped(cfg);
  const auto q = fill(whole, c, 11);  // 201 slots: positions 0..200, the query's own last
  const KvLayer& Wl = whole.layer(0);
  auto row = [&](int j, std::vector<float>* k, std::vector<float>* v) {
    k->resize(static_cast<size_t>(G) * hd);
    v->resize(k->size());
    for (int g = 0; g < G; ++g) {
      Wl.load_key(g, j, k->data() + g * hd);
      Wl.load_value(g, j, v->data() + g * hd);
    }
  };
  std::vector<float> k, v;
  ASSERT_TRUE(dropped.reserve(0, 200, true).ok());
  for (int32_t j = 0; j < 200; ++j) {
    row(j, &k, &v);
    dropped.append(0, k.data(), v.data(), &j, 1);
  }
  // Before the one-token pass of position 200: keep the W - 1 newest slots.
  const KvLayer& D = dropped.layer(0);
  EXPECT_EQ(dropped.drop_oldest(0, 1), 200 - (W - 1));
  ASSERT_EQ(D.n_slot(), W - 1);
  for (int j = 0; j < W - 1; ++j) EXPECT_EQ(D.pos(1)[j], 200 - (W - 1) + j);
  EXPECT_EQ(dropped.drop_oldest(0, 1), 0) << "within its capacity: nothing to drop";
  row(200, &k, &v);
  const int32_t p = 200;
  ASSERT_TRUE(dropped.reserve(0, W, false).ok());
  dropped.append(0, k.data(), v.data(), &p, 1);
  std::vector<float> out_whole(static_cast<size_t>(H) * hd), out_drop(out_whole.size());
  ThreadPool pool(1);
  AttnScratch sc;
  AttnInput in{q.data(), out_whole.data(), 1, H, 1.0f / std::sqrt(static_cast<float>(hd))};
  in.window = W;
  attention_forward(in, whole.layer_for_attention(0), AttnStatsRequest{}, pool, sc);
  in.out = out_drop.data();
  attention_forward(in, dropped.layer_for_attention(0), AttnStatsRequest{}, pool, sc);
  for (size_t i = 0; i < out_whole.size(); ++i)
    EXPECT_NEAR(out_drop[i], out_whole[i], 1e-6f * (1.0f + std::fabs(out_whole[i]))) << i;
}

// The bias must matter: with many merged tokens behind a slot, its probability rises.
TEST(Attention, MassBiasRaisesMergedSlots) {
  const Case c{4, 1, 16, 30, 1, KvType::kF32, ScoreAgg::kSum, 0};
  KvCacheConfig cfg{1, c.n_head_kv, c.head_dim, c.type};
  KvCache a(cfg), b(cfg);
  auto q = fill(a, c, 3);
  fill(b, c, 3);
  for (KvCache* k : {&a, &b}) {
    KvLayer& L = KvTestAccess::layer(*k, 0);
    std::fill_n(KvTestAccess::merged(L, 0), L.n_slot(), 0);
    std::fill_n(KvTestAccess::score(L, 0), L.n_slot(), 0.0f);
    KvTestAccess::merged(L, 0)[5] = 63;  // slot 5 stands for 64 tokens
  }
  AttnStatsRequest off, on;
  off.accumulate = on.accumulate = true;
  on.mass = true;
  std::vector<float> out(static_cast<size_t>(c.n_head) * c.head_dim);
  AttnInput in{q.data(), out.data(), 1, c.n_head, 0.25f};
  attention_reference(in, a.layer_for_attention(0), off);
  attention_reference(in, b.layer_for_attention(0), on);
  const float pa = a.layer(0).score(0)[5], pb = b.layer(0).score(0)[5];
  // p' = 64 p / (1 + 63 p) for each query head: strictly larger unless p is 0 or 1.
  EXPECT_GT(pb, pa * 1.5f);
}

TEST(Attention, ColumnSumsOfACausalPrefillAddUpToTheQueryCount) {
  // Each query's probabilities sum to 1, so after a prefill of n tokens the column sums of one
  // KV head (sum aggregation over its group of g heads) add up to n * g.
  const int n = 300, H = 6, G = 2, hd = 16;
  KvCacheConfig cfg{1, G, hd, KvType::kF32};
  KvCache cache(cfg);
  Case c{H, G, hd, 0, n, KvType::kF32, ScoreAgg::kSum, 1 << 30};
  auto q = fill(cache, c, 3);
  KvLayer& L = KvTestAccess::layer(cache, 0);
  for (int g = 0; g < L.n_head_kv(); ++g)
    std::fill_n(KvTestAccess::score(L, g), L.capacity(), 0.0f);
  std::vector<float> out(static_cast<size_t>(n) * H * hd);
  ThreadPool pool(2);
  AttnScratch scratch;
  AttnStatsRequest req;
  req.accumulate = true;
  attention_forward({q.data(), out.data(), n, H, 0.25f}, L, req, pool, scratch);
  for (int g = 0; g < G; ++g) {
    double s = 0;
    for (int j = 0; j < n; ++j) s += L.score(g)[j];
    EXPECT_NEAR(s, n * (H / G), 1e-2);
    // The first slot is seen by every query, the last only by itself.
    EXPECT_GT(L.score(g)[0], 0.0f);
  }
}

TEST(Attention, StatisticsDoNotChangeTheOutput) {
  Case c{6, 2, 32, 100, 9, KvType::kF16, ScoreAgg::kSum, 3};
  KvCacheConfig cfg{1, 2, 32, KvType::kF16};
  KvCache a(cfg), b(cfg);
  auto q = fill(a, c, 11);
  fill(b, c, 11);
  std::vector<float> oa(static_cast<size_t>(9) * 6 * 32), ob(oa.size());
  ThreadPool pool(2);
  AttnScratch s1, s2;
  AttnStatsRequest none, all;
  all.accumulate = true;
  all.window_first = 3;
  attention_forward({q.data(), oa.data(), 9, 6, 0.17f}, a.layer_for_attention(0), none, pool, s1);
  attention_forward({q.data(), ob.data(), 9, 6, 0.17f}, b.layer_for_attention(0), all, pool, s2);
  EXPECT_EQ(oa, ob);
}

// A compaction moves the window statistics an attention pass left with their slots (the cache
// moves the window entries only once a pass has accumulated them).
TEST(Attention, WindowStatisticsMoveWithTheirSlots) {
  const int H = 6, G = 2, hd = 32, n_old = 40, n_tok = 8;
  Case c{H, G, hd, n_old, n_tok, KvType::kF16, ScoreAgg::kSum, 0};
  KvCacheConfig cfg{1, G, hd, KvType::kF16};
  KvCache cache(cfg);
  auto q = fill(cache, c, 13);
  std::vector<float> out(static_cast<size_t>(n_tok) * H * hd);
  ThreadPool pool(2);
  AttnScratch scratch;
  AttnStatsRequest req;
  req.window_first = 0;
  attention_forward({q.data(), out.data(), n_tok, H, 0.17f}, cache.layer_for_attention(0), req,
                    pool, scratch);
  const KvLayer& L = cache.layer(0);
  const int n = L.n_slot();
  std::vector<std::vector<float>> before(G);
  for (int g = 0; g < G; ++g) {
    before[static_cast<size_t>(g)].assign(L.window(g), L.window(g) + n);
    ASSERT_GT(before[static_cast<size_t>(g)][static_cast<size_t>(n - 1)], 0.0f);
  }
  // Each head evicts one slot in the middle (a decode step's plan) and a different one.
  CompactionPlan plan;
  plan.reset(G, n - 1);
  for (int g = 0; g < G; ++g) {
    const int evicted = 10 + 7 * g;
    int32_t* keep = plan.keep_of(g);
    for (int j = 0, o = 0; j < n; ++j)
      if (j != evicted) keep[o++] = j;
  }
  cache.apply(0, plan);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < n - 1; ++i)
      ASSERT_EQ(L.window(g)[i],
                before[static_cast<size_t>(g)][static_cast<size_t>(plan.keep_of(g)[i])])
          << g << "," << i;
}

// The score kernels have several register layouts (few rows with keys in registers, many rows over
// F32 keys from memory, a one-key tail); they must give the same bits for a row whatever layout
// computed it, or a query's output would depend on how many rows shared its call.
TEST(Attention, ScoreLayoutsAgreeBitForBit) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    const attn::Kernels& k = attn::kernels_for(isa);
    for (int hd : {32, 64, 128, 256, 512}) {
      SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " hd=" + std::to_string(hd));
      const int n_keys = 83, n_rows = 13;  // odd sizes: every tail runs
      std::vector<float> keys(static_cast<size_t>(n_keys) * hd),
          q(static_cast<size_t>(n_rows) * hd);
      for (auto& x : keys) x = nd(rng);
      for (auto& x : q) x = nd(rng);
      attn::KvRows rows{reinterpret_cast<const uint8_t*>(keys.data()), sizeof(float) * hd,
                        KvElemType::kF32};
      std::vector<float> all(static_cast<size_t>(n_rows) * n_keys), one(all.size());
      std::vector<const float*> qp(n_rows);
      std::vector<float*> sp(n_rows), op(n_rows);
      for (int r = 0; r < n_rows; ++r) {
        qp[r] = q.data() + static_cast<size_t>(r) * hd;
        sp[r] = all.data() + static_cast<size_t>(r) * n_keys;
        op[r] = one.data() + static_cast<size_t>(r) * n_keys;
      }
      k.scores(qp.data(), n_rows, rows, n_keys, hd, 0.3f, sp.data());
      for (int r = 0; r < n_rows; ++r) {
        // One row at a time, keys in pieces of 5 (the tail paths).
        for (int j = 0; j < n_keys; j += 5) {
          attn::KvRows part = rows;
          part.base += static_cast<size_t>(j) * rows.row_bytes;
          float* dst = op[r] + j;
          k.scores(&qp[r], 1, part, std::min(5, n_keys - j), hd, 0.3f, &dst);
        }
      }
      EXPECT_EQ(all, one);
    }
  }
}

// The values product also has several layouts (whole rows in registers for few rows, column
// slices shared by several rows for many); a row's output must have the same bits in each.
TEST(Attention, ValueLayoutsAgreeBitForBit) {
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    const attn::Kernels& k = attn::kernels_for(isa);
    for (int hd : {32, 64, 128, 256, 512}) {
      SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " hd=" + std::to_string(hd));
      const int n_keys = 83, n_rows = 13;
      std::vector<float> vals(static_cast<size_t>(n_keys) * hd),
          p(static_cast<size_t>(n_rows) * n_keys);
      for (auto& x : vals) x = nd(rng);
      for (auto& x : p) x = std::abs(nd(rng));
      attn::KvRows rows{reinterpret_cast<const uint8_t*>(vals.data()), sizeof(float) * hd,
                        KvElemType::kF32};
      std::vector<float> all(static_cast<size_t>(n_rows) * hd), one(all.size());
      std::vector<const float*> pp(n_rows);
      std::vector<float*> ap(n_rows), op(n_rows);
      for (int r = 0; r < n_rows; ++r) {
        pp[r] = p.data() + static_cast<size_t>(r) * n_keys;
        ap[r] = all.data() + static_cast<size_t>(r) * hd;
        op[r] = one.data() + static_cast<size_t>(r) * hd;
      }
      k.pv(pp.data(), n_rows, rows, n_keys, hd, ap.data());
      for (int r = 0; r < n_rows; ++r) k.pv(&pp[r], 1, rows, n_keys, hd, &op[r]);
      EXPECT_EQ(all, one);
    }
  }
}

// Head size 512 (Gemma 4's global layers) at every kernel level: the scores and the values
// product within float rounding of the scalar kernels' (the SIMD levels sum in lanes).
TEST(Attention, HeadSize512RunsAtEveryLevel) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hd = 512, n_keys = 37, n_rows = 5;
  std::vector<float> kv(static_cast<size_t>(n_keys) * hd), q(static_cast<size_t>(n_rows) * hd),
      p(static_cast<size_t>(n_rows) * n_keys);
  for (auto& x : kv) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  for (auto& x : p) x = std::abs(nd(rng));
  attn::KvRows rows{reinterpret_cast<const uint8_t*>(kv.data()), sizeof(float) * hd,
                    KvElemType::kF32};
  auto run = [&](const attn::Kernels& k, std::vector<float>& s, std::vector<float>& o) {
    s.assign(static_cast<size_t>(n_rows) * n_keys, 0.0f);
    o.assign(static_cast<size_t>(n_rows) * hd, 0.0f);
    std::vector<const float*> qp(n_rows), pp(n_rows);
    std::vector<float*> sp(n_rows), op(n_rows);
    for (int r = 0; r < n_rows; ++r) {
      qp[r] = q.data() + static_cast<size_t>(r) * hd;
      pp[r] = p.data() + static_cast<size_t>(r) * n_keys;
      sp[r] = s.data() + static_cast<size_t>(r) * n_keys;
      op[r] = o.data() + static_cast<size_t>(r) * hd;
    }
    k.scores(qp.data(), n_rows, rows, n_keys, hd, 0.3f, sp.data());
    k.pv(pp.data(), n_rows, rows, n_keys, hd, op.data());
  };
  std::vector<float> s0, o0;
  run(attn::kernels_for(KernelIsa::kScalar), s0, o0);
  for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    std::vector<float> s, o;
    run(attn::kernels_for(isa), s, o);
    for (size_t i = 0; i < s.size(); ++i)
      ASSERT_NEAR(s[i], s0[i], 1e-5f * (1.0f + std::abs(s0[i])))
          << kernel_isa_name(isa) << " " << i;
    for (size_t i = 0; i < o.size(); ++i)
      ASSERT_NEAR(o[i], o0[i], 1e-5f * (1.0f + std::abs(o0[i])))
          << kernel_isa_name(isa) << " " << i;
  }
}

// A query's output must not depend on how the tokens were grouped into passes, nor on the thread
// count (the same query in a one-pass prompt, a chunked prompt or a decode step), and statistics
// must not either when passes start on query-block boundaries (their column sums are added per
// block of queries).
TEST(Attention, ResultsDoNotDependOnPassesOrThreads) {
  const int H = 9, G = 3, hd = 64, n_old = 300, n_new = 70;
  for (KvType type : {KvType::kF16, KvType::kF32}) {
    Case c{H, G, hd, n_old, n_new, type, ScoreAgg::kSum, 1 << 30};
    KvCacheConfig cfg{1, G, hd, type};
    struct Run {
      std::vector<int> passes;
      int threads;
      bool aligned;  // passes start on multiples of the query block
    };
    const std::vector<Run> runs = {{{70}, 1, true},
                                   {{70}, 2, true},
                                   {{16, 32, 22}, 2, true},
                                   {{16, 16, 16, 16, 6}, 3, true},
                                   {{1, 5, 17, 3, 44}, 2, false},
                                   {std::vector<int>(70, 1), 2, false}};
    std::vector<float> out0, score0;
    for (const Run& run : runs) {
      KvCache cache(cfg);
      auto q = fill(cache, c, 9);
      KvLayer& L = KvTestAccess::layer(cache, 0);
      std::vector<float> out(static_cast<size_t>(n_new) * H * hd);
      ThreadPool pool(run.threads);
      AttnScratch scratch;
      AttnStatsRequest req;
      req.accumulate = true;
      int done = 0;
      for (int n : run.passes) {
        KvTestAccess::set_n_slot(L, n_old + done + n);  // the pass's keys are the last n slots
        AttnInput in{q.data() + static_cast<size_t>(done) * H * hd,
                     out.data() + static_cast<size_t>(done) * H * hd, n, H, 0.125f};
        attention_forward(in, L, req, pool, scratch);
        done += n;
      }
      const float* s0 = KvTestAccess::score(L, 0);  // [n_head_kv, capacity]
      std::vector<float> score(s0, s0 + static_cast<size_t>(L.n_head_kv()) * L.capacity());
      if (out0.empty()) {
        out0 = out;
        score0 = score;
        continue;
      }
      EXPECT_EQ(out, out0) << "passes " << run.passes.size() << ", " << run.threads << " threads";
      if (run.aligned) {
        EXPECT_EQ(score, score0) << "passes " << run.passes.size() << ", " << run.threads
                                 << " threads";
      }
    }
  }
}

}  // namespace
}  // namespace d2o
