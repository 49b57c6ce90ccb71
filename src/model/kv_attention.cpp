#include "model/kv_attention.h"

#include <algorithm>
#include <cstring>

#include "core/assert.h"
#include "core/timer.h"
#include "kv/cold_tier.h"
#include "kv/kv_rotation.h"
#include "ops/hadamard.h"
#include "ops/ops.h"

namespace d2o {

KvAttention::KvAttention(ThreadPool& pool, AttnSplit split, int n_head, int n_head_kv, int head_dim)
    : pool_(pool),
      split_(split),
      n_head_(n_head),
      head_dim_(head_dim),
      kv_dim_(n_head_kv * head_dim),
      q_dim_(n_head * head_dim) {}

// Appends a sequence's keys/values to its cache (each sequence is touched by one task).
Status KvAttention::append(int il, const UbatchInput& in, const SeqRows& sr, const float* k,
                           const float* v) {
  KvCache& cache = *sr.cache;
  const int cnt = sr.r1 - sr.r0;
  // A sliding-window layer first lets go of the slots no query of this pass can see.
  if (cache.config().window(il) > 0) cache.drop_oldest(il, cnt);
  D2O_RETURN_IF_ERROR(cache.reserve(il, cache.layer(il).n_slot() + cnt, /*exact=*/false));
  cache.append(il, k + static_cast<size_t>(sr.r0) * kv_dim_,
               v + static_cast<size_t>(sr.r0) * kv_dim_, in.pos.data() + sr.r0, cnt);
  return {};
}

void KvAttention::record_queries(int il, const LayerDesc& d, const UbatchInput& in,
                                 const SeqRows& sr, const float* q) {
  KvCache& cache = *sr.cache;
  const int w = sr.stats.queries;
  // Sliding-window layers are never compacted: no policy reads their queries.
  if (w <= 0 || d.kind == LayerKind::kSliding || !cache.config().layer_compressible(il)) return;
  QueryWindow& win = cache.queries_for_attention(il);
  win.configure(n_head_, head_dim_, w, d.attn_scale, d.rope);
  query_row_.resize(static_cast<size_t>(q_dim_));
  // Only the last w rows can stay in the window (a pass in several micro-batches records the
  // last w of each; the window keeps the last w of them all).
  for (int r = std::max(sr.r0, sr.r1 - w); r < sr.r1; ++r) {
    std::memcpy(query_row_.data(), q + static_cast<size_t>(r) * q_dim_,
                sizeof(float) * static_cast<size_t>(q_dim_));
    // RoPE at -pos turns every pair back by the angle it was turned by (the same table, sines
    // negated): the query as the projection (and QK-norm) left it.
    rope_apply(d.rope, -static_cast<float>(in.pos[static_cast<size_t>(r)]), n_head_,
               query_row_.data());
    win.push(query_row_.data(), 1);
  }
}

Status KvAttention::recall(int il, const LayerDesc& d, const SeqRows& sr, const float* q,
                           const float* k) {
  KvCache& cache = *sr.cache;
  ColdTier* cold = cache.cold();
  if (!cold || d.kind == LayerKind::kSliding || !cache.config().layer_compressible(il)) return {};
  Stopwatch sw;
  const ColdTierConfig& cc = cold->config();
  const int G = cache.config().n_head_kv, group = n_head_ / G;
  const int hd = cache.config().head_dim;
  const int w = std::min(sr.r1 - sr.r0, std::max(1, cc.window));
  const size_t per_head = static_cast<size_t>(w) * group * hd;
  recall_q_.resize(per_head * static_cast<size_t>(G));
  recalled_.resize(static_cast<size_t>(G));
  const bool whole = cc.ranking == RecallRanking::kWhole;
  const int n_q = w * group;
  if (whole) recall_lse_.resize(static_cast<size_t>(n_q) * G);
  // The window's queries of the query heads that read KV head g (g * group + j); the heads in
  // parallel.
  pool_.run(G, [&](int64_t gi, int) {
    const int g = static_cast<int>(gi);
    float* dst = recall_q_.data() + per_head * static_cast<size_t>(g);
    float* const first = dst;
    for (int r = sr.r1 - w; r < sr.r1; ++r) {
      for (int j = 0; j < group; ++j) {
        std::memcpy(dst, q + static_cast<size_t>(r) * q_dim_ + static_cast<size_t>(g * group + j) * hd,
                    sizeof(float) * static_cast<size_t>(hd));
        dst += hd;
      }
    }
    const int64_t held = cold->n_slots(il, g);
    const int count = static_cast<int>(cc.recall_count(held));
    float* lse = nullptr;
    if (whole && held > count) {  // (only a ranking reads them)
      HotLse a;
      a.layer = &cache.layer(il);
      a.g = g;
      a.hd = hd;
      a.kv_dim = kv_dim_;
      a.group = group;
      a.r0 = sr.r0;
      a.r_first = sr.r1 - w;
      a.scale = d.attn_scale;
      a.mass = sr.stats.mass;
      a.k = k;
      lse = recall_lse_.data() + static_cast<size_t>(n_q) * g;
      hot_log_sum_exp(a, first, 0, n_q, lse);
    }
    cold->recall(il, g, first, n_q, d.attn_scale, count, recalled_[static_cast<size_t>(g)], lse);
  });
  for (const ColdRecall& r : recalled_) cold->note_recalled(r.count());
  D2O_RETURN_IF_ERROR(cache.insert_recalled(il, recalled_));
  cold->recalled_in_pass = true;
  cold->add_recall_seconds(sw.seconds());
  return {};
}

int KvAttention::recall_split(int il, const LayerDesc& d, const SeqRows& sr) const {
  const KvCache& cache = *sr.cache;
  const ColdTier* cold = cache.cold();
  if (!cold || cold->config().reach != RecallReach::kWindow || d.kind == LayerKind::kSliding ||
      !cache.config().layer_compressible(il))
    return 0;
  // The recall's window: the pass's last `window` rows (KvAttention::recall).
  return std::max(0, sr.r1 - sr.r0 - std::max(1, cold->config().window));
}

Status KvAttention::run_split(int il, const LayerDesc& d, const UbatchInput& in, const SeqRows& sr,
                              int n_before, const float* q, const float* k, const float* v,
                              float* out) {
  // The rows before the window: appended, then attending to the hot slots and to themselves
  // (causally, as their keys are the layer's last). They are outside the statistics' window
  // (window_first counts from the pass's first row; the recall's window is its last rows).
  SeqRows before = sr;
  before.r1 = sr.r0 + n_before;
  before.recall = false;
  D2O_RETURN_IF_ERROR(append(il, in, before, k, v));
  attend(il, d, before, q, out, pool_, scratch_);
  // The window: it recalls (its queries and, for recall_ranking=whole, its own keys; the rows
  // before it are hot now), then is appended and attends to everything.
  SeqRows win = sr;
  win.r0 = before.r1;
  win.stats.window_first = std::max(0, sr.stats.window_first - n_before);
  D2O_RETURN_IF_ERROR(recall(il, d, win, q, k));
  D2O_RETURN_IF_ERROR(append(il, in, win, k, v));
  attend(il, d, win, q, out, pool_, scratch_);
  return {};
}

void KvAttention::attend(int il, const LayerDesc& d, const SeqRows& sr, const float* q, float* out,
                         ThreadPool& pool, AttnScratch& scratch) {
  const int src = sr.cache->config().kv_source(il);
  AttnInput ai;
  ai.q = q + static_cast<size_t>(sr.r0) * q_dim_;
  ai.out = out + static_cast<size_t>(sr.r0) * q_dim_;
  ai.n_tok = sr.r1 - sr.r0;
  ai.n_head = n_head_;
  ai.scale = d.attn_scale;
  if (d.kind == LayerKind::kSliding || src != il) {
    // Never compacted: no KV policy reads its statistics (and no slot of it is merged). A layer
    // that reads an earlier layer's slots leaves them and their statistics as they are.
    if (d.kind == LayerKind::kSliding) ai.window = d.window;
    attention_forward(ai, sr.cache->layer_for_attention(src), AttnStatsRequest{}, pool, scratch);
    return;
  }
  AttnStatsRequest stats = sr.stats;
  stats.layer = il;
  attention_forward(ai, sr.cache->layer_for_attention(il), stats, pool, scratch);
}

bool KvAttention::rotate_inputs(std::span<const SeqRows> seqs, const float* q, const float* k,
                                const float* v) {
  int n = 0;
  bool any = false;
  for (const SeqRows& sr : seqs) {
    const KvType t = sr.cache->config().type;
    any = any || t.rot_k || t.rot_v;
    n = std::max(n, sr.r1);
  }
  if (!any) return false;
  // log2(block) adds per element, serial: small next to the projections that made the rows.
  const size_t nq = static_cast<size_t>(n) * q_dim_, nkv = static_cast<size_t>(n) * kv_dim_;
  if (rot_q_.size() < nq) rot_q_.resize(nq);
  if (rot_k_.size() < nkv) rot_k_.resize(nkv);
  if (rot_v_.size() < nkv) rot_v_.resize(nkv);
  for (const SeqRows& sr : seqs) {
    const KvType t = sr.cache->config().type;
    const size_t cnt = static_cast<size_t>(sr.r1 - sr.r0);
    const size_t oq = static_cast<size_t>(sr.r0) * q_dim_;
    const size_t okv = static_cast<size_t>(sr.r0) * kv_dim_;
    float* rq = rot_q_.data() + oq;
    float* rk = rot_k_.data() + okv;
    float* rv = rot_v_.data() + okv;
    std::memcpy(rq, q + oq, sizeof(float) * cnt * q_dim_);
    if (k) {  // (a layer that reads another layer's slots has no keys or values of its own)
      std::memcpy(rk, k + okv, sizeof(float) * cnt * kv_dim_);
      std::memcpy(rv, v + okv, sizeof(float) * cnt * kv_dim_);
    }
    // Blocks never straddle heads (the head size is a multiple of the block): rotating a whole
    // row in blocks rotates each head.
    if (t.rot_k) {
      const int b = kv_rot_block_k(head_dim_);
      hadamard_blocks(rq, static_cast<int64_t>(cnt * q_dim_), b);
      if (k) hadamard_blocks(rk, static_cast<int64_t>(cnt * kv_dim_), b);
    }
    if (t.rot_v && k) {
      hadamard_blocks(rv, static_cast<int64_t>(cnt * kv_dim_), kv_rot_block_v(head_dim_));
    }
  }
  return true;
}

void KvAttention::unrotate_output(const SeqRows& sr, float* out) const {
  if (!sr.cache->config().type.rot_v) return;
  const size_t cnt = static_cast<size_t>(sr.r1 - sr.r0);
  hadamard_blocks(out + static_cast<size_t>(sr.r0) * q_dim_, static_cast<int64_t>(cnt * q_dim_),
                  kv_rot_block_v(head_dim_));
}

Status KvAttention::run(int il, const LayerDesc& d, const UbatchInput& in, const float* q,
                        const float* k, const float* v, float* out, ForwardHooks& hooks) {
  const std::span<const SeqRows> seqs = in.seqs;
  for (const SeqRows& sr : seqs) {
    D2O_ASSERT_MSG(sr.cache->config().window(il) == (d.kind == LayerKind::kSliding ? d.window : 0),
                   "the KV cache's sliding windows do not match the model's layers");
  }
  for (const SeqRows& sr : seqs) record_queries(il, d, in, sr, q);
  const bool own_kv = k != nullptr;  // else the layer reads kv_source(il)'s slots
  if (rotate_inputs(seqs, q, k, v)) {
    q = rot_q_.data();
    k = own_kv ? rot_k_.data() : nullptr;
    v = own_kv ? rot_v_.data() : nullptr;
  }
  // A new turn brings back the cold slots its queries want before it attends (once per turn);
  // with recall_reach=window, only its window's rows attend to them: the rows before the window
  // attend first, then the window recalls and attends (run_split).
  split_rows_.assign(seqs.size(), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (!seqs[i].recall) continue;
    split_rows_[i] = own_kv ? recall_split(il, d, seqs[i]) : 0;
    if (split_rows_[i] == 0) D2O_RETURN_IF_ERROR(recall(il, d, seqs[i], q, k));
  }

  // Sequences run one per task (single-threaded attention, sequences in parallel): short chunks
  // under kAuto, all under kAcrossSequences; only worth it for two or more of them.
  constexpr int kAcrossMaxRows = 4;
  across_.clear();
  if (split_ != AttnSplit::kWithinSequence && pool_.n_threads() > 1) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int cnt = seqs[i].r1 - seqs[i].r0;
      if ((split_ == AttnSplit::kAcrossSequences || cnt <= kAcrossMaxRows) && split_rows_[i] == 0) {
        across_.push_back(static_cast<int>(i));
      }
    }
    if (across_.size() < 2) across_.clear();
  }
  size_t next_across = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (next_across < across_.size() && across_[next_across] == static_cast<int>(i)) {
      ++next_across;
      continue;
    }
    if (split_rows_[i] > 0) {
      D2O_RETURN_IF_ERROR(run_split(il, d, in, seqs[i], split_rows_[i], q, k, v, out));
    } else {
      if (own_kv) D2O_RETURN_IF_ERROR(append(il, in, seqs[i], k, v));
      attend(il, d, seqs[i], q, out, pool_, scratch_);
    }
    unrotate_output(seqs[i], out);
    if (seqs[i].layer_hook)  // alone: the whole pool attended, nothing else runs
      D2O_RETURN_IF_ERROR(hooks.after_attention(static_cast<int>(i), il, d, -1));
  }
  if (across_.empty()) return {};

  const size_t nt = static_cast<size_t>(pool_.n_threads());
  if (solo_pools_.size() < nt) {
    solo_scratch_.resize(nt);
    while (solo_pools_.size() < nt) solo_pools_.push_back(std::make_unique<ThreadPool>(1));
  }
  task_status_.assign(across_.size(), Status());
  pool_.run(static_cast<int64_t>(across_.size()), [&](int64_t task, int thread) {
    const int s = across_[static_cast<size_t>(task)];
    const SeqRows& sr = seqs[static_cast<size_t>(s)];
    Status st = own_kv ? append(il, in, sr, k, v) : Status();
    if (!st.ok()) {
      task_status_[static_cast<size_t>(task)] = std::move(st);
      return;
    }
    attend(il, d, sr, q, out, *solo_pools_[static_cast<size_t>(thread)],
           solo_scratch_[static_cast<size_t>(thread)]);
    unrotate_output(sr, out);
    if (sr.layer_hook)
      task_status_[static_cast<size_t>(task)] = hooks.after_attention(s, il, d, thread);
  });
  for (const Status& st : task_status_) D2O_RETURN_IF_ERROR(st);
  return {};
}

}  // namespace d2o
