// Budgets from KV bytes (eval/kv_bytes.h), against byte counts written out by hand from the
// block layouts: F16 2 bytes per element, F32 4, a Q8_0 block of 32 elements 34 bytes (32 int8
// and an F16 scale), a Q4_0 block 18 (16 bytes of nibbles and an F16 scale).
#include <gtest/gtest.h>

#include "eval/kv_bytes.h"

namespace d2o {
namespace {

KvType type_of(const char* s) {
  auto t = parse_kv_type(s);
  EXPECT_TRUE(t.ok()) << s;
  return t.ok() ? *t : KvType::kF16;
}

KvCacheConfig config(int n_layer, int n_head_kv, int head_dim, const char* type,
                     std::vector<int> windows = {}) {
  return KvCacheConfig(n_layer, n_head_kv, head_dim, type_of(type), std::move(windows));
}

TEST(KvBytes, SlotBytesCountBlockScales) {
  // head_dim 64: two blocks per row.
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "f16")), 3u * (128 + 128));
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "f32")), 3u * (256 + 256));
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "q8_0")), 3u * (68 + 68));
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "q4_0")), 3u * (36 + 36));
  // Rotation changes no byte; keys and values may differ.
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "q4_0r")), 3u * (36 + 36));
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 3, 64, "k:q8_0,v:f16")), 3u * (68 + 128));
  // An odd number of blocks: head_dim 96 is three.
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 1, 96, "q4_0")), 54u + 54u);
  EXPECT_EQ(eval::kv_slot_bytes(config(1, 1, 96, "q8_0")), 102u + 102u);
}

TEST(KvBytes, BudgetPerStorageType) {
  // 2 layers x 3 KV heads x head_dim 64, 100 tokens: the F16 full cache holds
  // 2 x 100 x 3 x 256 = 153600 bytes; 20% of it is 30720.
  const int64_t n = 100;
  EXPECT_EQ(eval::full_kv_bytes(config(2, 3, 64, "f16"), n), 153600u);
  struct Case {
    const char* type;
    int64_t slots;                     // floor(30720 / (2 layers x slot bytes))
  } cases[] = {{"f16", 20},            // 30720 / 1536, exactly
               {"f32", 10},            // 30720 / 3072
               {"q8_0", 37},           // 30720 / 816 = 37.6
               {"q4_0", 71},           // 30720 / 432 = 71.1
               {"q4_0r", 71},          // as q4_0
               {"k:q8_0,v:f16", 26}};  // 30720 / 1176 = 26.1
  for (const Case& c : cases) {
    auto b = eval::budget_for_share(config(2, 3, 64, c.type), n, 0.2);
    ASSERT_TRUE(b.ok()) << c.type << ": " << b.status().to_string();
    EXPECT_EQ(b->slots, c.slots) << c.type;
    EXPECT_EQ(b->target, 30720u) << c.type;
    EXPECT_LE(b->bytes, b->target) << c.type;
    EXPECT_EQ(b->bytes, eval::kv_bytes_at_budget(config(2, 3, 64, c.type), c.slots, n));
    // One more slot per layer would not fit: the budget is the largest.
    EXPECT_GT(eval::kv_bytes_at_budget(config(2, 3, 64, c.type), c.slots + 1, n), b->target)
        << c.type;
    EXPECT_DOUBLE_EQ(b->share, static_cast<double>(b->bytes) / 153600.0) << c.type;
  }
}

TEST(KvBytes, OddBlockCountsAndHeadSizes) {
  // One layer, one KV head, head_dim 96, 1000 tokens: F16 holds 1000 x 384 bytes; 10% = 38400.
  auto q4 = eval::budget_for_share(config(1, 1, 96, "q4_0"), 1000, 0.1);
  ASSERT_TRUE(q4.ok());
  EXPECT_EQ(q4->slots, 355);  // 38400 / 108 = 355.6
  auto q8 = eval::budget_for_share(config(1, 1, 96, "q8_0"), 1000, 0.1);
  ASSERT_TRUE(q8.ok());
  EXPECT_EQ(q8->slots, 188);  // 38400 / 204 = 188.2
  // head_dim 40 is no whole number of blocks: F16 works, a quantised type is an error.
  auto f16 = eval::budget_for_share(config(1, 1, 40, "f16"), 1000, 0.1);
  ASSERT_TRUE(f16.ok());
  EXPECT_EQ(f16->slots, 100);
  EXPECT_FALSE(eval::budget_for_share(config(1, 1, 40, "q8_0"), 1000, 0.1).ok());
  EXPECT_FALSE(eval::budget_for_share(config(1, 1, 40, "q4_0"), 1000, 0.1).ok());
}

TEST(KvBytes, ShareNamedExactlyIsNotRoundedDown) {
  // 0.3 is 0.29999... in binary; 0.3 of 100 slots' bytes is still 30 slots.
  auto b = eval::budget_for_share(config(1, 1, 32, "f16"), 100, 0.3);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->slots, 30);
  EXPECT_EQ(b->target, 30u * 128u);
}

TEST(KvBytes, SlidingWindowLayersAreFixedCost) {
  // Layers: global, sliding (window 8), global; one KV head of 32 (F16 slot: 128 bytes).
  // 100 tokens: the F16 full cache holds (100 + 8 + 100) x 128 = 26624 bytes; half is 13312,
  // of which the sliding layer takes 8 x 128 = 1024: (13312 - 1024) / (2 x 128) = 48 slots.
  const KvCacheConfig cfg = config(3, 1, 32, "f16", {0, 8, 0});
  EXPECT_EQ(eval::full_kv_bytes(cfg, 100), 26624u);
  auto b = eval::budget_for_share(cfg, 100, 0.5);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->slots, 48);
  EXPECT_EQ(b->bytes, (48u + 8u + 48u) * 128u);
  // A share below the sliding layer's own bytes holds no slot in the global layers.
  auto none = eval::budget_for_share(cfg, 100, 0.04);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("smallest share"), std::string::npos);
  // A model of sliding layers only has nothing to budget.
  EXPECT_FALSE(eval::budget_for_share(config(2, 1, 32, "f16", {8, 8}), 100, 0.5).ok());
}

TEST(KvBytes, RejectsBadShares) {
  const KvCacheConfig cfg = config(2, 3, 64, "q8_0");
  EXPECT_FALSE(eval::budget_for_share(cfg, 100, 0).ok());
  EXPECT_FALSE(eval::budget_for_share(cfg, 100, -0.1).ok());
  EXPECT_FALSE(eval::budget_for_share(cfg, 100, 1.5).ok());
  EXPECT_FALSE(eval::budget_for_share(cfg, 0, 0.2).ok());
  // 0.001 of 153600 bytes is 153, less than one slot per layer (816 bytes).
  auto tiny = eval::budget_for_share(cfg, 100, 0.001);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("q8_0"), std::string::npos) << tiny.status().message();
  // The whole F16 cache's bytes hold more q8_0 slots than tokens: allowed (a budget at or above
  // the context keeps everything).
  auto all = eval::budget_for_share(cfg, 100, 1.0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->slots, 188);  // 153600 / 816 = 188.2
}

}  // namespace
}  // namespace d2o
