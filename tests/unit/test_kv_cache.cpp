// KvCache: append, growth, and the one mutator apply(plan) checked against plain loops.
#include <gtest/gtest.h>

#include <random>

#include "kv/kv_cache.h"
#include "unit/kv_test_access.h"

namespace d2o {
namespace {

constexpr int kHeads = 2, kDim = 8;

// Appends n tokens whose key element d of head h is 1000*h + 10*pos + d (value: negated).
void append_tokens(KvCache& c, int il, int first_pos, int n) {
  std::vector<float> k(static_cast<size_t>(n) * kHeads * kDim), v(k.size());
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) {
    pos[static_cast<size_t>(t)] = first_pos + t;
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d) {
        const size_t i = (static_cast<size_t>(t) * kHeads + h) * kDim + d;
        k[i] = 1000.0f * h + 10.0f * (first_pos + t) + d;
        v[i] = -k[i];
      }
  }
  ASSERT_TRUE(c.reserve(il, c.layer(il).n_slot() + n, false).ok());
  c.append(il, k.data(), v.data(), pos.data(), n);
}

TEST(KvCache, AppendStoresPerHeadRowsAndPositions) {
  for (KvType type : {KvType::kF32, KvType::kF16}) {
    KvCache c({2, kHeads, kDim, type});
    append_tokens(c, 1, 0, 5);
    append_tokens(c, 1, 5, 3);
    const KvLayer& L = c.layer(1);
    EXPECT_EQ(L.n_slot(), 8);
    EXPECT_EQ(c.layer(0).n_slot(), 0);
    std::vector<float> row(kDim);
    for (int h = 0; h < kHeads; ++h)
      for (int j = 0; j < 8; ++j) {
        L.load_key(h, j, row.data());
        EXPECT_EQ(row[3], 1000.0f * h + 10.0f * j + 3);
        L.load_value(h, j, row.data());
        EXPECT_EQ(row[0], -(1000.0f * h + 10.0f * j));
        EXPECT_EQ(L.pos(h)[j], j);
      }
    EXPECT_EQ(c.kv_bytes_used(), c.full_kv_bytes(8) / 2);  // one of two layers filled
  }
}

TEST(KvCache, GrowthIsGeometricAndKeepsContents) {
  KvCache c({1, kHeads, kDim, KvType::kF32});
  int reallocs = 0, last_cap = 0;
  for (int t = 0; t < 2000; ++t) {
    append_tokens(c, 0, t, 1);
    if (c.layer(0).capacity() != last_cap) {
      ++reallocs;
      last_cap = c.layer(0).capacity();
    }
  }
  EXPECT_LE(reallocs, 8);
  std::vector<float> row(kDim);
  c.layer(0).load_key(1, 1999, row.data());
  EXPECT_EQ(row[1], 1000.0f + 19990.0f + 1);
  ASSERT_TRUE(c.shrink_to_fit(0).ok());
  EXPECT_EQ(c.layer(0).capacity(), 2000);
  EXPECT_EQ(c.kv_bytes_allocated(), c.kv_bytes_used());
}

TEST(KvCache, ApplyGathersAndMergesLikePlainLoops) {
  KvCache c({1, kHeads, kDim, KvType::kF32});
  append_tokens(c, 0, 0, 10);
  KvLayer& L = KvTestAccess::layer(c, 0);
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < 10; ++j) KvTestAccess::score(L, h)[j] = static_cast<float>(j + 1);

  CompactionPlan plan;
  plan.reset(kHeads, 4);
  const int keep0[4] = {0, 3, 7, 9};  // head 0
  const int keep1[4] = {1, 2, 8, 9};  // head 1: different tokens, same count
  for (int i = 0; i < 4; ++i) {
    plan.keep_of(0)[i] = keep0[i];
    plan.keep_of(1)[i] = keep1[i];
  }
  // head 0: slot 3 absorbs 4 and 5; head 1: slot 8 absorbs 0.
  plan.merges = {{0, 3, 3, 0.5f}, {0, 3, 4, 0.3f}, {0, 3, 5, 0.2f}, {1, 8, 8, 0.9f}, {1, 8, 0, 0.1f}};
  c.apply(0, plan);

  EXPECT_EQ(L.n_slot(), 4);
  std::vector<float> row(kDim);
  auto key = [&](int h, int pos, int d) { return 1000.0f * h + 10.0f * pos + d; };
  // Head 0, new slot 1 = old 3 merged with 4 and 5.
  L.load_key(0, 1, row.data());
  for (int d = 0; d < kDim; ++d) EXPECT_NEAR(row[d], 0.5f * key(0, 3, d) + 0.3f * key(0, 4, d) + 0.2f * key(0, 5, d), 1e-3f);
  L.load_value(0, 1, row.data());
  EXPECT_NEAR(row[2], -(0.5f * key(0, 3, 2) + 0.3f * key(0, 4, 2) + 0.2f * key(0, 5, 2)), 1e-3f);
  EXPECT_EQ(L.pos(0)[1], 3);                  // position of the retained slot
  EXPECT_FLOAT_EQ(L.score(0)[1], 4 + 5 + 6);  // mass conserved
  EXPECT_EQ(L.merged(0)[1], 2);
  // Unmerged kept slots are moved intact.
  L.load_key(0, 2, row.data());
  EXPECT_EQ(row[5], key(0, 7, 5));
  EXPECT_EQ(L.pos(0)[3], 9);
  // Head 1.
  L.load_key(1, 2, row.data());
  EXPECT_NEAR(row[0], 0.9f * key(1, 8, 0) + 0.1f * key(1, 0, 0), 1e-3f);
  EXPECT_EQ(L.pos(1)[0], 1);
  EXPECT_EQ(L.merged(1)[2], 1);
  EXPECT_FLOAT_EQ(L.score(1)[2], 9 + 1);
}

TEST(KvCache, KeepOwnScoreWhenAsked) {
  KvCache c({1, kHeads, kDim, KvType::kF16});
  append_tokens(c, 0, 0, 3);
  KvLayer& L = KvTestAccess::layer(c, 0);
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < 3; ++j) KvTestAccess::score(L, h)[j] = 1.0f + j;
  CompactionPlan plan;
  plan.reset(kHeads, 2);
  for (int h = 0; h < kHeads; ++h) {
    plan.keep_of(h)[0] = 0;
    plan.keep_of(h)[1] = 2;
  }
  plan.merges = {{0, 2, 2, 0.6f}, {0, 2, 1, 0.4f}};
  plan.merged_score = MergedScore::kKeep;
  c.apply(0, plan);
  EXPECT_FLOAT_EQ(L.score(0)[1], 3.0f);
}

}  // namespace
}  // namespace d2o
