#include "eval/kv_bytes.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace d2o::eval {

size_t kv_slot_bytes(const KvCacheConfig& cfg) {
  return static_cast<size_t>(cfg.n_head_kv) *
         (kv_row_bytes(cfg.type.k, cfg.head_dim) + kv_row_bytes(cfg.type.v, cfg.head_dim));
}

size_t kv_bytes_at_budget(const KvCacheConfig& cfg, int64_t slots, int64_t n_tokens) {
  size_t n = 0;
  for (int il = 0; il < cfg.n_layer; ++il) {
    const int w = cfg.window(il);
    n += static_cast<size_t>(w > 0 ? std::min<int64_t>(n_tokens, w) : slots);
  }
  return n * kv_slot_bytes(cfg);
}

size_t full_kv_bytes(const KvCacheConfig& cfg, int64_t n_tokens) {
  return kv_bytes_at_budget(cfg, n_tokens, n_tokens);
}

KvCacheConfig f16_config(const KvCacheConfig& cfg) {
  KvCacheConfig c = cfg;
  c.type = KvType::kF16;
  return c;
}

Result<BytesBudget> budget_for_share(const KvCacheConfig& cfg, int64_t n_tokens, double share) {
  if (!(share > 0 && share <= 1)) {
    return invalid_argument("a share of the F16 cache's bytes must be in (0, 1], not " +
                            std::to_string(share));
  }
  if (n_tokens < 1) return invalid_argument("a bytes budget needs at least one token");
  D2O_RETURN_IF_ERROR(check_kv_type(cfg.type, cfg.head_dim));
  const int n_comp = cfg.n_compressible();
  if (n_comp < 1) {
    return invalid_argument(
        "this model has no layer a policy compacts: a bytes budget has no "
        "effect");
  }
  BytesBudget b;
  const size_t f16 = full_kv_bytes(f16_config(cfg), n_tokens);
  // Rounded down, so the budget never exceeds the share; the relative 1e-12 keeps a share that
  // is not exact in binary (0.3 = 0.2999...) from losing a byte it names exactly (0.3 of 100).
  b.target = static_cast<size_t>(std::floor(static_cast<long double>(f16) * share * (1 + 1e-12L)));
  const size_t fixed = kv_bytes_at_budget(cfg, 0, n_tokens);  // the sliding-window layers
  const size_t per_slot = kv_slot_bytes(cfg) * static_cast<size_t>(n_comp);
  if (b.target < fixed + per_slot) {
    const double need = static_cast<double>(fixed + per_slot) / static_cast<double>(f16);
    return invalid_argument("a share of " + std::to_string(share) + " of the F16 cache's bytes (" +
                            std::to_string(b.target) + " bytes for " + std::to_string(n_tokens) +
                            " tokens) holds no slot per layer with KV storage " +
                            kv_type_name(cfg.type) + "; the smallest share that does is " +
                            std::to_string(need));
  }
  b.slots = static_cast<int64_t>((b.target - fixed) / per_slot);
  b.bytes = kv_bytes_at_budget(cfg, b.slots, n_tokens);
  b.share = static_cast<double>(b.bytes) / static_cast<double>(f16);
  return b;
}

}  // namespace d2o::eval
