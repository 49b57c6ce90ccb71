// Attention over one sequence's cached slots, producing the statistics KV policies read.
//
// For a chunk of n_tok new tokens whose keys/values were just appended (they are the layer's last
// n_tok slots, in order), query t sees every older slot and the chunk's slots up to itself
// (causal). Each query head h reads KV head h / group (GQA/MQA; MHA when group == 1).
//
// Statistics (only what is requested is computed):
//   accumulate  layer.score(g)[j] += sum over the chunk's queries of agg over the group's heads of
//               softmax(q k^T / sqrt(d))[j]   (agg: sum, mean or max; H2O / D2O column sums)
//   window      layer.window(g)[j] += the same, but only for queries t >= window_first (the
//               pass's last queries; window_max: the largest such value instead of the sum)
//
// How it runs: slots are cut into chunks of kTile slots at fixed positions (0, kTile, ...). For
// every query row and chunk the kernel forms the chunk's scores, their maximum m_c, e = exp(s -
// m_c), l_c = sum e and acc_c = sum e v; the chunks of a row are then merged in chunk order
// (online softmax at chunk granularity: M = max, L and O rescaled by exp(m - M)). Only what one
// chunk needs is ever materialised (plus, with statistics, the e values of the rows in flight), so
// extra memory is O(n_slot) at any prompt length; no n x n matrix exists.
// The work is split two ways with the same arithmetic: a long chunk of queries runs one task per
// (KV head, block of kQueryBlock queries), each sweeping its chunks and merging as it goes; a
// short one (decoding) runs one task per (KV head, chunk) so that both threads share even a single
// query, and merges the stored chunk partials afterwards. Either way a query's output, and the
// probabilities behind its statistics, depend only on its own scores and the fixed chunk
// boundaries: they are bit-identical for any thread count and however tokens are grouped into
// passes (the masked keys a longer block adds contribute exact zeros). Statistics are summed per
// block of queries and added in query order. The output is computed the same way whether or not
// statistics are asked for (a policy that never evicts reproduces the full cache bit for bit).
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

// A one-token pass can also form, while it reads a layer's keys for the scores, the dot products
// of one more vector per KV head with every key of that head: D2O's nearest-key search for the
// slot it expects to evict next (kv/policy/composed.cpp), which then needs no pass of its own.
// The policy arms it between passes: for layer il and KV head g, the slot slot[il * G + g] (-1:
// none). The attention of layer il loads each armed slot's key (KvLayer::load_key, as it is then)
// and writes
//   dot[g * n + j] = scale * (key . key of slot j), j < n = the head's slots (keys as the scores
//   read them, with the scores' arithmetic: the bits of the kernels' scores() for that row)
// for the armed heads, sets formed[g] for them, dot_layer = il, dot_n = n and dot_scale = scale.
// Only when scale is a power of two (then dot / scale is exact); otherwise dot_layer stays -1.
struct AttnProbe {
  int n_head_kv = 0;
  std::vector<int32_t> slot;    // [n_layer * n_head_kv], -1: not armed
  std::vector<float> key;       // [n_head_kv * head_dim] the armed keys of layer dot_layer
  std::vector<float> dot;       // [n_head_kv * n] of layer dot_layer
  std::vector<uint8_t> formed;  // [n_head_kv] of layer dot_layer
  int dot_layer = -1, dot_n = 0;
  float dot_scale = 1.0f;
};

