#include "kv/kv_cache.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <new>

#include "core/assert.h"
#include "core/fp16.h"
#include "kv/cold_tier.h"
#include "kv/kv_rotation.h"
#include "ops/quant.h"

namespace d2o {

const char* kv_elem_type_name(KvElemType t) {
  switch (t) {
    case KvElemType::kF32:
      return "f32";
    case KvElemType::kF16:
      return "f16";
    case KvElemType::kQ8_0:
      return "q8_0";
    case KvElemType::kQ4_0:
      return "q4_0";
  }
  return "?";
}

size_t kv_row_bytes(KvElemType t, int head_dim) {
  const size_t n = static_cast<size_t>(head_dim);
  switch (t) {
    case KvElemType::kF32:
      return 4 * n;
    case KvElemType::kF16:
      return 2 * n;
    case KvElemType::kQ8_0:
      return n / kQK * sizeof(BlockQ8_0);
    case KvElemType::kQ4_0:
      return n / kQK * sizeof(BlockQ4_0);
  }
  return 0;
}

GgmlType kv_ggml_type(KvElemType t) {
  switch (t) {
    case KvElemType::kF32:
      return GgmlType::kF32;
    case KvElemType::kF16:
      return GgmlType::kF16;
    case KvElemType::kQ8_0:
      return GgmlType::kQ8_0;
    case KvElemType::kQ4_0:
      return GgmlType::kQ4_0;
  }
  return GgmlType::kF32;
}

const char* kv_type_name(KvType t) {
  constexpr int kN = 8;  // KvElemType values, each plain or rotated
  static const std::array<std::string, kN* kN> names = [] {
    std::array<std::string, kN * kN> n;
    for (int k = 0; k < kN; ++k) {
      for (int v = 0; v < kN; ++v) {
        const std::string a =
            std::string(kv_elem_type_name(static_cast<KvElemType>(k / 2))) + (k % 2 ? "r" : "");
        const std::string b =
            std::string(kv_elem_type_name(static_cast<KvElemType>(v / 2))) + (v % 2 ? "r" : "");
        n[static_cast<size_t>(k * kN + v)] = k == v ? a : "k:" + a + ",v:" + b;
      }
    }
    return n;
  }();
  const int k = static_cast<int>(t.k) * 2 + (t.rot_k ? 1 : 0);
  const int v = static_cast<int>(t.v) * 2 + (t.rot_v ? 1 : 0);
  return names[static_cast<size_t>(k * kN + v)].c_str();
}

namespace {

struct ElemSpec {
  KvElemType t;
  bool rot;
};

Result<ElemSpec> parse_elem(const std::string& s, const std::string& whole) {
  const bool rot = !s.empty() && s.back() == 'r';
  const std::string base = rot ? s.substr(0, s.size() - 1) : s;
  for (KvElemType t : {KvElemType::kF32, KvElemType::kF16, KvElemType::kQ8_0, KvElemType::kQ4_0}) {
    if (base == kv_elem_type_name(t)) return ElemSpec{t, rot};
  }
  return invalid_argument("unknown KV storage type '" + s + "' in '" + whole +
                          "' (expected f32, f16, q8_0 or q4_0, each optionally followed by r for "
                          "rotated storage, e.g. q4_0r, or k:TYPE,v:TYPE)");
}

}  // namespace

Result<KvType> parse_kv_type(const std::string& s) {
  if (s.find(':') == std::string::npos) {
    D2O_ASSIGN_OR_RETURN(ElemSpec e, parse_elem(s, s));
    return KvType{e.t, e.t, e.rot, e.rot};
  }
  KvType out;
  bool seen_k = false, seen_v = false;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t comma = std::min(s.find(',', i), s.size());
    const std::string part = s.substr(i, comma - i);
    const bool is_k = part.rfind("k:", 0) == 0, is_v = part.rfind("v:", 0) == 0;
    if ((!is_k && !is_v) || (is_k && seen_k) || (is_v && seen_v)) {
      return invalid_argument("bad KV storage type '" + s +
                              "' (expected TYPE or k:TYPE,v:TYPE, each part at most once)");
    }
    D2O_ASSIGN_OR_RETURN(ElemSpec e, parse_elem(part.substr(2), s));
    (is_k ? out.k : out.v) = e.t;
    (is_k ? out.rot_k : out.rot_v) = e.rot;
    (is_k ? seen_k : seen_v) = true;
    i = comma + 1;
  }
  return out;
}

