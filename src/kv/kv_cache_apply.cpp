// KvCache::apply (kv/kv_cache.h): a policy's CompactionPlan carried out on one layer, kept apart
// from kv_cache.cpp so that file stays about the cache's storage.
#include <algorithm>
#include <cstring>

#include "core/assert.h"
#include "core/mem.h"
#include "core/thread_pool.h"
#include "kv/kv_cache.h"
#include "ops/ops.h"
#include "ops/quant.h"

namespace d2o {

namespace {

// acc[0..n) += w * x[0..n), n a multiple of 4: four lanes at a time, each as the scalar loop.
void add_scaled(float* acc, const float* x, float w, size_t n) {
  using V4 = float __attribute__((vector_size(16)));
  for (size_t d = 0; d < n; d += 4) {
    V4 a, b;
    std::memcpy(&a, acc + d, sizeof a);
    std::memcpy(&b, x + d, sizeof b);
    a += w * b;
    std::memcpy(acc + d, &a, sizeof a);
  }
}

// The end of the run of kept slots starting at keep[i]: the run is [i, end), where keep[x] - x ==
// keep[i] - i (keep strictly ascending, so keep[x] - x never decreases: a binary search).
int run_end(const int32_t* keep, int nk, int i) {
  const int32_t d = keep[i] - i;
  return static_cast<int>(
      std::partition_point(keep + i + 1, keep + nk,
                           [&](const int32_t& v) { return v - (&v - keep) == d; }) -
      keep);
}

}  // namespace

void KvCache::apply(int il, const CompactionPlan& plan, ThreadPool* pool) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(plan.n_head_kv == L.n_head_kv_);
  D2O_ASSERT(plan.n_keep >= 0 &&
             (plan.head_keep.empty() ? plan.n_keep <= L.n_slot_
                                     : plan.head_keep.size() == static_cast<size_t>(L.n_head_kv_)));
  const int hd = L.head_dim_;
  // 0. The evicted slots, as they are, into the cold tier (a plan that renumbers positions has
  //    none: a cold tier needs positions=original).
  if (cold_ && plan.shift.by == 0) to_cold(il, plan);

  // 1. Merges, on the old slot indices (sources are evicted slots, so no source is overwritten
  //    before it is read). Accumulate in fp32, store once.
  // The rows are read in the order of the terms, grouped by destination: the hardware's stride
  // prefetch does not follow them, and after a prompt's compaction planned every layer first they
  // are no longer in the core's caches. Each term asks for the rows of the term kAhead later.
  constexpr size_t kAhead = 8;
  auto prefetch_term = [&](size_t i) {
    if (i >= plan.merges.size()) return;
    const MergeTerm& m = plan.merges[i];
    if (m.src < 0 || m.src >= L.n_slot(m.head)) return;  // (asserted when used)
    prefetch_bytes(L.key_row(m.head, m.src), L.key_row_bytes());
    prefetch_bytes(L.value_row(m.head, m.src), L.value_row_bytes());
  };
  // (A decode step's few terms read rows its attention has just read: nothing to ask for.)
  const bool prefetch = plan.merges.size() > 2 * kAhead;
  if (prefetch) {
    for (size_t i = 0; i < kAhead; ++i) prefetch_term(i);
  }
  if (!plan.merges.empty()) L.merged_live_ = true;
  size_t t = 0;
  while (t < plan.merges.size()) {
    const int head = plan.merges[t].head;
    const int dst = plan.merges[t].dst;
    std::fill(acc_k_.begin(), acc_k_.end(), 0.0f);
    std::fill(acc_v_.begin(), acc_v_.end(), 0.0f);
    float score_sum = 0.0f, score_max = 0.0f;
    int32_t merged = 0, n_terms = 0;
    D2O_ASSERT(dst >= 0 && dst < L.n_slot(head));
    const int32_t dst_pos = L.pos_[L.meta_index(head, dst)];
    size_t e = t;
    for (; e < plan.merges.size() && plan.merges[e].head == head && plan.merges[e].dst == dst;
         ++e) {
      const MergeTerm& m = plan.merges[e];
      if (prefetch) prefetch_term(e + kAhead);
      D2O_ASSERT(m.src >= 0 && m.src < L.n_slot(head));
      // F16 rows go into the sums as they are converted (the same products and sums as
      // add_scaled of the converted row); a key rotated to the kept slot's position first
      // (merge_keys=unrotated), and other storage types, through a converted row.
      const bool rotate = plan.rope && m.src != dst;
      if (L.type_.k == KvElemType::kF16 && !rotate) {
        fp16_axpy_row(acc_k_.data(), L.key_row(head, m.src), m.w, hd);
      } else {
        L.load_key(head, m.src, tmp_k_.data());
        if (rotate) {
          const int32_t src_pos = L.pos_[L.meta_index(head, m.src)];
          rope_apply(*plan.rope, static_cast<float>(dst_pos - src_pos), 1, tmp_k_.data());
        }
        add_scaled(acc_k_.data(), tmp_k_.data(), m.w, acc_k_.size());
      }
      if (L.type_.v == KvElemType::kF16) {
        fp16_axpy_row(acc_v_.data(), L.value_row(head, m.src), m.w, hd);
      } else {
        L.load_value(head, m.src, tmp_v_.data());
        add_scaled(acc_v_.data(), tmp_v_.data(), m.w, acc_v_.size());
      }
      const size_t mi = L.meta_index(head, m.src);
      score_sum += L.score_[mi];
      score_max = n_terms == 0 ? L.score_[mi] : std::max(score_max, L.score_[mi]);
      ++n_terms;
      merged += m.src == dst ? L.merged_[mi] : 1 + L.merged_[mi];
    }
    L.store_key(head, dst, acc_k_.data());
    L.store_value(head, dst, acc_v_.data());
    const size_t di = L.meta_index(head, dst);
    switch (plan.merged_score) {
      case MergedScore::kSum:
        L.score_[di] = score_sum;
        break;
      case MergedScore::kKeep:
        break;
      case MergedScore::kMean:
        L.score_[di] = score_sum / static_cast<float>(n_terms);
        break;
      case MergedScore::kMax:
        L.score_[di] = score_max;
        break;
    }
    L.merged_[di] = merged;
    t = e;
  }

