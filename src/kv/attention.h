// Attention over one sequence's cached slots, producing the statistics KV policies read.
//
// For a chunk of n_tok new tokens whose keys/values were just appended (they are the layer's last
// n_tok slots, in order), query t sees every older slot and the chunk's slots up to itself
// (causal). Each query head h reads KV head h / group (GQA/MQA; MHA when group == 1).
//
// Statistics (only what is requested is computed):
//   accumulate  layer.score[g, j] += sum over the chunk's queries of agg over the group's heads of
//               softmax(q k^T / sqrt(d))[j]   (agg: sum, mean or max; H2O / D2O column sums)
//   window      layer.window[g, j] += the same, but only for queries t >= window_first (SnapKV)
//
// Memory: no n x n matrix is built. Queries are processed in blocks of kQueryBlock; the scores of
// one block ([block, n_head, n_slot]) and per-tile partial outputs are the only scratch, so extra
// memory is O(n_slot) for a fixed block size, at any prompt length. Work is split into fixed tiles
// of kTile slots per KV head, and every reduction runs in tile order, so results are bit-identical
// for any thread count. The output is computed the same way whether or not statistics are asked
// for (a policy that never evicts reproduces the full cache bit for bit).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "core/mem.h"
#include "core/thread_pool.h"
#include "kv/kv_cache.h"
#include "ops/kernel_isa.h"

namespace d2o {

enum class ScoreAgg { kSum, kMean, kMax };
const char* score_agg_name(ScoreAgg a);

struct AttnStatsRequest {
  bool accumulate = false;
  ScoreAgg agg = ScoreAgg::kSum;
  // Queries with chunk index >= window_first add their probabilities to layer.window.
  int window_first = std::numeric_limits<int>::max();
};

struct AttnInput {
  const float* q = nullptr;  // [n_tok, n_head, head_dim], RoPE applied
  float* out = nullptr;      // [n_tok, n_head, head_dim]
  int n_tok = 0;
  int n_head = 0;
  float scale = 1.0f;        // usually 1 / sqrt(head_dim)
};

// Reusable scratch (grows to the largest layer seen, then no allocation).
class AttnScratch {
 public:
  static constexpr int kQueryBlock = 16;
  static constexpr int kTile = 256;
  void ensure(int n_threads, int n_head, int head_dim, int n_slot);

  AlignedBuffer<float> scores;    // [block, n_head, n_slot_cap]
  AlignedBuffer<float> tile_max;  // [block, n_head, n_tiles]
  AlignedBuffer<float> tile_sum;  // [block, n_head, n_tiles]
  AlignedBuffer<float> partial;   // [n_tiles, block, n_head, head_dim]
  AlignedBuffer<float> row_max;   // [block, n_head]
  AlignedBuffer<float> row_inv;   // [block, n_head]  1 / sum
  int n_slot_cap = 0;
  int n_tiles_cap = 0;
  int n_head = 0;
  int head_dim = 0;
  int n_threads = 0;
  // A KV head's group has at most this many query heads (the statistics loop's row arrays).
  static constexpr int kMaxGroup = 64;
};

void attention_forward(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats,
                       ThreadPool& pool, AttnScratch& scratch);
// The same with the inner loops of a given (available) instruction-set level; for tests.
void attention_forward_isa(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats,
                           ThreadPool& pool, AttnScratch& scratch, KernelIsa isa);

// Plain reference (full score rows, double accumulation, single thread) for tests.
void attention_reference(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats);

}  // namespace d2o
