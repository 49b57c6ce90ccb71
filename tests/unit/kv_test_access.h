// Test-only door into KvCache / KvLayer (a friend of both): tests set up states that otherwise
// only the attention kernel, a compaction or a forward pass produce (statistics, merge counts,
// positions, slot counts). Outside tests/, the cache changes only through KvCache's operations.
#pragma once

#include <cstdint>

#include "kv/kv_cache.h"

namespace d2o {

struct KvTestAccess {
  static KvLayer& layer(KvCache& c, int il) { return c.layers_[static_cast<size_t>(il)]; }
  // Head h's metadata [capacity], writable.
  static float* score(KvLayer& L, int h) { return L.score_.data() + L.meta_index(h, 0); }
  static float* window(KvLayer& L, int h) {
    L.window_live_ = true;
    return L.window_.data() + L.meta_index(h, 0);
  }
  static int32_t* merged(KvLayer& L, int h) {
    L.merged_live_ = true;
    return L.merged_.data() + L.meta_index(h, 0);
  }
  static int32_t* pos(KvLayer& L, int h) { return L.pos_.data() + L.meta_index(h, 0); }
  // Slots in use (at most the capacity): e.g. to run attention on a prefix of what was appended.
  static void set_n_slot(KvLayer& L, int n) { L.set_counts(nullptr, n); }
  // Per-head slot counts [n_head_kv] (at most the capacity).
  static void set_head_slots(KvLayer& L, const int32_t* counts) { L.set_counts(counts, 0); }
};

}  // namespace d2o
