// KvCache's memory: how layers grow (reserve, within the slot limit and its one-layer extra),
// hand memory back (shrink_to_fit, trim), and what they allocate (kv_bytes_allocated,
// bytes_for_slots: what a memory pool reserves).
#include <algorithm>
#include <new>
#include <string>

#include "kv/kv_cache.h"
#include "kv/query_window.h"

namespace d2o {

namespace {

// Per slot and KV head of a layer of head size `hd`: a key and a value row, and pos, score,
// window, merged, row (4 bytes each).
size_t slot_bytes(const KvCacheConfig& cfg, int hd) {
  return kv_row_bytes(cfg.type.k, hd) + kv_row_bytes(cfg.type.v, hd) + 3 * sizeof(int32_t) +
         2 * sizeof(float);
}

}  // namespace

Status KvCache::reallocate(int il, int new_capacity) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(new_capacity >= L.n_slot_);
  try {
    KvLayer N;
    copy_layer_slots(L, new_capacity, N);
    L = std::move(N);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of memory growing the KV cache of layer " + std::to_string(il) +
                              " to " + std::to_string(new_capacity) + " slots");
  }
  note_peak();
  return {};
}

void KvCache::note_peak() {
  peak_bytes_ = std::max(peak_bytes_, kv_bytes_allocated() + meta_bytes_allocated());
}

Status KvCache::reserve(int il, int n_slots, bool exact) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  // A recurrent layer holds no slots, nor does one that reads another layer's.
  if (cfg_.recurrent(il) || cfg_.shares_kv(il)) return {};
  if (n_slots <= L.capacity_ && !exact) return {};
  if (exact && n_slots == L.capacity_) return {};
  // Sliding-window layers bound themselves (drop_oldest); the limit is for the others.
  const int limit = cfg_.window(il) > 0 ? 0 : slot_limit_;
  // Above the limit: one layer at a time, by at most slot_extra_ (a turn's recall).
  const bool above = limit > 0 && n_slots > limit;
  if (above && (n_slots > limit + slot_extra_ || other_layer_above_limit(il))) {
    return resource_exhausted(
        "KV cache layer " + std::to_string(il) + " needs " + std::to_string(n_slots) +
        " slots per head, above its limit of " + std::to_string(slot_limit_) +
        (slot_extra_ > 0 ? " (and " + std::to_string(slot_extra_) +
                               " more for one layer at a time, a turn's recall)"
                         : std::string()) +
        " (the memory reserved for this sequence)");
  }
  int cap = n_slots;
  if (!exact) {
    // Grow by at least a quarter (and 256 slots) so that appending token by token copies each
    // slot O(1) times overall; never past the limit (above it, exactly what is asked).
    cap = std::max(n_slots, L.capacity_ + std::max(256, L.capacity_ / 4));
    if (limit > 0) cap = std::min(cap, above ? n_slots : limit);
    if (cfg_.window(il) > 0)
      cap = std::min(cap, std::max(n_slots, sliding_capacity(cfg_.window(il), 1)));
  }
  return reallocate(il, std::max(cap, L.n_slot_));
}

// A sliding-window layer keeps the capacity a one-token pass needs (it is refilled every step);
// only what a long pass added above that is handed back.
Status KvCache::shrink_sliding(int il) {
  const KvLayer& L = layers_[static_cast<size_t>(il)];
  const int steady = sliding_capacity(cfg_.window(il), 1);
  if (L.capacity_ > steady && L.n_slot_ <= steady) return reallocate(il, steady);
  return {};
}

bool KvCache::other_layer_above_limit(int il) const {
  for (int j = 0; j < cfg_.n_layer; ++j) {
    if (j != il && cfg_.window(j) == 0 && layers_[static_cast<size_t>(j)].capacity_ > slot_limit_)
      return true;
  }
  return false;
}

Status KvCache::set_slot_limit(int max_slots, int one_layer_extra) {
  if (max_slots < 0) return invalid_argument("KV slot limit must be >= 0 (0: none)");
  if (one_layer_extra < 0 || (max_slots == 0 && one_layer_extra > 0))
    return invalid_argument("KV slot limit: the one-layer extra must be >= 0, with a limit");
  if (max_slots > 0) {
    for (int il = 0; il < cfg_.n_layer; ++il) {
      if (cfg_.window(il) == 0 && layers_[static_cast<size_t>(il)].capacity_ > max_slots) {
        return invalid_argument("KV cache layer " + std::to_string(il) + " already holds " +
                                std::to_string(layers_[static_cast<size_t>(il)].capacity_) +
                                " slots per head, above the requested limit of " +
                                std::to_string(max_slots));
      }
    }
  }
  slot_limit_ = max_slots;
  slot_extra_ = one_layer_extra;
  return {};
}