  // 2. Gather kept slots to the front, in order (keep is ascending, so moving forward in place is
  //    safe). Runs of consecutive kept slots move with one memmove each: a decode step evicts one
  //    slot per head, so this is usually one long run. keep is strictly ascending, so keep[i] - i
  //    never decreases and a run's end is found by binary search. Only the metadata and the row
  //    map move: first each evicted slot's row below nk takes a kept row from nk or above (the
  //    kept slots then hold rows [0, nk); kv_cache.h), found from the newest kept slot down.
  //    Heads are independent: on `pool`, one task per head.
  //    Every kReorderAfter evictions the rows are also put back in slot order (kv_cache.h).
  int n_evicted = 0;  // the most any head evicts
  for (int h = 0; h < L.n_head_kv_; ++h)
    n_evicted = std::max(n_evicted, L.n_slot(h) - plan.n_keep_of(h));
  const bool reorder = L.note_evictions(n_evicted);
  auto gather = [&](int64_t head, int) {
    const int h = static_cast<int>(head);
    const int32_t* keep = plan.keep_of(h);
    const int nk = plan.n_keep_of(h);
    const int n = L.n_slot(h);
    D2O_ASSERT(nk >= 0 && nk <= plan.n_keep);
    int next = nk;  // movers: keep[next - 1], keep[next - 2], ...
    auto movers = [&] {
      D2O_ASSERT(next > 0);
      return keep[--next];
    };
    int i = 0, prev = -1;  // prev: the last kept slot before run i
    while (i < nk) {
      const int j = keep[i];
      D2O_ASSERT(j >= i && j < n && (i == 0 || j > keep[i - 1]));
      for (int e = prev + 1; e < j; ++e) L.fill_hole(h, nk, e, movers);
      const int end = run_end(keep, nk, i);
      prev = keep[end - 1];
      i = end;
    }
    for (int e = prev + 1; e < n; ++e) L.fill_hole(h, nk, e, movers);
    i = 0;
    while (i < nk) {
      const int j = keep[i];
      const int end = run_end(keep, nk, i);
      if (j != i) L.move_slots(h, i, j, end - i);
      i = end;
    }
    if (reorder) L.order_rows(h, nk);
  };
  if (pool && pool->n_threads() > 1 && L.n_head_kv_ > 1) {
    pool->run(L.n_head_kv_, gather);
  } else {
    for (int h = 0; h < L.n_head_kv_; ++h) gather(h, 0);
  }
  L.set_counts(plan.head_keep.empty() ? nullptr : plan.head_keep.data(), plan.n_keep);

  // 3. Position shift: keys re-rotated for their new positions.
  const PositionShift& sh = plan.shift;
  if (sh.by > 0) {
    D2O_ASSERT(sh.rope && sh.rope->head_dim == hd && sh.first_slot >= 0);
    float* row = tmp_k_.data();
    for (int h = 0; h < L.n_head_kv_; ++h) {
      for (int j = sh.first_slot; j < L.n_slot(h); ++j) {
        L.load_key(h, j, row);
        rope_apply(*sh.rope, -static_cast<float>(sh.by), 1, row);
        L.store_key(h, j, row);
        L.pos_[L.meta_index(h, j)] -= sh.by;
      }
    }
  }
}

}  // namespace d2o
