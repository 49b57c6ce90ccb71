// KvCache::restore_layer (kv/kv_cache.h): a layer filled from packed slot arrays, kept apart
// from kv_cache.cpp so that file stays about the cache's own operations.
#include <algorithm>
#include <cstring>

#include "kv/kv_cache.h"

namespace d2o {

Status KvCache::restore_layer(int il, int n_slot, const uint8_t* k, const uint8_t* v,
                             const int32_t* pos, const float* score, const float* window,
                             const int32_t* merged) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  L.n_slot_ = 0;  // nothing to keep
  D2O_RETURN_IF_ERROR(reallocate(il, std::max(1, n_slot)));
  const size_t n = static_cast<size_t>(n_slot), kb = L.key_row_bytes(), vb = L.value_row_bytes();
  for (int h = 0; h < L.n_head_kv_ && n > 0; ++h) {
    const size_t o = static_cast<size_t>(h) * n;
    std::memcpy(L.k_.data() + L.row_offset(h, 0, kb), k + o * kb, n * kb);  // identity map
    std::memcpy(L.v_.data() + L.row_offset(h, 0, vb), v + o * vb, n * vb);
    std::memcpy(&L.pos_[L.meta_index(h, 0)], pos + o, n * sizeof(int32_t));
    std::memcpy(&L.score_[L.meta_index(h, 0)], score + o, n * sizeof(float));
    std::memcpy(&L.window_[L.meta_index(h, 0)], window + o, n * sizeof(float));
    std::memcpy(&L.merged_[L.meta_index(h, 0)], merged + o, n * sizeof(int32_t));
    int32_t* map = &L.row_[L.meta_index(h, 0)];
    for (size_t j = 0; j < n; ++j) map[j] = static_cast<int32_t>(j);
  }
  L.n_slot_ = n_slot;
  L.window_live_ = L.merged_live_ = true;
  return {};
}

}  // namespace d2o
