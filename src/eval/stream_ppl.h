// `d2o eval ppl`: the paper's PG-19 protocol (perplexity with a fixed-capacity cache).
//
// A long text is fed through every policy from an empty cache, token by token (or in chunks of
// C tokens), while the policy keeps each layer at a fixed capacity of B slots per KV head
// (`budget=B`: streaming with a fixed capacity; a layer is compacted whenever it holds more than
// its budget). The NLL of every next token is recorded, so the report can show the running mean
// NLL against position for every policy and capacity, with the full cache as the reference.
// All sequences (every policy at every capacity, plus the full cache) advance together in one
// batch: the weights are read once per step for all of them, and the numbers are the same as
// running each alone (the matmul does not depend on how rows are grouped; tested).
//
// Positions: with `positions=original` (every policy but streaming:positions=shifted), a token
// keeps its absolute position, so a text longer than the model's trained context puts the full
// cache (and the compressed policies) at positions the model never saw. That is an error for the
// full cache (cut the text with n_tokens); the compressed policies get a warning.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "eval/harness.h"
#include "eval/progress.h"
#include "runtime/engine.h"

namespace d2o::eval {

struct StreamPplParams {
  // Policies as base specs without ratio=/budget= ("streaming", "h2o", "d2o:heavy_recent=1:1");
  // "full" is the reference (run once, whatever the capacities).
  std::vector<std::string> policies;
  std::vector<int> capacities;  // budget=B for each compressed policy
  int64_t n_tokens = 0;         // tokens fed from the start of the text (> 1)
  int chunk = 1;                // tokens per forward pass
  KvType kv_type = KvType::kF16;
  int n_ctx_train = 0;  // the model's trained context (positions beyond it: see above)
};

struct StreamPplRun {
  std::string label;       // preset name ("d2o") or the base spec given
  std::string spec;        // canonical spec run
  int capacity = 0;        // 0: full cache
  std::vector<float> nll;  // [n_tokens - 1]: nll[i] = -log p(token i+1 | tokens 0..i), nats
  double slots_end = 0;    // slots per KV head per layer at the end (mean over layers)
  int64_t evicted = 0, merged = 0;  // summed over layers (per-layer counts of KV-head slots)
};

struct StreamPplResult {
  std::vector<StreamPplRun> runs;  // the full cache first when it was asked for
  int64_t n_tokens = 0;
  int chunk = 1;
  std::vector<std::string> warnings;
  double seconds = 0;
  EngineTimings timings;
};

// Errors: fewer than 2 tokens, n_tokens beyond the text, a bad chunk or capacity, a policy spec
// that sets ratio/budget itself, the full cache beyond the trained context.
Result<StreamPplResult> run_stream_ppl(Engine& engine, std::span<const TokenId> tokens,
                                       const StreamPplParams& p, Progress* progress);

// Summary figures of one run (computed from its per-token NLLs and the full cache's, if any).
struct StreamPplSummary {
  double mean_nll = 0, se_nll = 0;     // over all scored positions (batch means, blocks of 128)
  double ppl = 0;                      // exp(mean_nll)
  double tail_nll = 0, tail_se = 0;    // over positions >= capacity (where compression acts)
  double delta_nll = 0, delta_se = 0;  // mean of nll - nll_full over positions >= capacity
  int64_t n_tail = 0;
  double max_abs_diff_before_capacity = 0;  // |nll - nll_full| before the capacity is reached
};
StreamPplSummary summarize_run(const StreamPplRun& run, const StreamPplRun* full, int block);

// Writes <name>.json (meta, params, per-run summaries and the full per-token NLL arrays),
// <name>.md (tables and the charts) and <name>_c<B>.svg / <name>_c<B>_delta.svg per capacity.
Status write_stream_ppl_report(const StreamPplResult& r, const StreamPplParams& p,
                               const RunMeta& meta, const ReportFiles& files);

// Batch-means block length used for the standard errors (positions).
inline constexpr int kNllBlock = 128;

}  // namespace d2o::eval
