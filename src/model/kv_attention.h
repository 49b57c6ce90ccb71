// KvAttention: one layer's cache append and attention for every sequence of a micro-batch.
//
// Each sequence's new keys and values (rows [r0, r1) of k and v, RoPE applied) are appended to its
// cache's layer, then its queries attend over that layer (attention_forward, with the statistics
// its KV policy asked for). Sequences are independent; how they share the thread pool follows
// ForwardOptions::attn_split (same results either way): a long chunk is split inside its sequence
// over (KV head, slot tile); decode rows of several sequences run one sequence per task, each
// with a single-thread pool and scratch of its own, and such a task calls
// ForwardHooks::after_attention for its sequence when asked (SeqRows::layer_hook), so that a
// policy can compact the layer while its slots are still in the core's caches; a decode row
// that attended alone (on the whole pool) is called back right after its attention, on the
// calling thread.
//
// A sequence whose policy asks for them (AttnStatsRequest::queries) has its rows' last queries
// recorded before RoPE into its cache (KvCache::queries), before anything else of the layer.
//
// A cache with rotated storage (KvType::rot_k / rot_v, kv/kv_rotation.h) gets its sequence's
// queries and keys, and values, rotated before the append and the attention, and the attention
// output rotated back after it; the kernels are those of plain storage.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "kv/attention.h"
#include "kv/cold_tier.h"
#include "model/forward.h"
#include "model/layer_desc.h"

namespace d2o {

class KvAttention {
 public:
  KvAttention(ThreadPool& pool, AttnSplit split, int n_head, int n_head_kv, int head_dim);

  // q, out: [n, n_head * head_dim]; k, v: [n, n_head_kv * head_dim], rows as in `in`; null for
  // a layer that reads an earlier layer's slots (KvCacheConfig::kv_source) and appends none.
  Status run(int il, const LayerDesc& d, const UbatchInput& in, const float* q, const float* k,
             const float* v, float* out, ForwardHooks& hooks);

 private:
  Status append(int il, const UbatchInput& in, const SeqRows& sr, const float* k, const float* v);
  // SeqRows's stats.queries > 0: the sequence's last rows' queries `q` (RoPE applied, not rotated
  // for storage), rotated back to position 0, into the layer's QueryWindow (kv/query_window.h).
  void record_queries(int il, const LayerDesc& d, const UbatchInput& in, const SeqRows& sr,
                      const float* q);
  // SeqRows::recall: the sequence's cold slots that the window's queries `q` want, back into
  // layer il (kv/cold_tier.h); `k`: the pass's keys (recall_ranking=whole counts the turn's own
  // among what its queries attend to), or null.
  Status recall(int il, const LayerDesc& d, const SeqRows& sr, const float* q, const float* k);
  void attend(int il, const LayerDesc& d, const SeqRows& sr, const float* q, float* out,
              ThreadPool& pool, AttnScratch& scratch);
  // recall_reach=window: how many of a recalling pass's rows come before the recall's window
  // (0: none, or the pass recalls as a whole).
  int recall_split(int il, const LayerDesc& d, const SeqRows& sr) const;
  // Such a pass in two steps: its first n_before rows appended and attending without the recall,
  // then the recall by the window's queries, the window appended and attending to all of it.
  Status run_split(int il, const LayerDesc& d, const UbatchInput& in, const SeqRows& sr,
                   int n_before, const float* q, const float* k, const float* v, float* out);
  // Rotated storage: copies of q, k, v whose rows of sequences with rotated caches are rotated;
  // false (nothing copied) when no sequence's cache rotates.
  bool rotate_inputs(std::span<const SeqRows> seqs, const float* q, const float* k,
                     const float* v);
  // Rotates a sequence's attention output back (when its cache rotates values).
  void unrotate_output(const SeqRows& sr, float* out) const;

  ThreadPool& pool_;
  AttnSplit split_;
  int n_head_, head_dim_, kv_dim_, q_dim_;
  std::vector<float> rot_q_, rot_k_, rot_v_;  // rotate_inputs()
  std::vector<float> recall_q_;               // recall(): one KV head's window queries
  std::vector<float> recall_lse_;             // recall(): their log-sum-exps outside the tier
  std::vector<float> query_row_;              // record_queries(): one token's queries
  std::vector<ColdRecall> recalled_;          // recall(): per KV head
  std::vector<int> split_rows_;               // run(): recall_split() per sequence
  AttnScratch scratch_;
  // Sequences in parallel: one single-thread pool and one scratch per thread of pool_.
  std::vector<std::unique_ptr<ThreadPool>> solo_pools_;
  std::vector<AttnScratch> solo_scratch_;
  std::vector<int> across_;          // sequences run one per task
  std::vector<Status> task_status_;  // per such task
};

}  // namespace d2o
