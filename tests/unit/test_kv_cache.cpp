// KvCache: append, growth, and the one mutator apply(plan) checked against plain loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

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
  plan.merges = {
      {0, 3, 3, 0.5f}, {0, 3, 4, 0.3f}, {0, 3, 5, 0.2f}, {1, 8, 8, 0.9f}, {1, 8, 0, 0.1f}};
  c.apply(0, plan);

  EXPECT_EQ(L.n_slot(), 4);
  std::vector<float> row(kDim);
  auto key = [&](int h, int pos, int d) { return 1000.0f * h + 10.0f * pos + d; };
  // Head 0, new slot 1 = old 3 merged with 4 and 5.
  L.load_key(0, 1, row.data());
  for (int d = 0; d < kDim; ++d)
    EXPECT_NEAR(row[d], 0.5f * key(0, 3, d) + 0.3f * key(0, 4, d) + 0.2f * key(0, 5, d), 1e-3f);
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

// Random appends and compactions (one or several evictions anywhere, per-head counts), against
// plain lists of what each head holds: every slot's key, value, position and score stay those
// of its token, whichever way apply() gathered (toward the front, or toward the end with the
// head's offset moving up); appends move a head back to the front when it reaches the capacity;
// copies, exact-capacity copies and shrinking keep the slots.
TEST(KvCache, GatherEitherWayKeepsEverySlotOfItsToken) {
  std::mt19937 rng(7);
  for (KvType type : {KvType::kF32, KvType::kF16}) {
    KvCache c({1, kHeads, kDim, type});
    std::vector<std::vector<int>> held(kHeads);  // positions head h holds, in slot order
    int next = 0, moved_up = 0, back_to_front = 0;
    auto check = [&](const KvCache& cc, const char* what) {
      const KvLayer& L = cc.layer(0);
      std::vector<float> row(kDim);
      for (int h = 0; h < kHeads; ++h) {
        ASSERT_EQ(L.n_slot(h), static_cast<int>(held[h].size())) << what;
        ASSERT_LE(L.off(h) + L.n_slot(h), L.capacity()) << what;
        for (int j = 0; j < L.n_slot(h); ++j) {
          const int p = held[h][static_cast<size_t>(j)];
          ASSERT_EQ(L.pos(h)[j], p) << what << " head " << h << " slot " << j;
          EXPECT_FLOAT_EQ(L.score(h)[j], static_cast<float>(p)) << what;
          L.load_key(h, j, row.data());
          // F16 rounds these to within 4 (tokens' keys are 10 apart).
          ASSERT_NEAR(row[kDim - 1], 1000.0f * h + 10.0f * p + kDim - 1, 4.0f) << what;
          L.load_value(h, j, row.data());
          ASSERT_NEAR(row[0], -(1000.0f * h + 10.0f * p), 4.0f) << what;
        }
      }
    };
    for (int round = 0; round < 400; ++round) {
      const int n_new = 1 + static_cast<int>(rng() % 3);
      int off_before = 0;
      for (int h = 0; h < kHeads; ++h) off_before += c.layer(0).off(h);
      append_tokens(c, 0, next, n_new);
      KvLayer& L = KvTestAccess::layer(c, 0);
      int off_after = 0;
      for (int h = 0; h < kHeads; ++h) off_after += L.off(h);
      if (off_after < off_before && L.capacity() == c.layer(0).capacity()) ++back_to_front;
      for (int h = 0; h < kHeads; ++h) {
        for (int t = 0; t < n_new; ++t) {
          held[h].push_back(next + t);
          KvTestAccess::score(L, h)[L.n_slot(h) - n_new + t] = static_cast<float>(next + t);
        }
      }
      next += n_new;
      ASSERT_NO_FATAL_FAILURE(check(c, "append"));
      // Keep the cache near 40 slots per head: evict what is above, at random places (a run
      // near the front, near the end, or scattered), per head; sometimes counts per head.
      int n = L.n_slot();
      for (int h = 0; h < kHeads; ++h) n = std::min(n, L.n_slot(h));
      if (n < 41) continue;
      const bool per_head = round % 5 == 0;
      std::vector<int32_t> counts(kHeads);
      for (int h = 0; h < kHeads; ++h) counts[h] = per_head ? 36 + static_cast<int>(rng() % 5) : 38;
      CompactionPlan plan;
      if (per_head) {
        plan.reset_heads(kHeads, counts.data());
      } else {
        plan.reset(kHeads, counts[0]);
      }
      for (int h = 0; h < kHeads; ++h) {
        const int nh = L.n_slot(h), nk = counts[h];
        std::vector<int> idx(static_cast<size_t>(nh));
        for (int j = 0; j < nh; ++j) idx[static_cast<size_t>(j)] = j;
        const int mode = static_cast<int>(rng() % 3);
        std::vector<int> evict;
        if (mode == 2) {
          std::shuffle(idx.begin(), idx.end(), rng);
          evict.assign(idx.begin(), idx.begin() + (nh - nk));
        } else {
          const int at = mode == 0 ? static_cast<int>(rng() % (nh / 4))
                                   : nh - 1 - static_cast<int>(rng() % (nh / 4)) - (nh - nk);
          for (int x = 0; x < nh - nk; ++x) evict.push_back(std::max(0, at) + x);
        }
        std::sort(evict.begin(), evict.end());
        std::vector<int> kept;
        std::vector<int> kept_pos;
        for (int j = 0, e = 0; j < nh; ++j) {
          if (e < static_cast<int>(evict.size()) && evict[static_cast<size_t>(e)] == j) {
            ++e;
            continue;
          }
          kept.push_back(j);
          kept_pos.push_back(held[h][static_cast<size_t>(j)]);
        }
        ASSERT_EQ(static_cast<int>(kept.size()), nk);
        std::copy(kept.begin(), kept.end(), plan.keep_of(h));
        held[h] = kept_pos;
      }
      int off0 = 0;
      for (int h = 0; h < kHeads; ++h) off0 += L.off(h);
      c.apply(0, plan);
      int off1 = 0;
      for (int h = 0; h < kHeads; ++h) off1 += L.off(h);
      moved_up += off1 > off0;
      ASSERT_NO_FATAL_FAILURE(check(c, "apply"));
      if (round % 50 == 49) {
        KvCache copy({1, kHeads, kDim, type}), exact({1, kHeads, kDim, type});
        ASSERT_TRUE(copy.copy_from(c).ok());
        ASSERT_TRUE(exact.copy_slots_from(c).ok());
        ASSERT_NO_FATAL_FAILURE(check(copy, "copy_from"));
        ASSERT_NO_FATAL_FAILURE(check(exact, "copy_slots_from"));
        for (int h = 0; h < kHeads; ++h) EXPECT_EQ(exact.layer(0).off(h), 0);
      }
    }
    EXPECT_GT(moved_up, 50) << "the gather toward the end was not exercised";
    EXPECT_GT(back_to_front, 0) << "no append moved a head back to the front";
    ASSERT_TRUE(c.shrink_to_fit(0).ok());
    ASSERT_NO_FATAL_FAILURE(check(c, "shrink_to_fit"));
  }
}

}  // namespace
}  // namespace d2o
