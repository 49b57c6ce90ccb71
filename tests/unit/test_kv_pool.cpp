// KV memory accounting without a model: the pool, FIFO admission with synthetic costs (checked
// against a plain simulation), byte-size parsing, the cache's slot limit and footprint formula,
// and how the scheduler cuts prompts into chunks and sizes reservations.
#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/kv_mem_budget.h"
#include "runtime/kv_pool.h"
#include "runtime/scheduler.h"

namespace d2o {
namespace {

TEST(KvMemoryPool, ReservesWithinTheCapOnly) {
  KvMemoryPool pool(100);
  EXPECT_TRUE(pool.try_reserve(60));
  EXPECT_FALSE(pool.try_reserve(41));  // 101 > 100: nothing changes
  EXPECT_EQ(pool.reserved(), 60u);
  EXPECT_TRUE(pool.try_reserve(40));  // exactly the cap
  EXPECT_EQ(pool.available(), 0u);
  EXPECT_FALSE(pool.try_reserve(1));
  pool.release(60);
  EXPECT_EQ(pool.reserved(), 40u);
  EXPECT_EQ(pool.peak_reserved(), 100u);
  EXPECT_TRUE(pool.try_reserve(0));
}

TEST(AdmissionQueue, FifoWithHeadOfLineBlockingAndRefusal) {
  KvMemoryPool pool(100);
  AdmissionQueue q(pool);
  ASSERT_TRUE(q.push(1, 50).ok());
  ASSERT_TRUE(q.push(2, 40).ok());
  ASSERT_TRUE(q.push(3, 30).ok());  // does not fit next to 1 and 2
  ASSERT_TRUE(q.push(4, 5).ok());   // would fit, but must not overtake 3
  const Status big = q.push(5, 101);
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.message().find("more than the whole cap"), std::string::npos) << big.message();
  EXPECT_EQ(q.n_waiting(), 4u);  // the refused one was never queued

