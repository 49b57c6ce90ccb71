// KV policies on a cache with sliding-window layers (Gemma 3's local layers): those layers are
// never compacted, and the budget rules share the total out over the global layers only, exactly
// as on a model made of the global layers alone.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "unit/kv_test_access.h"

namespace d2o {
namespace {

// n random slots in every layer, with random accumulated scores (what a prompt leaves).
void fill(KvCache& cache, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::exponential_distribution<float> ex(1.0f);
  const KvCacheConfig& c = cache.config();
  const size_t dim = static_cast<size_t>(c.n_head_kv) * c.head_dim;
  for (int il = 0; il < c.n_layer; ++il) {
    std::vector<float> k(dim * n), v(dim * n);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = i;
    ASSERT_TRUE(cache.reserve(il, n, true).ok());
    cache.append(il, k.data(), v.data(), pos.data(), n);
    KvLayer& L = KvTestAccess::layer(cache, il);
    // Layer-dependent spread, so the variance rule gives the layers different budgets.
    for (int g = 0; g < c.n_head_kv; ++g)
      for (int j = 0; j < n; ++j)
        KvTestAccess::score(L, g)[j] = ex(rng) * static_cast<float>(1 + il);
  }
}

TEST(PolicySliding, SlidingLayersKeepEverythingAndGlobalOnesShareTheBudget) {
  const int n = 200, G = 2, hd = 8;
  // Layers 0, 1, 3 and 4 sliding (window 64, as filled: no pass has dropped anything yet),
  // layers 2 and 5 global.
  const std::vector<int> windows = {64, 64, 0, 64, 64, 0};
  for (const std::string spec :
       {"d2o:reading=paper,ratio=0.25", "h2o:ratio=0.25", "streaming:ratio=0.25",
        "pyramidkv:ratio=0.25", "snapkv:ratio=0.25,window=8",
        "d2o:reading=paper,ratio=0.25,heads=ada", "snapkv:ratio=0.25,window=8,heads=ada"}) {
    SCOPED_TRACE(spec);
    auto parsed = parse_kv_policy(spec);
    ASSERT_TRUE(parsed.ok()) << parsed.status().message();
    const KvPolicy& p = **parsed;
    KvCache mixed(KvCacheConfig{6, G, hd, KvType::kF32, windows});
    fill(mixed, n, 7);
    // The same global layers alone: what the budgets must equal.
    KvCache alone(KvCacheConfig{2, G, hd, KvType::kF32});
    KvCache tmp(KvCacheConfig{6, G, hd, KvType::kF32});
    fill(tmp, n, 7);
    ASSERT_TRUE(alone.reserve(0, n, true).ok());
    ASSERT_TRUE(alone.reserve(1, n, true).ok());
    for (int i = 0; i < 2; ++i) {
      const KvLayer& S = tmp.layer(i == 0 ? 2 : 5);
      std::vector<float> k(static_cast<size_t>(G) * hd * n), v(k.size());
      std::vector<int32_t> pos(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        pos[static_cast<size_t>(j)] = j;
        for (int g = 0; g < G; ++g) {
          S.load_key(g, j, k.data() + (static_cast<size_t>(j) * G + g) * hd);
          S.load_value(g, j, v.data() + (static_cast<size_t>(j) * G + g) * hd);
        }
      }
      alone.append(i, k.data(), v.data(), pos.data(), n);
      KvLayer& A = KvTestAccess::layer(alone, i);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < n; ++j) KvTestAccess::score(A, g)[j] = S.score(g)[j];
    }
    PassInfo pi;
    pi.n_tokens = n;
    pi.n_past = n;
    pi.first_pass = true;
    PolicyState sm, sa;
    ASSERT_TRUE(p.compact(mixed, sm, pi).ok());
    ASSERT_TRUE(p.compact(alone, sa, pi).ok());
    ASSERT_EQ(sm.budgets.size(), 6u);
    ASSERT_EQ(sa.budgets.size(), 2u);
    for (int il : {0, 1, 3, 4}) {
      EXPECT_EQ(sm.budgets[static_cast<size_t>(il)], PolicyState::kNoBudget) << il;
      EXPECT_EQ(mixed.layer(il).n_slot(), n) << il;
      EXPECT_TRUE(mixed.layer(il).uniform()) << il;
    }
    EXPECT_EQ(sm.budgets[2], sa.budgets[0]);
    EXPECT_EQ(sm.budgets[5], sa.budgets[1]);
    EXPECT_LT(mixed.layer(2).n_slot(), n);
    for (int i = 0; i < 2; ++i) {
      const KvLayer& M = mixed.layer(i == 0 ? 2 : 5);
      const KvLayer& A = alone.layer(i);
      ASSERT_EQ(M.n_slot(), A.n_slot());
      for (int g = 0; g < G; ++g) {
        ASSERT_EQ(M.n_slot(g), A.n_slot(g));
        for (int j = 0; j < M.n_slot(g); ++j)
          EXPECT_EQ(M.pos(g)[j], A.pos(g)[j]) << i << "," << g << "," << j;
      }
    }
  }
}

TEST(PolicySliding, PositionShiftIsRefusedWithSlidingLayers) {
  KvCache cache(KvCacheConfig{2, 1, 8, KvType::kF32, {16, 0}});
  fill(cache, 40, 3);
  auto p = parse_kv_policy("streaming:budget=8,pos=shift");
  ASSERT_TRUE(p.ok()) << p.status().message();
  PolicyState st;
  PassInfo pi;
  pi.n_tokens = 40;
  pi.n_past = 40;
  pi.first_pass = true;
  const Status s = (*p)->compact(cache, st, pi);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sliding-window"), std::string::npos) << s.message();
}

// After a long pass, settle_sliding() drops from a sliding-window layer exactly what the next
// pass would have dropped first, and hands back the memory above the layer's steady capacity;
// the global layer is untouched. Whatever the next pass (one token, or a chunk), the layer then
// holds the same slots in the same order as without it.
TEST(PolicySliding, SettleDropsWhatTheNextPassWould) {
  const int G = 2, hd = 8, W = 16, n = 200;
  const KvCacheConfig cfg{2, G, hd, KvType::kF32, {W, 0}};
  for (int next : {1, 100}) {
    SCOPED_TRACE(next);
    KvCache settled(cfg), lazy(cfg);
    fill(settled, n, 3);
    fill(lazy, n, 3);
    ASSERT_TRUE(settled.settle_sliding().ok());
    EXPECT_EQ(settled.layer(0).n_slot(), W - 1);
    EXPECT_LE(settled.kv_bytes_allocated(), lazy.kv_bytes_allocated());
    EXPECT_EQ(settled.layer(1).n_slot(), n);  // global layers keep everything
    for (KvCache* c : {&settled, &lazy}) c->drop_oldest(0, next);
    ASSERT_EQ(settled.layer(0).n_slot(), lazy.layer(0).n_slot());
    for (int h = 0; h < G; ++h) {
      for (int j = 0; j < W - 1; ++j)
        EXPECT_EQ(settled.layer(0).pos(h)[j], lazy.layer(0).pos(h)[j])
            << "head " << h << " slot " << j;
    }
  }
  // A layer already within its steady capacity is left as it is.
  KvCache small(cfg);
  fill(small, W + 10, 4);
  ASSERT_TRUE(small.settle_sliding().ok());
  EXPECT_EQ(small.layer(0).n_slot(), W + 10);
}

}  // namespace
}  // namespace d2o