Status check_kv_type(KvType t, int head_dim) {
  for (KvElemType e : {t.k, t.v}) {
    if (kv_quantized(e) && (head_dim <= 0 || head_dim % kQK != 0)) {
      return invalid_argument(std::string("KV storage type ") + kv_elem_type_name(e) +
                              " stores rows in blocks of " + std::to_string(kQK) +
                              " elements, but this model's head dimension is " +
                              std::to_string(head_dim) + " (use f16 or f32)");
    }
  }
  if ((t.rot_k || t.rot_v) && (head_dim <= 0 || head_dim % kKvRotBlock != 0)) {
    return invalid_argument(std::string("rotated KV storage (") + kv_type_name(t) +
                            ") rotates rows in blocks of " + std::to_string(kKvRotBlock) +
                            " elements or more, but this model's head dimension is " +
                            std::to_string(head_dim) + " (use a type without the r suffix)");
  }
  return {};
}

bool KvCacheConfig::has_sliding() const {
  for (int w : layer_window)
    if (w > 0) return true;
  return false;
}

int KvCacheConfig::max_head_dim() const {
  int m = head_dim;
  for (int d : layer_head_dim) m = std::max(m, d);
  return m;
}

int KvCacheConfig::n_compressible() const {
  int n = 0;
  for (int il = 0; il < n_layer; ++il) n += layer_compressible(il) ? 1 : 0;
  return n;
}

void kv_load_row(KvElemType t, const uint8_t* p, int n, float* out) {
  switch (t) {
    case KvElemType::kF32:
      std::memcpy(out, p, sizeof(float) * static_cast<size_t>(n));
      break;
    case KvElemType::kF16:
      fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(p), out, n);
      break;
    default:
      dequantize_row(kv_ggml_type(t), p, out, n);
      break;
  }
}

void kv_store_row(KvElemType t, const float* in, int n, uint8_t* p) {
  switch (t) {
    case KvElemType::kF32:
      std::memcpy(p, in, sizeof(float) * static_cast<size_t>(n));
      break;
    case KvElemType::kF16:
      fp32_to_fp16_row(in, reinterpret_cast<uint16_t*>(p), n);
      break;
    default:
      quantize_row(kv_ggml_type(t), in, p, n);
      break;
  }
}

void KvLayer::load_key(int h, int j, float* out) const {
  kv_load_row(type_.k, key_row(h, j), head_dim_, out);
}
void KvLayer::load_value(int h, int j, float* out) const {
  kv_load_row(type_.v, value_row(h, j), head_dim_, out);
}
void KvLayer::store_key(int h, int j, const float* in) {
  kv_store_row(type_.k, in, head_dim_, mutable_key_row(h, j));
}
void KvLayer::store_value(int h, int j, const float* in) {
  kv_store_row(type_.v, in, head_dim_, mutable_value_row(h, j));
}

void KvLayer::move_slots(int h, int to, int from, int n) {
  const size_t c = static_cast<size_t>(n);
  const size_t a = meta_index(h, to), b = meta_index(h, from);
  std::memmove(&pos_[a], &pos_[b], c * sizeof(int32_t));
  std::memmove(&score_[a], &score_[b], c * sizeof(float));
  if (window_live_) std::memmove(&window_[a], &window_[b], c * sizeof(float));
  if (merged_live_) std::memmove(&merged_[a], &merged_[b], c * sizeof(int32_t));
  std::memmove(&row_[a], &row_[b], c * sizeof(int32_t));
}

void KvLayer::copy_row(int h, int to, int from) {
  const size_t kb = key_row_bytes(), vb = value_row_bytes();
  std::memcpy(k_.data() + row_offset(h, to, kb), k_.data() + row_offset(h, from, kb), kb);
  std::memcpy(v_.data() + row_offset(h, to, vb), v_.data() + row_offset(h, from, vb), vb);
}

