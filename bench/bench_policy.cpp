// Policy cost of one decode step on the SmolLM2-135M cache shape (30 layers, 3 KV heads of 64,
// F16), with about 1638 slots per KV head and layer kept (rho = 0.2 of 8192 tokens), as the engine
// runs it: append one token to every layer, then per layer a stand-in for attention (untimed: it
// reads the layer's keys and values, so they are in the CPU's caches as after real attention, and
// adds one query's attention to the accumulated scores) and KvPolicy::compact_layer (timed:
// selection, D2O's nearest-neighbour merge planning, KvCache::apply), then KvPolicy::compact.
//
// Synthetic statistics: each slot has a fixed attention weight w (log-normal, drawn when its
// token arrives, kept in the slot's otherwise unused `window` entry so that it moves with the
// slot); a step adds w / n to every slot's score, so old heavy slots keep winning and a new slot
// with a small weight is evicted soon after it leaves the recent window, as in a real cache.
//
//   build/bench/bench_policy --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true
// Compare policies only as ratios from one interleaved run (the machine may be loaded).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/cold_tier.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "kv/policy/similarity.h"
#include "policy_sim.h"

namespace d2o {
namespace {

using bench::kHeadDim;
using bench::kLayers;
using Sim = bench::PolicySim;

// A prompt of n_prompt tokens compacted to the policy's budget, then decode steps.
void BM_DecodeStep(benchmark::State& st, const std::string& spec, int n_prompt) {
  Sim sim(spec);
  sim.append(n_prompt);
  sim.attend(n_prompt);
  sim.compact(n_prompt);
  // A few hundred steps first, so the recent window and the thresholds are in a steady state.
  for (int i = 0; i < 300; ++i) {
    sim.append(1);
    sim.attend(1);
    sim.compact(1);
  }
  if (!sim.policy->compacts_per_layer(sim.state)) std::abort();
  // Manual timing: only the policy calls are timed (steady clock, cheap to read), not the
  // stand-in attention between them.
  using Clock = std::chrono::steady_clock;
  for (auto _ : st) {
    sim.append(1);
    const PassInfo pass = sim.pass_info(1);
    Clock::duration t{};
    for (int il = 0; il < kLayers; ++il) {
      sim.attend(il, 1);
      const auto t0 = Clock::now();
      if (!sim.policy->compact_layer(sim.cache, sim.state, pass, il).ok()) std::abort();
      t += Clock::now() - t0;
    }
    const auto t0 = Clock::now();
    sim.compact(1);
    t += Clock::now() - t0;
    st.SetIterationTime(std::chrono::duration<double>(t).count());
  }
  st.counters["slots/layer"] = static_cast<double>(sim.cache.total_slots()) / kLayers;
}

// 1638 slots per head: rho = 0.2 of 8192 tokens (tg128 at depth 8192); 102: rho = 0.2 of 512
// (bench throughput's default prompt).
BENCHMARK_CAPTURE(BM_DecodeStep, h2o_1638, std::string("h2o:budget=1638"), 2048)
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_DecodeStep, d2o_1638, std::string("d2o:budget=1638"), 2048)
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_DecodeStep, h2o_102, std::string("h2o:budget=102"), 512)
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_DecodeStep, d2o_102, std::string("d2o:budget=102"), 512)
    ->UseManualTime()->Unit(benchmark::kMicrosecond);

// row_dots alone on 1638 F16 rows of 64 that stay in the CPU's caches (the similarity pass of a
// decode step without the cache misses). args: inverse norms computed (0/1), rows through an
// index list skipping one row (0/1; a decode step's kept slots) or rows 0..n-1.
void BM_RowDotsHot(benchmark::State& st) {
  const int n = 1638;
  std::vector<uint16_t> rows(static_cast<size_t>(n + 1) * kHeadDim, 0x3c00);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = i < 800 ? i : i + 1;
  std::vector<float> q(kHeadDim, 0.5f), dot(static_cast<size_t>(n)), inv(static_cast<size_t>(n));
  RowDots a;
  a.base = reinterpret_cast<const uint8_t*>(rows.data());
  a.row_bytes = 2 * kHeadDim;
  a.f16 = true;
  a.dim = kHeadDim;
  a.rows = st.range(1) ? idx.data() : nullptr;
  a.n = n;
  a.q = q.data();
  a.dot = dot.data();
  a.inv_norm = st.range(0) ? inv.data() : nullptr;
  for (auto _ : st) {
    row_dots(a);
    benchmark::DoNotOptimize(dot.data());
  }
}
BENCHMARK(BM_RowDotsHot)->Args({1, 1})->Args({0, 1})->Args({0, 0})->Unit(benchmark::kMicrosecond);

// One KV head's recall at a turn (ColdTier::recall: every cold slot scored by the window's
// queries, the best taken out and dequantised) on the SmolLM2 shape: 6,300 cold slots of 64 in
// q4_0r (an 8K prompt's evictions at rho = 0.2), 32 window queries x 3 query heads, 512 slots
// recalled by the summed ranking. The engine recalls 30 layers x 3 heads of these per turn.
// args: cold slots, slots recalled.
void BM_ColdRecall(benchmark::State& st) {
  const int n = static_cast<int>(st.range(0)), count = static_cast<int>(st.range(1));
  const int n_q = 96;
  ColdTierConfig cc;
  cc.place = ColdPlace::kMemory;
  cc.type = parse_kv_type("q4_0r").value();
  cc.ranking = RecallRanking::kSum;
  ColdTier base(cc, KvCacheConfig(1, 1, kHeadDim, KvType::kF16));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> row(kHeadDim), q(static_cast<size_t>(n_q) * kHeadDim);
  for (float& x : q) x = nd(rng);
  const size_t krb = base.key_row_bytes(), vrb = base.value_row_bytes();
  std::vector<uint8_t> k(static_cast<size_t>(n) * krb), v(static_cast<size_t>(n) * vrb);
  std::vector<int32_t> pos(static_cast<size_t>(n)), merged(static_cast<size_t>(n), 0);
  std::vector<float> score(static_cast<size_t>(n), 0.0f);
  for (int i = 0; i < n; ++i) {
    pos[static_cast<size_t>(i)] = 2 * i;
    for (float& x : row) x = nd(rng);
    kv_store_row(cc.type.k, row.data(), kHeadDim, k.data() + static_cast<size_t>(i) * krb);
    for (float& x : row) x = nd(rng);
    kv_store_row(cc.type.v, row.data(), kHeadDim, v.data() + static_cast<size_t>(i) * vrb);
  }
  base.restore_head(0, 0, n, pos.data(), score.data(), merged.data(), k.data(), v.data());
  ColdRecall out;
  for (auto _ : st) {
    st.PauseTiming();
    ColdTier t = base;
    st.ResumeTiming();
    t.recall(0, 0, q.data(), n_q, 0.125f, count, out);
    benchmark::DoNotOptimize(out.k.data());
  }
}
BENCHMARK(BM_ColdRecall)
    ->Args({6300, 512})
    ->Args({6300, 1024})
    ->Args({1600, 512})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace d2o

BENCHMARK_MAIN();
