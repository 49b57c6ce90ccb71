// Two KV layers' key or value rows compared slot by slot. Rows are reached through each layer's
// row map (kv/kv_cache.h), so two caches holding the same slots may keep them in different
// physical rows.
#pragma once

#include <cstring>

#include "kv/kv_cache.h"

namespace d2o::test {

// 0 when head h's key (value) rows of slots [0, n) hold the same bytes in a and b; otherwise the
// memcmp of the first slot that differs.
inline int compare_keys(const KvLayer& a, const KvLayer& b, int h, size_t n) {
  for (size_t j = 0; j < n; ++j) {
    const int js = static_cast<int>(j);
    if (int c = std::memcmp(a.key_row(h, js), b.key_row(h, js), a.key_row_bytes())) return c;
  }
  return 0;
}
inline int compare_values(const KvLayer& a, const KvLayer& b, int h, size_t n) {
  for (size_t j = 0; j < n; ++j) {
    const int js = static_cast<int>(j);
    if (int c = std::memcmp(a.value_row(h, js), b.value_row(h, js), a.value_row_bytes())) return c;
  }
  return 0;
}

}  // namespace d2o::test
