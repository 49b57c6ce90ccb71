// KvCache's narrow edits outside apply(): values and statistics a policy writes while planning,
// the statistics resets of each pass, and the removal of a pass's own slots (the prompt's
// reconstruction).
#include <algorithm>

#include "core/assert.h"
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

}  // namespace d2o
