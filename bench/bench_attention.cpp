// Attention throughput on the SmolLM2-135M shape (9 query heads, 3 KV heads, head_dim 64) and on
// a Gemma 3 270M global layer (4 query heads, 1 KV head, head_dim 256) and a head-size-512 global
// layer (8 query heads, 1 KV head, as Gemma 4's) per context length: decode (1 query over n slots)
// and prefill (a chunk of 512 queries whose last query sees n slots), for F16 and F32 caches, with
// and without statistics (the accumulated column sums H2O/D2O need), at 1 and 2 threads and every
// kernel level.
//
// Counters (wall-clock): KV_GB/s = key and value bytes of the visible slots per second (each read
// once per call); us/call is the time of one call, i.e. one layer of one decode step.
//
//   build/bench/bench_attention --benchmark_counters_tabular=true [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kv/attention.h"
#include "kv/kv_cache.h"

namespace d2o {
namespace {

struct Shape {
  int heads, heads_kv, head_dim;
};
// SmolLM2-135M, Gemma 3 270M, a global layer of head size 512 (as Gemma 4's)
constexpr Shape kShapes[] = {{9, 3, 64}, {4, 1, 256}, {8, 1, 512}};

struct Fixture {
  KvCache cache;
  std::vector<float> q, out;
  AttnScratch scratch;
  explicit Fixture(KvType type, int n_slot, int n_tok, Shape sh)
      : cache(KvCacheConfig{1, sh.heads_kv, sh.head_dim, type}) {
    const int kHeads = sh.heads, kHeadsKv = sh.heads_kv, kHeadDim = sh.head_dim;
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

// args: n_slot (visible to the last query), n_tok, storage (0 F32, 1 F16, 2 Q8_0, 3 Q4_0),
// statistics (0/1),
// threads, kernel level, shape (index into kShapes)
void BM_Attention(benchmark::State& state) {
  const int n_slot = static_cast<int>(state.range(0));
  const int n_tok = static_cast<int>(state.range(1));
  static const KvType kTypes[] = {KvType::kF32, KvType::kF16, KvType::kQ8_0, KvType::kQ4_0};
  const KvType type = kTypes[state.range(2)];
  const bool stats = state.range(3) != 0;
  const int threads = static_cast<int>(state.range(4));
  const auto isa = static_cast<KernelIsa>(state.range(5));
  const Shape sh = kShapes[state.range(6)];
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("kernel level not available on this CPU");
    return;
  }
  Fixture f(type, n_slot, n_tok, sh);
  ThreadPool pool(threads);
  AttnInput in;
  in.q = f.q.data();
  in.out = f.out.data();
  in.n_tok = n_tok;
  in.n_head = sh.heads;
  in.scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  AttnStatsRequest req;
  req.accumulate = stats;
  for (auto _ : state) {
    attention_forward_isa(in, f.cache.layer_for_attention(0), req, pool, f.scratch, isa);
    benchmark::DoNotOptimize(f.out.data());
  }
  const double elem = static_cast<double>(kv_row_bytes(type.k, sh.head_dim)) / sh.head_dim;
  // Slots read: every query block reads the slots its last query sees.
  double slots = 0;
  const int n_old = n_slot - n_tok;
  for (int t0 = 0; t0 < n_tok; t0 += AttnScratch::kQueryBlock) {
    slots += n_old + std::min(n_tok, t0 + AttnScratch::kQueryBlock);
  }
  state.counters["KV_GB/s"] = benchmark::Counter(slots * sh.heads_kv * sh.head_dim * 2 * elem,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["us/call"] = benchmark::Counter(
      1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(kv_type_name(type)) + (stats ? " stats" : "") + " " +
                 kernel_isa_name(isa) +
                 (state.range(6) == 1   ? " gemma3"
                  : state.range(6) == 2 ? " hd512"
                                        : ""));
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "type", "stats", "thr", "isa", "shape"});
  for (const int isa : {2, 1, 0})
    for (const int thr : {1, 2})
      for (const int type : {1, 0, 2})
        for (const int stats : {0, 1})
          for (const int n : {128, 512, 2048, 8192}) {
            if (isa == 0 && (n != 2048 || thr != 1)) continue;  // the scalar reference, one point
            b->Args({n, 1, type, stats, thr, isa, 0});
          }
}

void prefill_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "type", "stats", "thr", "isa", "shape"});
  for (const int isa : {2, 1})
    for (const int thr : {1, 2})
      for (const int stats : {0, 1})
        for (const int n : {512, 4096}) b->Args({n, 512, 1, stats, thr, isa, 0});
}

// A Gemma 3 global layer: prefill of 512 queries after 0 and 16384 tokens, decode at 16384.
void gemma_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "type", "stats", "thr", "isa", "shape"});
  for (const int isa : {2, 1})
    for (const int thr : {1, 2}) {
      for (const int n : {512, 16896}) b->Args({n, 512, 1, 0, thr, isa, 1});
      b->Args({16384, 1, 1, 0, thr, isa, 1});
    }
}

// A global layer of head size 512 (8 query heads, 1 KV head): prefill of 512 queries after 4096
// tokens and decode at 16384, at every kernel level (the scalar one is the reference).
void hd512_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"slots", "tok", "type", "stats", "thr", "isa", "shape"});
  for (const int isa : {2, 1, 0}) {
    b->Args({4608, 512, 1, 0, 1, isa, 2});
    b->Args({16384, 1, 1, 0, 1, isa, 2});
  }
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
BENCHMARK(BM_Attention)
    ->Name("gemma3")
    ->Apply(gemma_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Attention)
    ->Name("hd512")
    ->Apply(hd512_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace d2o

BENCHMARK_MAIN();
