// KvCache's narrow edits outside apply(): values and statistics a policy writes while planning,
// the statistics resets of each pass, the removal of a pass's own slots (the prompt's
// reconstruction), a conversation cut back to a prefix it holds intact (truncate), and the cold
// tier's way in and out.
#include <algorithm>

#include "core/assert.h"
#include "kv/cold_tier.h"
#include "kv/kv_cache.h"

namespace d2o {

void KvCache::replace_value(int il, int h, int j, const float* row) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(h >= 0 && h < L.n_head_kv_ && j >= 0 && j < L.n_slot(h));
  L.store_value(h, j, row);
}

void KvCache::replace_scores(int il, int h, int first, int count, const float* scores) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(h >= 0 && h < L.n_head_kv_ && first >= 0 && count >= 0 &&
             first + count <= L.n_slot(h));
  std::copy_n(scores, count, L.score_accum(h) + first);
}

void KvCache::replace_window(int il, int h, int first, int count, const float* window) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(h >= 0 && h < L.n_head_kv_ && first >= 0 && count >= 0 &&
             first + count <= L.n_slot(h));
  std::copy_n(window, count, L.window_accum(h) + first);
  L.window_live_ = true;
}

void KvCache::drop_appended(int il, int count) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(L.uniform() && count >= 0 && count <= L.n_slot_);
  const int keep = L.n_slot_ - count;
  for (int h = 0; h < L.n_head_kv_; ++h) {
    for (int j = keep; j < L.n_slot_; ++j) D2O_ASSERT(L.phys(h, j) == j);
  }
  L.n_slot_ = keep;
}

int64_t KvCache::intact_prefix(int64_t n) const {
  int64_t p = std::max<int64_t>(n, 0);
  // A recurrent state cannot be taken back: it is the prefix of all its tokens or of none.
  if (rec_.n_tokens > 0 && p < rec_.n_tokens) return 0;
  // Global layers: each head's first slots at positions 0, 1, ... as appended. A slot evicted
  // below p shows as a position skipped, a merge as a merge count; rows a compaction moved hold
  // the same bytes.
  for (int il = 0; il < cfg_.n_layer && p > 0; ++il) {
    if (!cfg_.layer_compressible(il)) continue;
    const KvLayer& L = layer(il);
    for (int h = 0; h < L.n_head_kv_; ++h) {
      const int64_t m = std::min<int64_t>(p, L.n_slot(h));
      const int32_t* pos = L.pos(h);
      const int32_t* merged = L.merged(h);
      int64_t j = 0;
      while (j < m && pos[j] == j && merged[j] == 0) ++j;
      p = j;
    }
  }
  if (p == 0) return 0;
  // Sliding-window layers hold consecutive positions [first, first + n_slot); a query at p needs
  // [max(0, p - W + 1), p) of them. Older slots may stay: the window masks them.
  for (int il = 0; il < cfg_.n_layer; ++il) {
    const int w = cfg_.window(il);
    if (w == 0) continue;
    const KvLayer& L = layer(il);
    if (L.n_slot_ == 0 || !L.uniform()) return 0;
    const int64_t first = L.pos(0)[0];
    for (int h = 0; h < L.n_head_kv_; ++h) {
      const int32_t* pos = L.pos(h);
      for (int j = 0; j < L.n_slot_; ++j) {
        if (pos[j] != first + j) return 0;
      }
    }
    if (first + L.n_slot_ < p || first > std::max<int64_t>(0, p - w + 1)) return 0;
  }
  return p;
}

void KvCache::truncate(int64_t n) {
  D2O_ASSERT(n >= 0 && intact_prefix(n) == n);
  for (int il = 0; il < cfg_.n_layer; ++il) {
    KvLayer& L = layers_[static_cast<size_t>(il)];
    if (L.n_slot_ == 0) continue;
    // Slots each head keeps: positions [0, n) of a global layer; of a sliding-window layer, those
    // of its slots [first, n).
    int keep = static_cast<int>(n);
    if (!cfg_.layer_compressible(il))
      keep = static_cast<int>(std::max<int64_t>(0, n - L.pos(0)[0]));
    for (int h = 0; h < L.n_head_kv_; ++h) {
      const int c = L.n_slot(h);
      D2O_ASSERT(keep <= c);
      // The kept slots must hold rows [0, keep): each one whose row lies at or past keep moves
      // into the row of a dropped slot below keep (there are as many of those as of these).
      int32_t* map = L.row_.data() + L.meta_index(h, 0);
      int d = keep;
      for (int j = 0; j < keep; ++j) {
        if (map[j] < keep) continue;
        while (map[d] >= keep) ++d;
        D2O_ASSERT(d < c);
        L.copy_row(h, map[d], map[j]);
        map[j] = map[d];
        ++d;
      }
    }
    L.set_counts(nullptr, keep);
  }
}