void KvLayer::order_rows(int h, int n) {
  constexpr size_t kMaxRow = 4096;
  const size_t kb = key_row_bytes(), vb = value_row_bytes();
  D2O_ASSERT(kb <= kMaxRow && vb <= kMaxRow);
  alignas(64) uint8_t tk[kMaxRow], tv[kMaxRow];
  int32_t* map = row_.data() + meta_index(h, 0);
  uint8_t* k = k_.data() + row_offset(h, 0, kb);
  uint8_t* v = v_.data() + row_offset(h, 0, vb);
  for (int j = 0; j < n; ++j) {
    if (map[j] == j) continue;
    // The cycle through row j: slot j's row comes to row j, the slot whose row is to be j's next
    // comes to the row that left, and so on, until the slot whose row was j (saved first).
    std::memcpy(tk, k + j * kb, kb);
    std::memcpy(tv, v + j * vb, vb);
    int cur = j;
    for (;;) {
      const int src = map[cur];
      map[cur] = cur;
      if (src == j) {
        std::memcpy(k + cur * kb, tk, kb);
        std::memcpy(v + cur * vb, tv, vb);
        break;
      }
      copy_row(h, cur, src);
      cur = src;
    }
  }
}

void KvLayer::set_counts(const int32_t* counts, int n) {
  head_n_.clear();
  n_slot_ = n;
  if (!counts) return;
  n_slot_ = *std::max_element(counts, counts + n_head_kv_);
  if (*std::min_element(counts, counts + n_head_kv_) != n_slot_)
    head_n_.assign(counts, counts + n_head_kv_);
}

int64_t KvLayer::held_slots() const {
  if (head_n_.empty()) return int64_t{n_slot_} * n_head_kv_;
  int64_t n = 0;
  for (int32_t c : head_n_) n += c;
  return n;
}

KvCache::KvCache(const KvCacheConfig& cfg) : cfg_(cfg) {
  D2O_ASSERT(cfg.n_layer > 0 && cfg.n_head_kv > 0 && cfg.head_dim > 0);
  D2O_ASSERT(check_kv_type(cfg.type, cfg.head_dim).ok());
  D2O_ASSERT(cfg.layer_head_dim.empty() ||
             cfg.layer_head_dim.size() == static_cast<size_t>(cfg.n_layer));
  D2O_ASSERT(cfg.layer_kv_source.empty() ||
             cfg.layer_kv_source.size() == static_cast<size_t>(cfg.n_layer));
  D2O_ASSERT(cfg.layer_window.empty() ||
             cfg.layer_window.size() == static_cast<size_t>(cfg.n_layer));
  layers_.resize(static_cast<size_t>(cfg.n_layer));
  queries_.resize(static_cast<size_t>(cfg.n_layer));
  for (int il = 0; il < cfg.n_layer; ++il) {
    KvLayer& L = layers_[static_cast<size_t>(il)];
    L.n_head_kv_ = cfg.n_head_kv;
    L.head_dim_ = cfg.head_dim_of(il);
    L.type_ = cfg.type;
    D2O_ASSERT(L.head_dim_ > 0 && check_kv_type(cfg.type, L.head_dim_).ok());
    D2O_ASSERT(cfg.kv_source(il) >= 0 && cfg.kv_source(il) <= il &&
               !cfg.shares_kv(cfg.kv_source(il)));
  }
  for (auto* v : {&tmp_k_, &tmp_v_, &acc_k_, &acc_v_}) v->resize((cfg.max_head_dim() + 3) / 4 * 4);
  D2O_ASSERT(cfg.layer_recurrent.empty() ||
             cfg.layer_recurrent.size() == static_cast<size_t>(cfg.n_layer));
  if (cfg.has_recurrent()) {
    rec_.conv.resize(static_cast<size_t>(cfg.n_layer));
    rec_.delta.resize(static_cast<size_t>(cfg.n_layer));
    for (int il = 0; il < cfg.n_layer; ++il) {
      if (!cfg.recurrent(il)) continue;
      rec_.conv[static_cast<size_t>(il)].assign(static_cast<size_t>(cfg.recurrent_conv), 0.0f);
      rec_.delta[static_cast<size_t>(il)].assign(static_cast<size_t>(cfg.recurrent_delta), 0.0f);
    }
  }
}

