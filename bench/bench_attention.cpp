// Attention throughput on the SmolLM2-135M shape (9 query heads, 3 KV heads, head_dim 64) per
// context length: decode (1 query over n slots) and prefill (a chunk of 512 queries whose last
// query sees n slots), for F16 and F32 caches, with and without statistics (the accumulated
// column sums H2O/D2O need), at 1 and 2 threads and every kernel level.
//
// Counters (wall-clock): KV_GB/s = key and value bytes of the visible slots per second (each read
// once per call); us/call is the time of one call, i.e. one layer of one decode step.
//
//   build/bench/bench_attention --benchmark_counters_tabular=true [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "kv/attention.h"
#include "kv/kv_cache.h"

namespace d2o {
namespace {

constexpr int kHeads = 9, kHeadsKv = 3, kHeadDim = 64;

struct Fixture {
  KvCache cache;
  std::vector<float> q, out;
  AttnScratch scratch;
  explicit Fixture(KvType type, int n_slot, int n_tok)
      : cache(KvCacheConfig{1, kHeadsKv, kHeadDim, type}) {
    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int kv_dim = kHeadsKv * kHeadDim;
    std::vector<float> k(static_cast<size_t>(n_slot) * kv_dim), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    std::vector<int32_t> pos(static_cast<size_t>(n_slot));
    for (int i = 0; i < n_slot; ++i) pos[static_cast<size_t>(i)] = i;
    if (!cache.reserve(0, n_slot, /*exact=*/true).ok()) std::abort();
    cache.append(0, k.data(), v.data(), pos.data(), n_slot);
    q.resize(static_cast<size_t>(n_tok) * kHeads * kHeadDim);
    for (auto& x : q) x = nd(rng);
    out.resize(q.size());
  }
};

// args: n_slot (visible to the last query), n_tok, F16 (1) / F32 (0), statistics (0/1),
// threads, kernel level
void BM_Attention(benchmark::State& state) {
  const int n_slot = static_cast<int>(state.range(0));
  const int n_tok = static_cast<int>(state.range(1));
  const KvType type = state.range(2) ? KvType::kF16 : KvType::kF32;
  const bool stats = state.range(3) != 0;
  const int threads = static_cast<int>(state.range(4));
  const auto isa = static_cast<KernelIsa>(state.range(5));
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("kernel level not available on this CPU");
    return;
  }
  Fixture f(type, n_slot, n_tok);
  ThreadPool pool(threads);
  AttnInput in;
  in.q = f.q.data();
  in.out = f.out.data();
  in.n_tok = n_tok;
  in.n_head = kHeads;
  in.scale = 0.125f;
  AttnStatsRequest req;
  req.accumulate = stats;
  for (auto _ : state) {
    attention_forward_isa(in, f.cache.layer_for_attention(0), req, pool, f.scratch, isa);
    benchmark::DoNotOptimize(f.out.data());
  }
  const double elem = type == KvType::kF16 ? 2.0 : 4.0;
  // Slots read: every query block reads the slots its last query sees.
  double slots = 0;
  const int n_old = n_slot - n_tok;
  for (int t0 = 0; t0 < n_tok; t0 += AttnScratch::kQueryBlock) {
    slots += n_old + std::min(n_tok, t0 + AttnScratch::kQueryBlock);
  }
  state.counters["KV_GB/s"] = benchmark::Counter(slots * kHeadsKv * kHeadDim * 2 * elem,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["us/call"] = benchmark::Counter(
      1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(type == KvType::kF16 ? "f16" : "f32") + (stats ? " stats" : "") + " " +
                 kernel_isa_name(isa));
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "f16", "stats", "thr", "isa"});
  for (const int isa : {2, 1, 0})
    for (const int thr : {1, 2})
      for (const int f16 : {1, 0})
        for (const int stats : {0, 1})
          for (const int n : {128, 512, 2048, 8192}) {
            if (isa == 0 && (n != 2048 || thr != 1)) continue;  // the scalar reference, one point
            b->Args({n, 1, f16, stats, thr, isa});
          }
}

void prefill_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "f16", "stats", "thr", "isa"});
  for (const int isa : {2, 1})
    for (const int thr : {1, 2})
      for (const int stats : {0, 1})
        for (const int n : {512, 4096}) b->Args({n, 512, 1, stats, thr, isa});
}

// Wall-clock time: with 2 threads the caller's CPU time leaves out the worker's share, and on a
// loaded machine CPU time hides the waits that decoding really pays.
BENCHMARK(BM_Attention)
    ->Name("decode")
    ->Apply(decode_args)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_Attention)
    ->Name("prefill")
    ->Apply(prefill_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace d2o

BENCHMARK_MAIN();