Status KvCache::shrink_to_fit(int slack) {
  for (int il = 0; il < cfg_.n_layer; ++il) {
    const KvLayer& L = layers_[static_cast<size_t>(il)];
    if (cfg_.window(il) > 0) {
      D2O_RETURN_IF_ERROR(shrink_sliding(il));
    } else if (L.capacity_ > L.n_slot_ + slack) {
      D2O_RETURN_IF_ERROR(reallocate(il, L.n_slot_ + slack));
    }
  }
  return {};
}

Status KvCache::trim(int slack) {
  for (int il = 0; il < cfg_.n_layer; ++il) D2O_RETURN_IF_ERROR(trim_layer(il, slack));
  return {};
}

Status KvCache::trim_layer(int il, int slack) {
  constexpr int kHysteresis = 16;
  const KvLayer& L = layers_[static_cast<size_t>(il)];
  if (cfg_.window(il) > 0) return shrink_sliding(il);
  // (A layer above the slot limit, by a turn's recall, goes back under it whatever the
  // hysteresis, so that the next layer may recall.)
  if (L.capacity_ > L.n_slot_ + slack + kHysteresis ||
      (slot_limit_ > 0 && L.capacity_ > slot_limit_ && L.capacity_ > L.n_slot_ + slack))
    return reallocate(il, L.n_slot_ + slack);
  return {};
}

size_t KvCache::kv_bytes_allocated() const {
  size_t b = 0;
  for (const KvLayer& L : layers_) b += L.k_.bytes() + L.v_.bytes();
  return b;
}

size_t KvCache::kv_bytes_used() const {
  size_t b = 0;
  for (const KvLayer& L : layers_)
    b += static_cast<size_t>(L.held_slots()) * (L.key_row_bytes() + L.value_row_bytes());
  return b;
}

size_t KvCache::meta_bytes_allocated() const {
  size_t b = 0;
  for (const KvLayer& L : layers_)
    b += L.pos_.bytes() + L.score_.bytes() + L.window_.bytes() + L.merged_.bytes() + L.row_.bytes();
  return b;
}

size_t KvCache::bytes_held() const {
  size_t q = 0;
  for (const QueryWindow& w : queries_) q += w.bytes();
  return kv_bytes_allocated() + meta_bytes_allocated() + q + (cold_ ? cold_->bytes() : 0) +
         rec_.bytes();
}

void KvCache::drop_queries() {
  for (QueryWindow& w : queries_) {
    if (w.cap() > 0) w.clear();  // (a layer that holds none costs nothing)
  }
}

size_t KvCache::full_kv_bytes(int64_t n_tokens) const {
  // A full cache keeps every token in a global layer and the last W in a sliding-window one.
  size_t bytes = 0;
  for (int il = 0; il < cfg_.n_layer; ++il) {
    if (cfg_.recurrent(il) || cfg_.shares_kv(il)) continue;
    const int w = cfg_.window(il), hd = cfg_.head_dim_of(il);
    bytes += static_cast<size_t>(w > 0 ? std::min<int64_t>(n_tokens, w) : n_tokens) *
             (kv_row_bytes(cfg_.type.k, hd) + kv_row_bytes(cfg_.type.v, hd));
  }
  return bytes * static_cast<size_t>(cfg_.n_head_kv);
}

size_t KvCache::bytes_for_slots(const KvCacheConfig& cfg, int64_t slots, int max_chunk,
                                int64_t n_tokens) {
  if (n_tokens < 0) n_tokens = slots;
  auto per_slot = [&](int hd) { return slot_bytes(cfg, hd); };
  size_t n = 0, recurrent = 0;
  for (int il = 0; il < cfg.n_layer; ++il) {
    if (cfg.recurrent(il)) {  // no slots: its recurrent state, of a fixed size
      recurrent += static_cast<size_t>(cfg.recurrent_conv + cfg.recurrent_delta) * sizeof(float);
      continue;
    }
    if (cfg.shares_kv(il)) continue;  // reads another layer's slots
    const int w = cfg.window(il);
    n += static_cast<size_t>(w > 0 ? std::min<int64_t>(n_tokens, sliding_capacity(w, max_chunk))
                                   : slots) *
         per_slot(cfg.head_dim_of(il));
  }
  return n * static_cast<size_t>(cfg.n_head_kv) + recurrent;
}

size_t KvCache::bytes_for_one_layer(const KvCacheConfig& cfg, int64_t slots) {
  if (slots <= 0) return 0;
  size_t widest = 0;
  for (int il = 0; il < cfg.n_layer; ++il) {
    if (cfg.recurrent(il) || cfg.shares_kv(il) || cfg.window(il) > 0) continue;
    widest = std::max(widest, slot_bytes(cfg, cfg.head_dim_of(il)));
  }
  return static_cast<size_t>(slots) * widest * static_cast<size_t>(cfg.n_head_kv);
}

}  // namespace d2o