void KvCache::copy_layer_slots(const KvLayer& L, int capacity, KvLayer& N) {
  const size_t heads = static_cast<size_t>(L.n_head_kv_);
  const size_t kb = L.key_row_bytes(), vb = L.value_row_bytes();
  N.n_head_kv_ = L.n_head_kv_;
  N.head_dim_ = L.head_dim_;
  N.type_ = L.type_;
  N.capacity_ = capacity;
  N.n_slot_ = L.n_slot_;
  const size_t cap = static_cast<size_t>(capacity);
  N.k_.resize(heads * cap * kb);
  N.v_.resize(heads * cap * vb);
  N.pos_.resize(heads * cap);
  N.score_.resize(heads * cap);
  N.window_.resize(heads * cap);
  N.merged_.resize(heads * cap);
  N.row_.resize(heads * cap);
  copy_rows(L, N);
}

void KvCache::copy_rows(const KvLayer& L, KvLayer& N) {
  D2O_ASSERT(N.capacity_ >= L.n_slot_ && N.n_head_kv_ == L.n_head_kv_ && N.type_ == L.type_);
  const size_t kb = L.key_row_bytes(), vb = L.value_row_bytes();
  N.n_slot_ = L.n_slot_;
  N.head_n_ = L.head_n_;
  N.window_live_ = L.window_live_;
  N.merged_live_ = L.merged_live_;
  for (int h = 0; h < L.n_head_kv_; ++h) {
    const size_t n = static_cast<size_t>(L.n_slot(h));
    if (n == 0) continue;
    // Rows in slot order: the copy's row map is the identity.
    int32_t* map = &N.row_[N.meta_index(h, 0)];
    for (size_t j = 0; j < n; ++j) {
      const int js = static_cast<int>(j);
      std::memcpy(N.k_.data() + N.row_offset(h, js, kb), L.key_row(h, js), kb);
      std::memcpy(N.v_.data() + N.row_offset(h, js, vb), L.value_row(h, js), vb);
      map[j] = js;
    }
    std::memcpy(&N.pos_[N.meta_index(h, 0)], L.pos(h), n * sizeof(int32_t));
    std::memcpy(&N.score_[N.meta_index(h, 0)], L.score(h), n * sizeof(float));
    std::memcpy(&N.window_[N.meta_index(h, 0)], L.window(h), n * sizeof(float));
    std::memcpy(&N.merged_[N.meta_index(h, 0)], L.merged(h), n * sizeof(int32_t));
  }
}

int64_t KvCache::total_slots() const {
  int64_t n = 0;
  for (const KvLayer& L : layers_) n += L.uniform() ? L.n_slot_ : L.held_slots() / L.n_head_kv_;
  return n;
}

void KvCache::append(int il, const float* k, const float* v, const int32_t* pos, int n_tok) {
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(L.n_slot_ + n_tok <= L.capacity_);
  const int hd = L.head_dim_;
  const int kv_dim = L.n_head_kv_ * hd;
  for (int t = 0; t < n_tok; ++t) {
    for (int h = 0; h < L.n_head_kv_; ++h) {
      const int j = L.n_slot(h) + t;
      L.row_[L.meta_index(h, j)] = j;  // slots [0, j) hold rows [0, j)
      L.store_key(h, j, k + static_cast<size_t>(t) * kv_dim + static_cast<size_t>(h) * hd);
      L.store_value(h, j, v + static_cast<size_t>(t) * kv_dim + static_cast<size_t>(h) * hd);
      const size_t m = L.meta_index(h, j);
      L.pos_[m] = pos[t];
      L.score_[m] = 0.0f;
      L.window_[m] = 0.0f;
      L.merged_[m] = 0;
    }
  }
  L.n_slot_ += n_tok;
  for (int32_t& c : L.head_n_) c += n_tok;
}

void KvCache::clear() {
  if (cold_) cold_->clear();
  drop_queries();
  for (KvLayer& L : layers_) {
    KvLayer empty;
    empty.n_head_kv_ = L.n_head_kv_;
    empty.head_dim_ = L.head_dim_;
    empty.type_ = L.type_;
    L = std::move(empty);
  }
  rec_.reset();
  peak_bytes_ = 0;
}

void KvCache::copy_cold(const KvCache& o) {
  if (!cold_) return;  // a cache without a tier takes none
  if (o.cold_ && o.cold_->config() == cold_->config()) {
    *cold_ = *o.cold_;
  } else {
    cold_->clear();  // (a cache filled by another policy: nothing evicted yet)
  }
}