void KvCache::reset_score_stats(int il) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  if (L.n_slot_ == 0) return;  // nothing stored yet (maybe not even allocated)
  for (int h = 0; h < L.n_head_kv_; ++h) std::fill_n(L.score_accum(h), L.n_slot_, 0.0f);
}

void KvCache::reset_window_stats(int il) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  // Nothing stored yet (maybe not even allocated), or all zeros: appends write zeros, and only an
  // attention pass that opened them (or a restore) writes anything else.
  if (L.n_slot_ == 0 || !L.window_live_) return;
  for (int h = 0; h < L.n_head_kv_; ++h) std::fill_n(L.window_accum(h), L.n_slot_, 0.0f);
  L.window_live_ = false;
}

void KvCache::enable_cold(const ColdTierConfig& cfg) {
  if (!cfg.enabled()) {
    cold_ = nullptr;
    return;
  }
  // The tier's storage follows the model: a rotated type on a head the rotation cannot take is
  // stored unrotated, a quantized one whose blocks do not divide the head in F16.
  ColdTierConfig c = cfg;
  if (!check_kv_type(c.type, cfg_.head_dim).ok()) c.type.rot_k = c.type.rot_v = false;
  if (!check_kv_type(c.type, cfg_.head_dim).ok()) c.type = KvType{};
  cold_ = std::make_shared<ColdTier>(c, cfg_);
}

void KvCache::to_cold(int il, const CompactionPlan& plan) {
  const KvLayer& L = layers_[static_cast<size_t>(il)];
  for (int h = 0; h < L.n_head_kv_; ++h) {
    const int32_t* keep = plan.keep_of(h);
    const int nk = plan.n_keep_of(h), n = L.n_slot(h);
    int i = 0;
    for (int j = 0; j < n; ++j) {
      if (i < nk && keep[i] == j) {
        ++i;
        continue;
      }
      cold_->take(il, L, h, j);
    }
  }
}

Status KvCache::insert_recalled(int il, const std::vector<ColdRecall>& per_head) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(static_cast<int>(per_head.size()) == L.n_head_kv_);
  std::vector<int32_t> counts(static_cast<size_t>(L.n_head_kv_));
  int most = 0;
  for (int h = 0; h < L.n_head_kv_; ++h) {
    counts[static_cast<size_t>(h)] = L.n_slot(h) + per_head[static_cast<size_t>(h)].count();
    most = std::max(most, counts[static_cast<size_t>(h)]);
  }
  if (most == L.n_slot_) return {};
  D2O_RETURN_IF_ERROR(reserve(il, most, /*exact=*/false));
  const int hd = L.head_dim_;
  for (int h = 0; h < L.n_head_kv_; ++h) {
    const ColdRecall& r = per_head[static_cast<size_t>(h)];
    const int n = L.n_slot(h), c = r.count();
    if (c == 0) continue;
    // From the end: the old slots move up past the recalled ones that follow them; a recalled
    // slot takes the next free physical row (rows [0, n) are the old slots').
    int i = n - 1, t = c - 1;
    for (int dst = n + c - 1; dst >= 0; --dst) {
      const size_t d = L.meta_index(h, dst);
      if (t >= 0 && (i < 0 || r.pos[static_cast<size_t>(t)] > L.pos_[L.meta_index(h, i)])) {
        const int row = n + t;
        L.row_[d] = row;
        kv_store_row(L.type_.k, r.k.data() + static_cast<size_t>(t) * hd, hd,
                     L.k_.data() + L.row_offset(h, row, L.key_row_bytes()));
        kv_store_row(L.type_.v, r.v.data() + static_cast<size_t>(t) * hd, hd,
                     L.v_.data() + L.row_offset(h, row, L.value_row_bytes()));
        L.pos_[d] = r.pos[static_cast<size_t>(t)];
        L.score_[d] = r.score[static_cast<size_t>(t)];
        L.window_[d] = 0.0f;
        L.merged_[d] = r.merged[static_cast<size_t>(t)];
        if (L.merged_[d] != 0) L.merged_live_ = true;
        --t;
      } else {
        const size_t s = L.meta_index(h, i);
        L.row_[d] = L.row_[s];
        L.pos_[d] = L.pos_[s];
        L.score_[d] = L.score_[s];
        L.window_[d] = L.window_[s];
        L.merged_[d] = L.merged_[s];
        --i;
      }
    }
  }
  L.set_counts(counts.data(), L.n_head_kv_);
  // Rows out of slot order now: the next compactions put them back in order.
  L.unordered_ += most;
  return {};
}

}  // namespace d2o
