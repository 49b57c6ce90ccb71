// Token level: which slots of one KV head survive a compaction. Slot indices are ascending
// (chronological); every function writes exactly S kept indices, ascending.
//
// Tie rule everywhere a ranking is needed: a higher score wins; equal scores keep the older
// (lower) slot. So the single eviction of a decode step removes the lowest-scoring slot outside
// the protected ranges, the newer one among equals.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/policy/config.h"

namespace d2o {

// Scratch of the selectors for one thread of a compaction (only grows).
struct SelectScratch {
  std::vector<float> score;    // [n] per-slot selection scores (mean attention, pooled window, ...)
  std::vector<int32_t> order;  // [n] index lists of select_top and friends
  std::vector<float> row;      // [head_dim] one key (KeyDiff)
  std::vector<double> anchor;  // [head_dim] (KeyDiff)
  std::vector<float> guarded;  // [n] scores with the distinct_share= candidates raised (KeyDiff)
  // Per-head budgets (select_heads.h): per-head scores, kept slots and taken flags (the heads'
  // parts packed, from head_off), per-head counts, and the candidates competing over heads.
  struct Cand {
    float s;
    int32_t g, j;
  };
  std::vector<float> head_score;
  std::vector<int32_t> head_keep, head_n, head_off, head_count;
  std::vector<uint8_t> taken;
  std::vector<Cand> pool;
  // Expected attention (score_expected.cpp): the statistics' rows turned to the future positions
  // [group * (1 + queries), head_dim], their dots with one tile of keys, each query head's logits
  // [group, n], the expected attention [n], the mean rotation per RoPE pair (cos, sin).
  std::vector<float> ea_rows, ea_dots, ea_z, ea_e;
  std::vector<const float*> ea_q;
  std::vector<float*> ea_s;
  std::vector<double> ea_mean, ea_rot;
};

// out[0..n) = first, first + 1, ..., first + n - 1 (n <= 0: nothing).
void write_range(int32_t* out, int32_t first, int n);

// Split of the S - T slots after the sinks into N heavy hitters and M recent slots, N:M = n:m.
// M = round-half-up((S - T) * m / (n + m)), at least 1 when S > T; N = S - T - M.
void split_heavy_recent(int S, int sinks, int nm_n, int nm_m, int* heavy, int* recent);

// The k best slots of [first, first + count) by score (ties: lower index), ascending, into out.
// Linear for k == count - 1 (one eviction), nth_element otherwise. scratch: count ints.
void select_top(const float* score, int first, int count, int k, int32_t* out, int32_t* scratch);

// T sinks, the N best-scored slots in between, the M most recent (N:M = heavy_recent=); score:
// [n]. What Keeper (keeper.h) keeps with the split rule, for callers holding a whole head's scores.
void select_heavy_recent(const float* score, int n, int S, const PolicyConfig& cfg, int32_t* keep,
                         int32_t* scratch);

// SnapKV: 1-D pooling (stride 1, kernel k odd, padding k/2) of the window attention of the
// n_prefix slots before the observation window. avg counts the zero padding (PyTorch
// avg_pool1d default, count_include_pad): sum / k; max ignores the padding.
void pool_window(const float* window, int n_prefix, int kernel, PoolKind pool, float* out);

// prompt_scores=window: out[j] = pooled[j] / n_queries * (next_pos - pos[j]) for j in [first, end):
// the window's pooled attention per window query, as a score accumulated over the queries that have
// seen slot j (so its mean attention is the pooled score). out may be pooled.
void window_scores(const float* pooled, const int32_t* pos, int first, int end, int n_queries,
                   int64_t next_pos, float* out);

}  // namespace d2o
