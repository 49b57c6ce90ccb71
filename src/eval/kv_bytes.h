// KV bytes for comparisons at equal memory (`d2o eval fidelity --bytes`, the KV report).
//
// What is counted: the key and value rows a cache holds, in their storage type, quantised rows
// with their block scales (a Q8_0 block of 32 elements is 34 bytes, a Q4_0 block 18; F16 2 bytes
// per element, F32 4). Slot metadata (position, scores, merge counts, row: 20 bytes per slot and KV
// head whatever the storage type) is left out: it is bookkeeping of this engine, not KV content,
// and every method here carries the same amount per slot. `--kv-mem-per-seq` counts it
// (KvCache::bytes_for_slots), with the policy's own per-slot lists (KvPolicy::state_bytes), as a
// memory pool must.
//
// A budget B (slots per KV head in each compressible layer) holds
//   sum over compressible layers of B + sum over sliding-window layers of min(n_tokens, W)
// slots per KV head (a sliding-window layer is never compacted; it needs the last W tokens), each
// of (key row + value row) bytes per KV head.
#pragma once

#include <cstddef>
#include <cstdint>

#include "d2o/status.h"
#include "kv/kv_cache.h"

namespace d2o::eval {

// Bytes of one slot's key and value rows over the KV heads of one layer.
size_t kv_slot_bytes(const KvCacheConfig& cfg);

// Key and value bytes of a cache of configuration `cfg` after `n_tokens` tokens when every
// compressible layer holds `slots` slots per KV head (a full cache: slots = n_tokens).
size_t kv_bytes_at_budget(const KvCacheConfig& cfg, int64_t slots, int64_t n_tokens);

// The same for a full cache (every token in a global layer, the last W in a sliding one).
size_t full_kv_bytes(const KvCacheConfig& cfg, int64_t n_tokens);

// `cfg` with both storage types F16, unrotated: the reference of "a share of the F16 cache".
KvCacheConfig f16_config(const KvCacheConfig& cfg);

struct BytesBudget {
  int64_t slots = 0;  // budget per KV head in each compressible layer
  size_t bytes = 0;   // kv_bytes_at_budget(cfg, slots, n_tokens): at most the target
  size_t target = 0;  // share x the F16 full cache's bytes for n_tokens, rounded down
  double share = 0;   // bytes / the F16 full cache's bytes
};

// The largest budget whose key and value bytes after `n_tokens` tokens fit in `share` of the
// bytes of a full F16 cache of the same shape holding those tokens. Errors: share not in (0, 1],
// n_tokens < 1, a storage type the head size cannot hold, a model with no compressible layer, a
// share too small to give each compressible layer one slot (the message says the smallest share).
Result<BytesBudget> budget_for_share(const KvCacheConfig& cfg, int64_t n_tokens, double share);

}  // namespace d2o::eval
