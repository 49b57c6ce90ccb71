// The row map of a KV layer (kv/kv_cache.h): compactions move metadata and fill holes instead of
// moving every key and value behind an evicted slot, and put the rows back in order every
// kReorderAfter evictions. Checked here: the rows stay dense and each slot keeps its own row
// bytes, and attention read through a scrambled map gives the same bits as attention over the
// same slots stored in order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "kv/attention.h"
#include "kv/kv_cache.h"

namespace d2o {
namespace {

// Appends n tokens at positions first_pos.. with random keys and values.
void append_random(KvCache& c, int first_pos, int n, std::mt19937& rng) {
  const KvCacheConfig& cfg = c.config();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t kv_dim = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim;
  std::vector<float> k(static_cast<size_t>(n) * kv_dim), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = first_pos + t;
  ASSERT_TRUE(c.reserve(0, c.layer(0).n_slot() + n, false).ok());
  c.append(0, k.data(), v.data(), pos.data(), n);
}

// A plan keeping n_keep of each head's n slots, chosen at random (ascending); one eviction when
// n_keep == n - 1, at a random slot.
CompactionPlan random_plan(const KvLayer& L, int n_keep, std::mt19937& rng) {
  CompactionPlan plan;
  plan.reset(L.n_head_kv(), n_keep);
  std::vector<int32_t> all(static_cast<size_t>(L.n_slot()));
  for (int h = 0; h < L.n_head_kv(); ++h) {
    for (size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int32_t>(j);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + n_keep);
    std::copy(all.begin(), all.begin() + n_keep, plan.keep_of(h));
  }
  return plan;
}

using RowBytes = std::map<std::pair<int, int32_t>, std::vector<uint8_t>>;  // (head, pos) -> row

void record_new_rows(const KvLayer& L, int from, RowBytes& keys, RowBytes& values) {
  for (int h = 0; h < L.n_head_kv(); ++h) {
    for (int j = from; j < L.n_slot(h); ++j) {
      keys[{h, L.pos(h)[j]}].assign(L.key_row(h, j), L.key_row(h, j) + L.key_row_bytes());
      values[{h, L.pos(h)[j]}].assign(L.value_row(h, j), L.value_row(h, j) + L.value_row_bytes());
    }
  }
}

// Slots [0, n) of each head hold rows [0, n), each slot the bytes appended for its position.
void check_layer(const KvLayer& L, const RowBytes& keys, const RowBytes& values) {
  for (int h = 0; h < L.n_head_kv(); ++h) {
    const int n = L.n_slot(h);
    std::vector<int32_t> rows(L.rows(h), L.rows(h) + n);
    std::sort(rows.begin(), rows.end());
    for (int j = 0; j < n; ++j) ASSERT_EQ(rows[static_cast<size_t>(j)], j) << "head " << h;
    for (int j = 0; j < n; ++j) {
      ASSERT_TRUE(j == 0 || L.pos(h)[j] > L.pos(h)[j - 1]) << "slot order, head " << h;
      const auto& k = keys.at({h, L.pos(h)[j]});
      const auto& v = values.at({h, L.pos(h)[j]});
      ASSERT_EQ(0, std::memcmp(L.key_row(h, j), k.data(), k.size())) << h << "," << j;
      ASSERT_EQ(0, std::memcmp(L.value_row(h, j), v.data(), v.size())) << h << "," << j;
    }
  }
}

TEST(KvRowMap, CompactionsKeepRowsDenseAndEachSlotItsBytes) {
  for (KvType type : {KvType::kF32, KvType::kF16, KvType::kQ8_0}) {
    SCOPED_TRACE(kv_type_name(type));
    std::mt19937 rng(11);
    KvCache c({1, 3, 64, type});
    RowBytes keys, values;
    int pos = 0;
    for (int step = 0; step < 300; ++step) {
      const int before = c.layer(0).n_slot();
      const int n_new = step % 50 == 0 ? 40 : 1 + step % 3;
      append_random(c, pos, n_new, rng);
      pos += n_new;
      record_new_rows(c.layer(0), before, keys, values);
      const int n = c.layer(0).n_slot();
      // Mostly one eviction per new token, as decoding does; now and then many at once.
      const int n_keep = step % 37 == 5 ? n / 2 : std::max(1, std::min(n, 60) - 1);
      if (n_keep < n) c.apply(0, random_plan(c.layer(0), n_keep, rng));
      check_layer(c.layer(0), keys, values);
      if (HasFatalFailure()) return;
      // So many evictions at once put the rows back in slot order.
      if (n - n_keep >= KvLayer::kReorderAfter) {
        for (int h = 0; h < 3; ++h)
          for (int j = 0; j < c.layer(0).n_slot(h); ++j)
            ASSERT_EQ(c.layer(0).rows(h)[j], j) << "step " << step;
      }
    }
    // Per-head counts: each head keeps a different number.
    const KvLayer& L = c.layer(0);
    const int32_t counts[3] = {L.n_slot() - 1, L.n_slot() - 7, L.n_slot() / 3};
    CompactionPlan plan;
    plan.reset_heads(3, counts);
    for (int h = 0; h < 3; ++h) {
      CompactionPlan one = random_plan(L, counts[h], rng);
      std::copy(one.keep_of(h), one.keep_of(h) + counts[h], plan.keep_of(h));
    }
    c.apply(0, plan);
    check_layer(L, keys, values);
    // A copy holds the same slots with its rows in slot order.
    KvCache copy({1, 3, 64, type});
    ASSERT_TRUE(copy.copy_slots_from(c).ok());
    check_layer(copy.layer(0), keys, values);
    for (int h = 0; h < 3; ++h)
      for (int j = 0; j < copy.layer(0).n_slot(h); ++j) EXPECT_EQ(copy.layer(0).rows(h)[j], j);
  }
}

// Sliding-window layers drop their oldest slots through the same row map.
TEST(KvRowMap, SlidingWindowDropsKeepEachSlotItsBytes) {
  std::mt19937 rng(5);
  KvCacheConfig cfg{1, 2, 64, KvType::kF16, {32}};
  KvCache c(cfg);
  RowBytes keys, values;
  for (int pos = 0; pos < 200; ++pos) {
    const int dropped = c.drop_oldest(0, 1);
    (void)dropped;
    const int before = c.layer(0).n_slot();
    append_random(c, pos, 1, rng);
    record_new_rows(c.layer(0), before, keys, values);
    check_layer(c.layer(0), keys, values);
    if (HasFatalFailure()) return;
  }
  EXPECT_LE(c.layer(0).n_slot(), sliding_capacity(32, 1));
}

// Attention over a compacted cache (rows out of order) against the same slots copied in order:
// outputs and statistics bit for bit, at every kernel level, for decoding (one query) and for a
// pass of several queries (whose chunks are converted to F32 first).
TEST(KvRowMap, AttentionThroughTheMapEqualsAttentionInOrder) {
  for (int hd : {64, 128}) {
    for (KvType type : {KvType::kF16, KvType::kQ8_0, KvType::kF32}) {
      SCOPED_TRACE(std::string(kv_type_name(type)) + " hd " + std::to_string(hd));
      std::mt19937 rng(static_cast<unsigned>(hd));
      const int G = 2, H = 4;
      KvCache a({1, G, hd, type});
      int pos = 0;
      append_random(a, pos, 400, rng);
      pos += 400;
      // Evict down to 300, then decode-like steps: one in, one out at a random slot.
      a.apply(0, random_plan(a.layer(0), 300, rng));
      for (int s = 0; s < 40; ++s) {
        append_random(a, pos++, 1, rng);
        a.apply(0, random_plan(a.layer(0), a.layer(0).n_slot() - 1, rng));
      }
      int out_of_order = 0;
      for (int j = 0; j < a.layer(0).n_slot(); ++j) out_of_order += a.layer(0).rows(0)[j] != j;
      ASSERT_GT(out_of_order, 0) << "the test needs a scrambled map";
      for (int n_tok : {1, 6}) {
        append_random(a, pos, n_tok, rng);
        pos += n_tok;
        KvCache b({1, G, hd, type});
        ASSERT_TRUE(b.copy_slots_from(a).ok());
        std::vector<float> q(static_cast<size_t>(n_tok) * H * hd);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (float& x : q) x = nd(rng);
        AttnStatsRequest req;
        req.accumulate = true;
        req.window_first = n_tok - 1;
        for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
          if (!kernel_isa_available(isa)) continue;
          SCOPED_TRACE(kernel_isa_name(isa));
          std::vector<float> out_a(q.size()), out_b(q.size());
          ThreadPool pool(2);
          AttnScratch sa, sb;
          a.reset_score_stats(0);
          b.reset_score_stats(0);
          a.reset_window_stats(0);
          b.reset_window_stats(0);
          AttnInput in{q.data(), out_a.data(), n_tok, H, 1.0f / std::sqrt(static_cast<float>(hd))};
          attention_forward_isa(in, a.layer_for_attention(0), req, pool, sa, isa);
          in.out = out_b.data();
          attention_forward_isa(in, b.layer_for_attention(0), req, pool, sb, isa);
          ASSERT_EQ(out_a, out_b) << "n_tok " << n_tok;
          for (int g = 0; g < G; ++g) {
            const int n = a.layer(0).n_slot(g);
            ASSERT_EQ(0, std::memcmp(a.layer(0).score(g), b.layer(0).score(g), n * sizeof(float)));
            ASSERT_EQ(0,
                      std::memcmp(a.layer(0).window(g), b.layer(0).window(g), n * sizeof(float)));
          }
        }
        // Back to decoding: evict what the pass added, so the next pass sees a scrambled map.
        a.apply(0, random_plan(a.layer(0), a.layer(0).n_slot() - n_tok, rng));
      }
    }
  }
}

}  // namespace
}  // namespace d2o
