// KeyDiff on hand-computed caches: the anchor is the mean of the *normalised* keys (a raw mean
// ranks these keys the other way round), ties keep the older slot, a zero key has cosine 0.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

TEST(PolicyKeyDiff, KeepsTheKeysLeastLikeTheMeanOfTheUnitKeys) {
  // Unit keys (1,0) (0,1) (0,1) (.707,.707): anchor (0.427, 0.677); cosines 0.533, 0.846, 0.846,
  // 0.975. KeyDiff keeps slot 0 and, of the tie 1/2, the older slot 1. A raw-key anchor
  // (2.75, 1) would give cosines 0.940, 0.342, 0.342, 0.906 and keep slots 1 and 2.
  for (KvType type : {KvType::kF32, KvType::kF16}) {
    SCOPED_TRACE(kv_type_name(type));
    KvCache cache(KvCacheConfig{1, 1, 2, type});
    const float k[] = {10, 0, 0, 1, 0, 2, 1, 1};
    const float v[] = {1, 2, 3, 4, 5, 6, 7, 8};
    const int32_t pos[] = {0, 1, 2, 3};
    ASSERT_TRUE(cache.reserve(0, 4, false).ok());
    cache.append(0, k, v, pos, 4);
    auto p = test::policy_of("keydiff:budget=2");
    PolicyState state;
    PassInfo pi;
    pi.n_tokens = 4;
    pi.n_past = 4;
    pi.first_pass = true;
    ASSERT_TRUE(p->compact(cache, state, pi).ok());
    const KvLayer& L = cache.layer(0);
    ASSERT_EQ(L.n_slot(), 2);
    EXPECT_EQ(L.pos(0)[0], 0);
    EXPECT_EQ(L.pos(0)[1], 1);
    // recent=1 protects the newest slot: slot 0 (the best score) and slot 3.
    KvCache c2(KvCacheConfig{1, 1, 2, type});
    ASSERT_TRUE(c2.reserve(0, 4, false).ok());
    c2.append(0, k, v, pos, 4);
    PolicyState s2;
    ASSERT_TRUE(test::policy_of("keydiff:budget=2,recent=1")->compact(c2, s2, pi).ok());
    EXPECT_EQ(c2.layer(0).pos(0)[0], 0);
    EXPECT_EQ(c2.layer(0).pos(0)[1], 3);
  }
}

TEST(PolicyKeyDiff, ZeroKeysScoreZero) {
  // A zero key has cosine 0 with the anchor: it ranks above the keys aligned with the anchor
  // (cosine > 0) and below the keys opposed to it.
  KvCache cache(KvCacheConfig{1, 1, 2, KvType::kF32});
  const float k[] = {1, 0, 0, 0, 1, 0.1f, -1, 0.05f, 1, -0.1f};
  const float v[10] = {};
  const int32_t pos[] = {0, 1, 2, 3, 4};
  ASSERT_TRUE(cache.reserve(0, 5, false).ok());
  cache.append(0, k, v, pos, 5);
  PolicyState state;
  PassInfo pi;
  pi.n_past = 5;
  ASSERT_TRUE(test::policy_of("keydiff:budget=2")->compact(cache, state, pi).ok());
  EXPECT_EQ(cache.layer(0).pos(0)[0], 1);  // the zero key
  EXPECT_EQ(cache.layer(0).pos(0)[1], 3);  // the key against the anchor
}

}  // namespace
}  // namespace d2o
