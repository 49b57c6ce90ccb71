// Throughput benchmark in the manner of llama.cpp's llama-bench: prompt processing ("pp N": one
// forward pass of N tokens) and text generation ("tg N": N forward passes of one token each),
// each after d tokens of real text were prefilled untimed ("@ d8192"), for any KV policy.
//
// A KV policy applies to the depth prefill the way it applies to a prompt: the d tokens are one
// forward pass (or announced chunks, BenchConfig::depth_chunk), after which the policy compresses
// the cache (prompt-then-compress), and the timed
// pp / tg passes then run on the compressed cache, compacting after every pass as in real use.
//
// The state after a depth prefill is kept (one copy per depth and policy, as llama-bench keeps its
// depth state) and restored before each repetition, so repetitions time only the test itself.
// Figures are tokens per second, mean and sample standard deviation over the repetitions (the
// mean of per-repetition rates, as llama-bench reports them).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/engine.h"

namespace d2o {

enum class BenchKind { kPrompt, kGen };

struct BenchTest {
  BenchKind kind = BenchKind::kPrompt;
  int n = 0;      // tokens timed
  int depth = 0;  // tokens prefilled (untimed) before
  // "pp512", "tg128", "pp512 @ d8192" (llama-bench's names).
  std::string name() const;
};

// Parses a list of non-negative integers as llama-bench writes them: "0,2048,4096", ranges
// "first-last" (step 1), "first-last+step" and "first-last*mult". Errors name `what` (the flag) and
// the bad item. Values must be in [min_value, max_value].
Result<std::vector<int>> parse_int_list(std::string_view s, std::string_view what, int min_value,
                                        int max_value);

// The tests of a run, in llama-bench's order: for each depth, every pp size, then every tg size
// (sizes of 0 are skipped, as llama-bench does with -p 0 / -n 0).
std::vector<BenchTest> make_bench_tests(std::span<const int> n_prompt, std::span<const int> n_gen,
                                        std::span<const int> depths);

struct BenchConfig {
  int repetitions = 5;
  int n_ctx = 0;  // > 0: every test must fit (depth + n <= n_ctx); 0: no limit (llama-bench)
  KvType kv_type = KvType::kF16;
  // > 0: the depth is prefilled in passes of this many tokens, announced as a prompt's chunks
  // (prefill_chunks), so a fixed budget or prefill=bounded compacts between them; 0: one pass.
  int depth_chunk = 0;
};

struct BenchResult {
  BenchTest test;
  std::string kv_spec;            // canonical spec of the policy
  std::vector<double> seconds;    // timed part of each repetition
  double tps_mean = 0;            // tokens/s: mean over repetitions of n / seconds
  double tps_stddev = 0;          // sample standard deviation of the same (0 for one repetition)
  double depth_seconds = 0;       // the untimed depth prefill (0 at depth 0)
  int64_t slots_after_depth = 0;  // slots per KV head summed over layers after the depth prefill
  int64_t slots = 0;              // the same after the test (last repetition)
  size_t kv_bytes = 0;            // K/V bytes allocated after the test
  size_t kv_bytes_used = 0;       // K/V bytes holding slots after the test
  size_t kv_bytes_full = 0;       // what a full cache of the same tokens takes
  // Peak resident memory of the process during the timed repetitions, without the saved copy of
  // the depth state (the bench's own overhead); 0 where the kernel cannot reset the peak.
  size_t peak_rss = 0;
  // Engine split of the timed part, summed over repetitions (seconds).
  EngineTimings timings;
};

// Runs `tests` (built by make_bench_tests: tests of one depth are adjacent) with one policy,
// calling on_result after each. `text` is the token stream: a test reads tokens [0, depth + n).
// Errors: a test that does not fit in cfg.n_ctx or needs more tokens than `text` holds (checked
// for all tests before anything runs), bad repetition counts, engine errors.
Status run_bench(Engine& engine, std::span<const TokenId> text, std::span<const BenchTest> tests,
                 const std::shared_ptr<const KvPolicy>& policy, const BenchConfig& cfg,
                 const std::function<void(const BenchResult&)>& on_result);

// The same tests for several policies, interleaved: after each depth prefill (one per policy),
// every repetition is a round of one run per policy, in the given order on even rounds and in
// reverse on odd ones. A drift of the machine's speed (another process, clock changes) then
// falls on every policy alike, and the rates of one round can be compared pairwise
// (paired_ratios). on_result(policy index, result) is called per test for every policy, in
// policy order, after the test's last round. peak_rss stays 0 (the policies share the process).
// Holds two sequences per policy (the saved depth state and the working one) at once.
Status run_bench_interleaved(Engine& engine, std::span<const TokenId> text,
                             std::span<const BenchTest> tests,
                             std::span<const std::shared_ptr<const KvPolicy>> policies,
                             const BenchConfig& cfg,
                             const std::function<void(size_t, const BenchResult&)>& on_result);

// Per-repetition rate of `a` over that of `base` (the same test; repetition i of both from the
// same round when interleaved): base.seconds[i] / a.seconds[i], for the repetitions both have.
std::vector<double> paired_ratios(const BenchResult& a, const BenchResult& base);

// Memory read bandwidth with the pool's threads, bytes per second: the best of `reps` parallel
// sweeps over a buffer of `bytes` (make it much larger than the caches, e.g. 1 GiB). The limit
// that decoding, which streams the weights and the KV cache once per token, runs against.
Result<double> measure_read_bandwidth(ThreadPool& pool, size_t bytes, int reps);

// Checks tests against the context and the text length (what run_bench checks first).
Status validate_bench_tests(std::span<const BenchTest> tests, int64_t n_text_tokens,
                            const BenchConfig& cfg);

}  // namespace d2o
