// KvCache::apply (kv/kv_cache.h): a policy's CompactionPlan carried out on one layer (merges,
// the gather of the kept slots, the position shift), kept apart from kv_cache.cpp so that file
// stays about storage, growth and copies.
#include <algorithm>
#include <cstring>

#include "core/assert.h"
#include "kv/kv_cache.h"
#include "ops/ops.h"

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

}  // namespace

// Head h keeps old slots keep[0..nk) (strictly ascending) of its n_old. keep[i] - i never
// decreases, so the runs of consecutive kept slots are found by binary search, and each run
// moves with one memmove.
//   Front: kept slot i goes to index i. Slots before the first gap stay.
//   Back: kept slot i goes to index e + i (e = n_old - nk evicted), i.e. the head's entries
//   move up by e and its offset with them; slots after the last gap stay. Only when the
//   head's block has room above the old end, which it always has (the end does not move).
void KvCache::gather_head(KvLayer& L, int h, const int32_t* keep, int nk, int n_old) {
  if (nk == n_old) return;  // nothing evicted (keep is then 0..n_old-1)
  const int e = n_old - nk;
  // Slots that move in each direction: front = nk - (first i with keep[i] != i); back = (last
  // i with keep[i] != e + i) + 1. keep[i] - i is non-decreasing from >= 0 to <= e.
  const int32_t* first_gap = std::partition_point(
      keep, keep + nk, [&](const int32_t& v) { return v == static_cast<int32_t>(&v - keep); });
  const int moved_front = static_cast<int>(keep + nk - first_gap);
  const int32_t* tail =
      std::partition_point(keep, keep + nk, [&](const int32_t& v) { return v - (&v - keep) < e; });
  const int moved_back = static_cast<int>(tail - keep);
  if (moved_front <= moved_back) {
    int i = static_cast<int>(first_gap - keep);
    while (i < nk) {
      const int j = keep[i];
      D2O_ASSERT(j >= i && j < n_old && (i == 0 || j > keep[i - 1]));
      const int end = static_cast<int>(  // the run is [i, end): keep[x] - x == j - i
          std::partition_point(keep + i + 1, keep + nk,
                               [&](const int32_t& v) { return v - (&v - keep) == j - i; }) -
          keep);
      if (j != i) L.move_slots(h, i, j, end - i);
      i = end;
    }
    return;
  }
  // Back: runs from the last moving one down to the first, each to e + its index (relative to
  // the old offset), so no run overwrites one not yet moved; then the offset moves up by e.
  int end = moved_back;
  while (end > 0) {
    const int d = keep[end - 1] - (end - 1);  // this run's keep[x] - x
    D2O_ASSERT(d >= 0 && d < e);
    const int begin = static_cast<int>(
        std::partition_point(keep, keep + end - 1,
                             [&](const int32_t& v) { return v - (&v - keep) < d; }) -
        keep);
    L.move_slots(h, begin + e, begin + d, end - begin);
    end = begin;
  }
  if (L.off_.empty()) L.off_.assign(static_cast<size_t>(L.n_head_kv_), 0);
  L.off_[static_cast<size_t>(h)] += e;
}

void KvCache::apply(int il, const CompactionPlan& plan) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(plan.n_head_kv == L.n_head_kv_);
  D2O_ASSERT(plan.n_keep >= 0 &&
             (plan.head_keep.empty() ? plan.n_keep <= L.n_slot_
                                     : plan.head_keep.size() == static_cast<size_t>(L.n_head_kv_)));
  const int hd = L.head_dim_;

  // 1. Merges, on the old slot indices (sources are evicted slots, so no source is overwritten
  //    before it is read). Accumulate in fp32, store once.
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
      D2O_ASSERT(m.src >= 0 && m.src < L.n_slot(head));
      L.load_key(head, m.src, tmp_k_.data());
      L.load_value(head, m.src, tmp_v_.data());
      if (plan.rope && m.src != dst) {
        const int32_t src_pos = L.pos_[L.meta_index(head, m.src)];
        rope_apply(*plan.rope, static_cast<float>(dst_pos - src_pos), 1, tmp_k_.data());
      }
      add_scaled(acc_k_.data(), tmp_k_.data(), m.w, acc_k_.size());
      add_scaled(acc_v_.data(), tmp_v_.data(), m.w, acc_v_.size());
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

  // 2. Gather the kept slots, in order. Either toward the front of the head (slots before the
  //    first evicted one stay where they are) or toward its end (slots after the last evicted
  //    one stay, and the head's offset moves up by the slots evicted): whichever moves fewer
  //    slots. A decode step evicts one slot per head, often in the older half of the cache, so
  //    moving the slots in front of it up costs less than moving every slot behind it down.
  for (int h = 0; h < L.n_head_kv_; ++h) {
    const int32_t* keep = plan.keep_of(h);
    const int nk = plan.n_keep_of(h);
    const int n_old = L.n_slot(h);
    D2O_ASSERT(nk >= 0 && nk <= plan.n_keep && nk <= n_old);
    gather_head(L, h, keep, nk, n_old);
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