Status KvCache::copy_from(const KvCache& o) {
  if (o.cfg_.n_layer != cfg_.n_layer || o.cfg_.n_head_kv != cfg_.n_head_kv ||
      o.cfg_.head_dim != cfg_.head_dim || o.cfg_.type != cfg_.type ||
      o.cfg_.layer_recurrent != cfg_.layer_recurrent) {
    return invalid_argument("KV cache copy: the caches have different shapes or storage types");
  }
  if (&o == this) return {};
  try {
    copy_cold(o);
    queries_ = o.queries_;
    rec_ = o.rec_;
    for (size_t il = 0; il < layers_.size(); ++il) {
      const KvLayer& S = o.layers_[il];
      KvLayer& D = layers_[il];
      auto copy = [](auto& dst, const auto& src) {
        dst.resize(src.size());
        if (src.size()) std::memcpy(dst.data(), src.data(), src.bytes());
      };
      copy(D.k_, S.k_);
      copy(D.v_, S.v_);
      copy(D.pos_, S.pos_);
      copy(D.score_, S.score_);
      copy(D.window_, S.window_);
      copy(D.merged_, S.merged_);
      copy(D.row_, S.row_);
      D.capacity_ = S.capacity_;
      D.n_slot_ = S.n_slot_;
      D.head_n_ = S.head_n_;
      D.unordered_ = S.unordered_;
      D.window_live_ = S.window_live_;
      D.merged_live_ = S.merged_live_;
    }
  } catch (const std::bad_alloc&) {
    clear();
    return resource_exhausted("out of memory copying a KV cache");
  }
  note_peak();
  return {};
}

Status KvCache::copy_slots_from(const KvCache& o) {
  if (o.cfg_.n_layer != cfg_.n_layer || o.cfg_.n_head_kv != cfg_.n_head_kv ||
      o.cfg_.head_dim != cfg_.head_dim || o.cfg_.type != cfg_.type ||
      o.cfg_.layer_recurrent != cfg_.layer_recurrent) {
    return invalid_argument("KV cache copy: the caches have different shapes or storage types");
  }
  if (&o == this) return {};
  clear();
  try {
    copy_cold(o);
    queries_ = o.queries_;
    rec_ = o.rec_;
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of memory copying a KV cache's cold tier or recorded queries");
  }
  for (int il = 0; il < cfg_.n_layer; ++il) {
    const KvLayer& S = o.layers_[static_cast<size_t>(il)];
    // Exact capacity (within the slot limit): the copy starts as compact as possible.
    D2O_RETURN_IF_ERROR(reserve(il, std::max(S.n_slot_, 1), /*exact=*/true));
    copy_rows(S, layers_[static_cast<size_t>(il)]);
  }
  return {};
}

Status KvCache::settle_sliding() {
  for (int il = 0; il < cfg_.n_layer; ++il) {
    if (cfg_.window(il) == 0) continue;
    if (layers_[static_cast<size_t>(il)].n_slot_ <= sliding_capacity(cfg_.window(il), 1)) continue;
    drop_oldest(il, 1);  // what a one-token pass drops first; a longer pass drops the same
    D2O_RETURN_IF_ERROR(shrink_sliding(il));
  }
  return {};
}

int KvCache::drop_oldest(int il, int n_tok) {
  const int w = cfg_.window(il);
  KvLayer& L = layers_[static_cast<size_t>(il)];
  D2O_ASSERT(w > 0 && L.uniform());  // never compacted, so never per-head counts
  if (L.n_slot_ + n_tok <= sliding_capacity(w, n_tok) || L.n_slot_ <= w - 1) return 0;
  const int drop = L.n_slot_ - (w - 1);
  for (int h = 0; h < L.n_head_kv_; ++h) {
    int next = L.n_slot_;  // kept slots [drop, n_slot), newest first
    auto movers = [&] { return --next; };
    for (int e = 0; e < drop; ++e) L.fill_hole(h, w - 1, e, movers);
    L.move_slots(h, 0, drop, w - 1);
  }
  if (L.note_evictions(drop))
    for (int h = 0; h < L.n_head_kv_; ++h) L.order_rows(h, w - 1);
  L.n_slot_ = w - 1;
  return drop;
}

}  // namespace d2o