struct AttnStatsRequest {
  bool accumulate = false;
  ScoreAgg agg = ScoreAgg::kSum;
  // Queries with chunk index >= window_first add their probabilities to layer.window.
  int window_first = std::numeric_limits<int>::max();
  // The window holds the most attention any one of those queries gives a slot, not the sum
  // (probabilities are >= 0, so a window reset to 0 starts the maximum).
  bool window_max = false;
  // Proportional attention: a slot standing for 1 + layer.merged[j] tokens (merged ones) gets
  // log(1 + merged) added to its logit, so the group keeps the attention mass its tokens had
  // together. Changes the output, not only statistics.
  bool mass = false;
  // > 0: the rows' queries are recorded, before RoPE, into the layer's QueryWindow
  // (KvCache::queries), which keeps the sequence's last `queries` tokens. Done by the model's
  // attention step (model/kv_attention.cpp), not by attention_forward.
  int queries = 0;
  // Non-null on a one-token pass: the dot products armed for `layer` (AttnProbe).
  AttnProbe* probe = nullptr;
  int layer = -1;
};

struct AttnInput {
  const float* q = nullptr;  // [n_tok, n_head, head_dim], RoPE applied
  float* out = nullptr;      // [n_tok, n_head, head_dim]
  int n_tok = 0;
  int n_head = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // > 0: sliding-window attention: query t sees only the last `window` slots up to its own
  // (slots [n_old + t + 1 - window, n_old + t]). For a layer whose slots hold consecutive
  // positions (a sliding-window layer is never compacted), that is the last `window` positions.
  int window = 0;
};

// Reusable scratch (grows to the largest call seen, then no allocation).
class AttnScratch {
 public:
  static constexpr int kQueryBlock = 16;
  static constexpr int kTile = 256;  // slots per chunk
  // A KV head's group has at most this many query heads.
  static constexpr int kMaxGroup = 64;

  struct Shape {
    int n_threads = 1, n_head = 0, n_head_kv = 1, head_dim = 0, n_slot = 0, n_tok = 0;
    bool split_chunks = false;  // one task per (KV head, chunk): stored chunk partials
    bool stats = false;
  };
  void ensure(const Shape& s);

  // Per thread (per-block tasks).
  struct Thread {
    AlignedBuffer<float> e;             // [rows, e_stride] exp(s - m_chunk) of a block's rows
    AlignedBuffer<float> m_chunk;       // [rows, n_tiles] chunk maxima (statistics)
    AlignedBuffer<float> f;             // [rows] statistics factors of one chunk
    AlignedBuffer<float> kf, vf;        // [kTile, head_dim] F32 copies of an F16 chunk
    AlignedBuffer<float> acc;           // [rows, head_dim] one chunk's partial outputs
    AlignedBuffer<float> o;             // [rows, head_dim] running outputs
    AlignedBuffer<float> m, l, cm, cl;  // [rows] running max / sum, one chunk's max / sum
  };
  std::vector<Thread> threads;
  size_t e_stride = 0;  // floats per row of Thread::e

  // Shared (chunk-split tasks): e [n_tok * n_head, n_slot_cap]; chunk partials
  // [n_tiles, n_tok * n_head] (max, sum) and [n_tiles, n_tok * n_head, head_dim] (outputs).
  AlignedBuffer<float> e_all, part_m, part_l, part_acc;
  // Per query row [n_tok * n_head]: final max and 1 / sum (statistics).
  AlignedBuffer<float> row_max, row_inv;
  // Per-block column sums [n_blocks, n_head_kv, n_slot_cap] (statistics of per-block tasks).
  AlignedBuffer<float> col_score, col_window;
  int n_slot_cap = 0;
  int n_tiles_cap = 0;
  int n_blocks_cap = 0;
  int rows_cap = 0;  // n_tok * n_head
};
// `layer`: KvCache::layer_for_attention(il), the door through which statistics are accumulated.
void attention_forward(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats,
                       ThreadPool& pool, AttnScratch& scratch);
// The same with the inner loops of a given (available) instruction-set level; for tests.
void attention_forward_isa(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats,
                           ThreadPool& pool, AttnScratch& scratch, KernelIsa isa);

// Plain reference (full score rows, double accumulation, single thread) for tests.
void attention_reference(const AttnInput& in, KvLayer& layer, const AttnStatsRequest& stats);

}  // namespace d2o