  std::vector<uint64_t> ids;
  q.admit(10, ids);
  EXPECT_EQ(ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(pool.reserved(), 90u);
  ids.clear();
  q.admit(10, ids);
  EXPECT_TRUE(ids.empty());  // 3 blocks 4
  q.release(2);
  EXPECT_EQ(q.reserved_for(1), 50u);
  EXPECT_EQ(q.reserved_for(2), 0u);
  q.admit(1, ids);  // at most one
  EXPECT_EQ(ids, (std::vector<uint64_t>{3}));
  q.admit(10, ids);
  EXPECT_EQ(ids, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(pool.reserved(), 85u);
  q.release(1);
  q.release(3);
  q.release(4);
  EXPECT_EQ(pool.reserved(), 0u);
  EXPECT_EQ(q.n_admitted(), 0u);
}

// The head waits for bytes that requests behind it hold (the conversations they continue): the
// first of those that fits goes ahead of it, and its bytes come back when it ends.
TEST(AdmissionQueue, FirstFittingGoesAheadOfABlockedHead) {
  KvMemoryPool pool(100);
  AdmissionQueue q(pool);
  ASSERT_TRUE(pool.try_reserve(30));
  ASSERT_TRUE(q.push(1, 90).ok());  // needs 90, 70 free
  ASSERT_TRUE(pool.try_reserve(30));
  ASSERT_TRUE(q.push(2, 80, 30).ok());  // holds 30, needs 50 more: 40 free
  ASSERT_TRUE(q.push(3, 45, 30).ok());  // (its 30 are the first reservation)
  std::vector<uint64_t> ids;
  q.admit(10, ids);
  EXPECT_TRUE(ids.empty());
  EXPECT_TRUE(q.admit_first_fitting(ids));
  EXPECT_EQ(ids, (std::vector<uint64_t>{3}));  // 2 does not fit
  EXPECT_EQ(pool.reserved(), 75u);
  EXPECT_FALSE(q.admit_first_fitting(ids));
  q.release(3);
  EXPECT_EQ(pool.reserved(), 30u);
  EXPECT_EQ(q.n_waiting(), 2u);
  EXPECT_TRUE(q.remove(1));
  EXPECT_TRUE(q.remove(2));
  EXPECT_EQ(pool.reserved(), 0u);
}

// Random costs and lifetimes against a plain simulation of the same rule: admission in push
// order, never above the cap, everything admitted eventually.
TEST(AdmissionQueue, RandomWorkloadMatchesSimulation) {
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    const size_t cap = 1000;
    KvMemoryPool pool(cap);
    AdmissionQueue q(pool);
    struct Req {
      uint64_t id;
      size_t bytes;
      int life;
    };
    std::deque<Req> sim_wait;
    std::vector<Req> sim_run, real_run;
    size_t sim_reserved = 0;
    uint64_t next = 1, admitted_upto = 0;
    int refused = 0;
    for (int t = 0; t < 400 || !sim_wait.empty() || !sim_run.empty(); ++t) {
      if (t < 400 && rng() % 3 == 0) {
        const Req r{next++, static_cast<size_t>(rng() % 1100), 1 + static_cast<int>(rng() % 8)};
        const Status s = q.push(r.id, r.bytes);
        ASSERT_EQ(s.ok(), r.bytes <= cap);
        if (s.ok())
          sim_wait.push_back(r);
        else
          ++refused;
      }
      // End the sequences whose life is over.
      for (auto* v : {&sim_run, &real_run}) {
        for (Req& r : *v) --r.life;
      }
      for (const Req& r : sim_run) {
        if (r.life <= 0) sim_reserved -= r.bytes;
      }
      for (const Req& r : real_run) {
        if (r.life <= 0) q.release(r.id);
      }
      std::erase_if(sim_run, [](const Req& r) { return r.life <= 0; });
      std::erase_if(real_run, [](const Req& r) { return r.life <= 0; });
      // Admit.
      const int max_admit = 1 + static_cast<int>(rng() % 3);
      std::vector<uint64_t> ids;
      q.admit(max_admit, ids);
      std::vector<uint64_t> want;
      while (!sim_wait.empty() && static_cast<int>(want.size()) < max_admit &&
             sim_reserved + sim_wait.front().bytes <= cap) {
        sim_reserved += sim_wait.front().bytes;
        want.push_back(sim_wait.front().id);
        sim_run.push_back(sim_wait.front());
        real_run.push_back(sim_wait.front());
        sim_wait.pop_front();
      }
      ASSERT_EQ(ids, want) << "round " << round << " t " << t;
      for (uint64_t id : ids) {
        EXPECT_GT(id, admitted_upto);  // strictly in submission order
        admitted_upto = id;
      }
      ASSERT_LE(pool.reserved(), cap);
      ASSERT_EQ(pool.reserved(), sim_reserved);
      ASSERT_LT(t, 100000) << "no progress";
    }
    EXPECT_EQ(pool.reserved(), 0u);
    EXPECT_EQ(q.n_waiting(), 0u);
    EXPECT_GT(refused, 0);
  }
}

TEST(ParseByteSize, SuffixesAndErrors) {
  EXPECT_EQ(*parse_byte_size("1048576"), 1048576u);
  EXPECT_EQ(*parse_byte_size("512K"), 512u * 1024);
  EXPECT_EQ(*parse_byte_size("512M"), 512u << 20);
  EXPECT_EQ(*parse_byte_size("512m"), 512u << 20);
  EXPECT_EQ(*parse_byte_size("2G"), size_t{2} << 30);
  EXPECT_EQ(*parse_byte_size("2GiB"), size_t{2} << 30);
  EXPECT_EQ(*parse_byte_size("64MB"), size_t{64} << 20);
  EXPECT_EQ(*parse_byte_size("1.5G"), size_t{3} << 29);
  EXPECT_EQ(*parse_byte_size("1T"), size_t{1} << 40);
  EXPECT_EQ(*parse_byte_size("100B"), 100u);
  for (const char* bad :
       {"", "M", "-5M", "12Q", "1.2.3G", "5MiBs", "0", "0.1", "99999999999999T", " 5M"}) {
    auto r = parse_byte_size(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(KvCacheLimit, GrowthStopsAtTheLimitAndBytesMatchTheFormula) {
  for (KvType type : {KvType::kF16, KvType::kF32}) {
    const KvCacheConfig cfg{3, 2, 8, type};
    KvCache c(cfg);
    ASSERT_TRUE(c.set_slot_limit(300).ok());
    // Geometric growth would take 256 slots then more; the limit caps it.
    ASSERT_TRUE(c.reserve(0, 1, false).ok());
    EXPECT_EQ(c.layer(0).capacity(), 256);
    ASSERT_TRUE(c.reserve(0, 257, false).ok());
    EXPECT_EQ(c.layer(0).capacity(), 300);
    const Status over = c.reserve(0, 301, false);
    EXPECT_EQ(over.code(), StatusCode::kResourceExhausted);
    EXPECT_NE(over.message().find("above its limit of 300"), std::string::npos) << over.message();
    EXPECT_FALSE(c.set_slot_limit(299).ok());  // layer 0 already holds 300
    for (int il = 0; il < 3; ++il) ASSERT_TRUE(c.reserve(il, 300, true).ok());
    EXPECT_EQ(c.kv_bytes_allocated() + c.meta_bytes_allocated(),
              KvCache::bytes_for_slots(cfg, 300));
    // Independent count: per slot and head, 2 rows of head_dim elements + 5 metadata words.
    const size_t elem = type == KvType::kF16 ? 2 : 4;
    EXPECT_EQ(KvCache::bytes_for_slots(cfg, 300), 3u * 2 * 300 * (2 * 8 * elem + 20));
    ASSERT_TRUE(c.set_slot_limit(0).ok());
    EXPECT_TRUE(c.reserve(0, 1000, false).ok());
  }
}

// A turn's recall: one layer at a time may hold up to `one_layer_extra` slots above the limit,
// and only once the layer before it is back under the limit.
TEST(KvCacheLimit, OneLayerAtATimeMayHoldTheExtra) {
  const KvCacheConfig cfg{3, 2, 8, KvType::kF16};
  KvCache c(cfg);
  EXPECT_FALSE(c.set_slot_limit(0, 8).ok());  // an extra needs a limit
  EXPECT_FALSE(c.set_slot_limit(10, -1).ok());
  ASSERT_TRUE(c.set_slot_limit(100, 50).ok());
  EXPECT_EQ(c.slot_limit_extra(), 50);
  for (int il = 0; il < 3; ++il) ASSERT_TRUE(c.reserve(il, 100, true).ok());
  // Above the limit the growth is exact, never geometric.
  ASSERT_TRUE(c.reserve(1, 120, false).ok());
  EXPECT_EQ(c.layer(1).capacity(), 120);
  ASSERT_TRUE(c.reserve(1, 150, false).ok());
  const Status past = c.reserve(1, 151, false);
  EXPECT_EQ(past.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(past.message().find("50 more for one layer at a time"), std::string::npos)
      << past.message();
  // Layer 1 is above the limit: no other layer may go there.
  const Status second = c.reserve(0, 101, false);
  EXPECT_EQ(second.code(), StatusCode::kResourceExhausted) << second.message();
  // Trimmed back under the limit (whatever the hysteresis), the next layer may.
  ASSERT_TRUE(c.trim_layer(1, 0).ok());
  EXPECT_LE(c.layer(1).capacity(), 100);
  ASSERT_TRUE(c.reserve(0, 140, false).ok());
  // At most the limit in every layer and the extra in one: what bytes_for_one_layer adds.
  EXPECT_LE(c.kv_bytes_allocated() + c.meta_bytes_allocated(),
            KvCache::bytes_for_slots(cfg, 100) + KvCache::bytes_for_one_layer(cfg, 50));
  // 2 heads x 50 slots x (2 rows x 8 halves + 20 bytes of metadata).
  EXPECT_EQ(KvCache::bytes_for_one_layer(cfg, 50), 2u * 50 * (2 * 8 * 2 + 20));
  EXPECT_EQ(KvCache::bytes_for_one_layer(cfg, 0), 0u);
}

TEST(SchedulerPlan, PromptChunksCoverThePromptAndRespectTheLastChunkMinimum) {
  for (int n = 1; n <= 300; ++n) {
    for (int chunk : {1, 7, 16, 64, 256}) {
      for (int min_last : {0, 1, 5, 32}) {
        const std::vector<int> c = Scheduler::split_prompt(n, chunk, min_last);
        int64_t sum = 0;
        for (int x : c) {
          EXPECT_GE(x, 1);
          sum += x;
        }
        ASSERT_EQ(sum, n);
        EXPECT_EQ(static_cast<int64_t>(c.size()), (n + chunk - 1) / chunk);
        for (size_t i = 0; i + 1 < c.size(); ++i) {
          EXPECT_LE(c[i], chunk);
        }
        if (min_last <= chunk) {
          EXPECT_LE(c.back(), chunk);
          if (c.size() > 1 && chunk > 1) {
            EXPECT_GE(c.back(), std::min(min_last, n)) << n << " " << chunk;
          }
        }
      }
    }
  }
  EXPECT_EQ(Scheduler::split_prompt(520, 256, 32), (std::vector<int>{256, 232, 32}));
  EXPECT_EQ(Scheduler::split_prompt(512, 256, 32), (std::vector<int>{256, 256}));
}

TEST(SchedulerPlan, FullCacheFootprintIsPromptPlusGeneration) {
  const KvCacheConfig cfg{30, 3, 64, KvType::kF16};
  FullPolicy full;
  const Scheduler::Footprint f = Scheduler::footprint(cfg, full, 512, 2048, 256);
  EXPECT_EQ(f.slots, 2560);
  // 30 layers x 3 heads x 2560 slots x (2 x 64 x 2 bytes + 20 bytes of metadata).
  EXPECT_EQ(f.bytes, 30u * 3 * 2560 * (256 + 20));
}

// A cold tier's recall is reserved for one layer: each layer compacts its recalled slots away
// before the next layer recalls (Engine::after_attention).
TEST(SchedulerPlan, ARecallIsReservedForOneLayer) {
  const KvCacheConfig cfg{30, 3, 64, KvType::kF16};
  auto with = parse_kv_policy("d2o:budget=256,cold=disk,recall=512,recall_all_up_to=0").value();
  auto without = parse_kv_policy("d2o:budget=256,cold=none").value();
  const Scheduler::Footprint a = Scheduler::footprint(cfg, *with, 4096, 256, 256);
  const Scheduler::Footprint b = Scheduler::footprint(cfg, *without, 4096, 256, 256);
  EXPECT_EQ(a.slots, b.slots);
  EXPECT_EQ(b.layer_extra, 0);
  EXPECT_EQ(a.layer_extra, 512);
  // The extra's bytes for one layer, not thirty; the policy's state and the tier's metadata
  // account for the rest of the difference.
  const size_t one_layer = KvCache::bytes_for_one_layer(cfg, 512);
  EXPECT_EQ(one_layer, 3u * 512 * (256 + 20));
  EXPECT_GE(a.bytes, b.bytes + one_layer);
  EXPECT_LT(a.bytes, b.bytes + 2 * one_layer + with->cold_bytes(cfg, 4096 + 256));
  // A tier recalled whole while it is small (d2o's default, up to 2,048 slots a head): the
  // larger of the two reserved for one layer.
  auto whole = parse_kv_policy("d2o:budget=256,cold=disk,recall=512").value();
  EXPECT_EQ(Scheduler::footprint(cfg, *whole, 4096, 256, 256).layer_extra, 2048);
  // A recall larger than the sequence: at most the sequence's slots.
  const Scheduler::Footprint small = Scheduler::footprint(cfg, *with, 300, 10, 256);
  EXPECT_LE(small.slots + small.layer_extra, 310);
}

// --kv-mem-per-seq counts a cold tier's bytes in memory and a turn's recall (one layer, at most
// the budget: a larger recall is lowered to it) before the budget's slots, as the server's pool
// reserves them; a tier in memory must be bounded.
TEST(KvMemPerSeq, AColdTierCountsBeforeTheBudget) {
  const KvCacheConfig cfg{30, 3, 64, KvType::kF16};
  const int64_t n_ctx = 8192;
  auto bytes = [&](const KvPolicy& p, int64_t n) {
    const int64_t extra =
        std::min<int64_t>(p.cold_tier().enabled() ? p.cold_tier().max_recall() : 0, n);
    return KvCache::bytes_for_slots(cfg, n) + p.state_bytes(cfg, n + extra) +
           p.cold_bytes(cfg, n_ctx) + KvCache::bytes_for_one_layer(cfg, extra);
  };
  // The slots that fit, and not one more; the spec's budget is them.
  auto fits = [&](const std::string& spec, const std::string& mem, size_t cap) {
    int slots = 0;
    auto s = spec_for_kv_mem(spec, mem, cfg, n_ctx, &slots);
    EXPECT_TRUE(s.ok()) << s.status().message();
    if (!s.ok()) return std::make_pair(0, std::string());
    auto p = parse_kv_policy(spec).value();
    EXPECT_LE(bytes(*p, slots), cap) << spec;
    EXPECT_GT(bytes(*p, slots + 1), cap) << spec;
    EXPECT_NE(s->find(",budget=" + std::to_string(slots)), std::string::npos) << *s;
    return std::make_pair(slots, *s);
  };
  const size_t mib = size_t{1} << 20;
  const auto none = fits("d2o:cold=none", "8M", 8 * mib);
  const auto disk = fits("d2o:cold=disk", "8M", 8 * mib);
  EXPECT_GT(parse_kv_policy(disk.second).value()->cold_bytes(cfg, n_ctx), size_t{0});
  EXPECT_LT(disk.first, none.first);
  // The recall is at most the budget (512 and 2,048 lowered), in the spec as run.
  auto pd = parse_kv_policy(disk.second).value();
  EXPECT_EQ(pd->cold_tier().recall, disk.first);
  EXPECT_EQ(pd->cold_tier().recall_all_up_to, disk.first);
  EXPECT_NE(disk.second.find("cold=disk,recall="), std::string::npos) << disk.second;
  // A recall given below the budget stays; one above it is replaced.
  const auto small = fits("d2o:recall=16,recall_all_up_to=0", "8M", 8 * mib);
  EXPECT_EQ(small.second, "d2o:recall=16,recall_all_up_to=0,budget=" + std::to_string(small.first));
  const auto large = fits("d2o:recall=100000,window=16", "64M", 64 * mib);
  EXPECT_EQ(large.second, "d2o:window=16,recall=" + std::to_string(large.first) +
                              ",recall_all_up_to=" + std::to_string(std::min(2048, large.first)) +
                              ",budget=" + std::to_string(large.first));
  // In memory: refused unbounded, counted whole when bounded.
  int mem = 0;
  auto unbounded = spec_for_kv_mem("d2o:cold=memory", "8M", cfg, n_ctx, &mem);
  ASSERT_FALSE(unbounded.ok());
  EXPECT_NE(unbounded.status().message().find("cold_size="), std::string::npos);
  const auto bounded = fits("d2o:cold=memory,cold_size=256", "8M", 8 * mib);
  EXPECT_GT(parse_kv_policy(bounded.second).value()->cold_bytes(cfg, n_ctx),
            size_t{30} * 3 * 256 * 72);  // at least its rows in q4_0r
  EXPECT_LT(bounded.first, disk.first);
  // A size the tier alone fills holds no slot, and says why.
  auto tiny = spec_for_kv_mem("d2o:cold=disk", "512K", cfg, n_ctx, &mem);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("for the cold tier"), std::string::npos)
      << tiny.status().message();
}

}  // namespace
}  // namespace d2o
