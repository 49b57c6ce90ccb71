#include "serve/session_file.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>

#include "core/fp16.h"
#include "gguf/gguf.h"
#include "kv/cold_tier.h"
#include "kv/policy/composed.h"

namespace d2o::serve {

static_assert(std::endian::native == std::endian::little, "session files are little-endian");

namespace {

constexpr char kMagic[8] = {'D', '2', 'O', 'S', 'E', 'S', 'S', '\0'};
// The id a session is kept under: a key's name (1-64), '@' and the client's id (1-128)
// (serve/api_keys.h); files of the default namespace hold the client's id alone.
constexpr size_t kMaxIdBytes = 64 + 1 + 128;
constexpr size_t kMaxSpecBytes = 4096;
// Flags: a cold tier follows the layers; the recurrent state follows them (and the cold tier).
constexpr uint32_t kColdFlag = 1;
constexpr uint32_t kRecurrentFlag = 2;

// Bytes of the fixed part before the id (magic .. rot_v).
constexpr size_t kFixedHeader = 8 + 4 + 4 + 8 + 8 + 4 * 3 + 4;

class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) {}
  void bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  template <class T>
  void put(T v) {
    bytes(&v, sizeof v);
  }
  template <class T>
  void array(const std::vector<T>& v) {
    put(static_cast<uint32_t>(v.size()));
    if (!v.empty()) bytes(v.data(), v.size() * sizeof(T));
  }
  void str(const std::string& s) {
    put(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }

 private:
  std::string& out_;
};

// Bounds-checked reading; every failure names what was being read.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t left() const { return n_ - at_; }
  size_t at() const { return at_; }
  Status need(size_t n, const char* what) const {
    if (n > left()) {
      return format_error(std::string("session file truncated (reading ") + what + " at byte " +
                          std::to_string(at_) + ")");
    }
    return {};
  }
  template <class T>
  Status get(T& v, const char* what) {
    D2O_RETURN_IF_ERROR(need(sizeof v, what));
    std::memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return {};
  }
  // n items of T; `max_n` bounds n before anything is allocated.
  template <class T>
  Status array(std::vector<T>& v, size_t max_n, const char* what) {
    uint32_t n = 0;
    D2O_RETURN_IF_ERROR(get(n, what));
    if (n > max_n) {
      return format_error(std::string("session file: ") + what + " has " + std::to_string(n) +
                          " entries, more than the " + std::to_string(max_n) + " allowed");
    }
    return items(v, n, what);
  }
  template <class T>
  Status items(std::vector<T>& v, size_t n, const char* what) {
    D2O_RETURN_IF_ERROR(need(n * sizeof(T), what));
    v.resize(n);
    if (n) std::memcpy(v.data(), p_ + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return {};
  }
  Status str(std::string& s, size_t max_n, const char* what) {
    std::vector<char> c;
    D2O_RETURN_IF_ERROR(array(c, max_n, what));
    s.assign(c.begin(), c.end());
    return {};
  }
  const uint8_t* take(size_t n) {
    const uint8_t* p = p_ + at_;
    at_ += n;
    return p;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
};

Status bad(const std::string& m) {
  return format_error("session file: " + m);
}

// Every row of a layer holds finite numbers (F32 / F16 elements, the F16 scale of each Q8_0 /
// Q4_0 block): a NaN would otherwise spread through attention into every later answer.
bool rows_finite(const uint8_t* p, size_t n_rows, KvElemType t, int head_dim) {
  const size_t rb = kv_row_bytes(t, head_dim);
  auto f16_ok = [](const uint8_t* q) {
    uint16_t h;
    std::memcpy(&h, q, 2);
    return (h & 0x7c00u) != 0x7c00u;
  };
  if (t == KvElemType::kF32) {
    for (size_t i = 0; i < n_rows * static_cast<size_t>(head_dim); ++i) {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      if (!std::isfinite(f)) return false;
    }
    return true;
  }
  if (t == KvElemType::kF16) {
    for (size_t i = 0; i < n_rows * static_cast<size_t>(head_dim); ++i)
      if (!f16_ok(p + 2 * i)) return false;
    return true;
  }
  const size_t n_blocks = static_cast<size_t>(head_dim) / 32, bb = rb / n_blocks;
  for (size_t r = 0; r < n_rows; ++r)
    for (size_t b = 0; b < n_blocks; ++b)
      if (!f16_ok(p + r * rb + b * bb)) return false;
  return true;
}

template <class T>
bool all_finite(const std::vector<T>& v) {
  for (T x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

Status check_cache_layout(const SessionFileContext& ctx, uint32_t n_layer, uint32_t n_head_kv,
                          uint32_t head_dim, KvType type) {
  const KvCacheConfig& c = ctx.cache;
  if (!c.layer_head_dim.empty() || !c.layer_kv_source.empty()) {
    return unsupported(
        "sessions of a model whose layers differ in head width or share keys and "
        "values (gemma4) cannot be saved or restored yet");
  }
  if (n_layer != static_cast<uint32_t>(c.n_layer) ||
      n_head_kv != static_cast<uint32_t>(c.n_head_kv) ||
      head_dim != static_cast<uint32_t>(c.head_dim)) {
    return invalid_argument("the session was saved with a KV cache of " +
                            std::to_string(n_layer) + " layers x " + std::to_string(n_head_kv) +
                            " heads x " + std::to_string(head_dim) + ", this model's is " +
                            std::to_string(c.n_layer) + " x " + std::to_string(c.n_head_kv) +
                            " x " + std::to_string(c.head_dim));
  }
  if (!(type == c.type)) {
    return invalid_argument(std::string("the session was saved with KV storage ") +
                            kv_type_name(type) + ", the server uses " + kv_type_name(c.type));
  }
  return {};
}

Status decode_policy_state(Reader& r, const SessionFileContext& ctx, uint32_t version,
                           int64_t n_past, PolicyState& st) {
  const size_t nl = static_cast<size_t>(ctx.cache.n_layer);
  uint8_t budgets_set = 0, has_ext = 0;
  D2O_RETURN_IF_ERROR(r.get(budgets_set, "the policy state"));
  D2O_RETURN_IF_ERROR(r.get(has_ext, "the policy state"));
  if (budgets_set > 1 || has_ext > 1) return bad("policy state flags are not 0 or 1");
  st.budgets_set = budgets_set == 1;
  D2O_RETURN_IF_ERROR(r.array(st.budgets, nl, "the layer budgets"));
  D2O_RETURN_IF_ERROR(r.array(st.evicted, nl, "the eviction counters"));
  D2O_RETURN_IF_ERROR(r.array(st.merged, nl, "the merge counters"));
  D2O_RETURN_IF_ERROR(r.get(st.n_compactions, "the compaction counter"));
  D2O_RETURN_IF_ERROR(r.get(st.pos_shift, "the position shift"));
  if (st.budgets_set != (st.budgets.size() == nl) || (!st.budgets.empty() && !st.budgets_set))
    return bad("the layer budgets do not match budgets_set");
  for (int b : st.budgets) {
    if (b != PolicyState::kNoBudget && (b < 1 || b > ctx.max_positions))
      return bad("layer budget " + std::to_string(b) + " is out of range");
  }
  if (st.evicted.size() != st.merged.size() || (!st.evicted.empty() && st.evicted.size() != nl))
    return bad("the eviction and merge counters do not cover every layer");
  for (size_t il = 0; il < st.evicted.size(); ++il) {
    if (st.evicted[il] < 0 || st.merged[il] < 0 || st.merged[il] > st.evicted[il])
      return bad("layer " + std::to_string(il) + "'s eviction counters are inconsistent");
  }
  if (st.n_compactions < 0 || st.n_compactions > n_past)
    return bad("the compaction counter is out of range");
  if (st.pos_shift < 0 || st.pos_shift >= n_past) return bad("the position shift is out of range");
  if (!has_ext) return {};
  auto own = std::make_unique<ComposedPolicyState>();
  const size_t nlg = nl * static_cast<size_t>(ctx.cache.n_head_kv);
  // D2O's merge thresholds (none for the other policies, or before the first compaction).
  auto d2o = std::make_unique<D2oMergeState>();
  D2O_RETURN_IF_ERROR(r.array(d2o->tau, nlg, "the merge thresholds"));
  if (!d2o->tau.empty() && d2o->tau.size() != nlg)
    return bad("the merge thresholds do not cover every layer and head");
  D2O_RETURN_IF_ERROR(r.items(d2o->tau_ready, d2o->tau.size(), "the merge thresholds"));
  if (!all_finite(d2o->tau)) return bad("a merge threshold is not a finite number");
  for (uint8_t b : d2o->tau_ready)
    if (b > 1) return bad("a merge threshold flag is not 0 or 1");
  if (!d2o->tau.empty()) own->merger = std::move(d2o);
  D2O_RETURN_IF_ERROR(r.array(own->layer_variance, nl, "the layer variances"));
  if (!own->layer_variance.empty() && own->layer_variance.size() != nl)
    return bad("the layer variances do not cover every layer");
  if (!all_finite(own->layer_variance)) return bad("a layer variance is not a finite number");
  if (version >= 2) {
    D2O_RETURN_IF_ERROR(r.array(own->pressure_floor, nl, "the pressure floor"));
    if (!own->pressure_floor.empty() && (own->pressure_floor.size() != nl || !st.budgets_set))
      return bad("the pressure floor does not cover every layer's budget");
    for (size_t il = 0; il < own->pressure_floor.size(); ++il) {
      // A layer's floor is the budget its first step found; the budget never went below it.
      const int f = own->pressure_floor[il], b = st.budgets[il];
      if ((f == PolicyState::kNoBudget) != (b == PolicyState::kNoBudget) ||
          (f != PolicyState::kNoBudget && (f < 1 || f > b)))
        return bad("layer " + std::to_string(il) + "'s pressure floor " + std::to_string(f) +
                   " does not fit its budget " + std::to_string(b));
    }
    D2O_RETURN_IF_ERROR(r.get(own->prompt_end, "the prompt's end"));
    if (own->prompt_end < 0 || own->prompt_end > ctx.max_positions)
      return bad("the prompt's end is out of range");
  }
  st.ext.reset(std::move(own));
  return {};
}

Status decode_layer(Reader& r, const SessionFileContext& ctx, int il, int64_t n_past,
                    int64_t next_pos, KvCache& cache) {
  const std::string where = "layer " + std::to_string(il);
  uint32_t n_slot = 0;
  D2O_RETURN_IF_ERROR(r.get(n_slot, "a layer's slot count"));
  if (n_slot > n_past)
    return bad(where + " holds " + std::to_string(n_slot) + " slots, more than the " +
               std::to_string(n_past) + " tokens seen");
  const KvCacheConfig& c = ctx.cache;
  const size_t heads = static_cast<size_t>(c.n_head_kv), n = n_slot, rows = heads * n;
  const size_t kb = kv_row_bytes(c.type.k, c.head_dim), vb = kv_row_bytes(c.type.v, c.head_dim);
  D2O_RETURN_IF_ERROR(r.need(rows * (kb + vb + 16), "a layer's slots"));
  const uint8_t* k = r.take(rows * kb);
  const uint8_t* v = r.take(rows * vb);
  std::vector<int32_t> pos, merged;
  std::vector<float> score, window;
  D2O_RETURN_IF_ERROR(r.items(pos, rows, "positions"));
  D2O_RETURN_IF_ERROR(r.items(score, rows, "scores"));
  D2O_RETURN_IF_ERROR(r.items(window, rows, "window scores"));
  D2O_RETURN_IF_ERROR(r.items(merged, rows, "merge counts"));
  if (!rows_finite(k, rows, c.type.k, c.head_dim) || !rows_finite(v, rows, c.type.v, c.head_dim))
    return bad(where + ": a key or value is not a finite number");
  if (!all_finite(score) || !all_finite(window))
    return bad(where + ": a score is not a finite number");
  for (size_t h = 0; h < heads; ++h) {
    const int32_t* p = pos.data() + h * n;
    for (size_t j = 0; j < n; ++j) {
      if (p[j] < 0 || p[j] >= next_pos || (j > 0 && p[j] <= p[j - 1]))
        return bad(where + ": slot positions are not ascending within [0, " +
                   std::to_string(next_pos) + ")");
      const int32_t m = merged[h * n + j];
      if (m < 0 || m > n_past) return bad(where + ": a merge count is out of range");
    }
  }
  return cache.restore_layer(il, static_cast<int>(n_slot), k, v, pos.data(), score.data(),
                             window.data(), merged.data());
}

// The cold tier (kv/cold_tier.h), after the last layer when the flags say so: per layer and KV
// head, its slot count, positions, scores, merge counts, key rows and value rows.
void encode_cold(Writer& w, const ColdTier& cold, const KvCacheConfig& c) {
  for (int il = 0; il < c.n_layer; ++il) {
    for (int h = 0; h < c.n_head_kv; ++h) {
      const ColdTier::HeadView v = cold.view(il, h);
      const size_t n = static_cast<size_t>(v.n);
      w.put(static_cast<uint32_t>(n));
      if (n == 0) continue;
      w.bytes(v.pos, n * 4);
      w.bytes(v.score, n * 4);
      w.bytes(v.merged, n * 4);
      w.bytes(v.k, n * cold.key_row_bytes());
      w.bytes(v.v, n * cold.value_row_bytes());
    }
  }
}

Status decode_cold(Reader& r, const SessionFileContext& ctx, int64_t n_past, int64_t next_pos,
                   ColdTier& cold) {
  const KvCacheConfig& c = ctx.cache;
  const KvType t = cold.config().type;
  if (!check_kv_type(t, c.head_dim).ok()) return bad("the policy's cold_type does not fit the model");
  std::vector<int32_t> pos, merged;
  std::vector<float> score;
  for (int il = 0; il < c.n_layer; ++il) {
    for (int h = 0; h < c.n_head_kv; ++h) {
      uint32_t n = 0;
      D2O_RETURN_IF_ERROR(r.get(n, "a cold slot count"));
      if (n > n_past || (n > 0 && !c.layer_compressible(il)))
        return bad("layer " + std::to_string(il) + " holds " + std::to_string(n) +
                   " cold slots, more than it can");
      if (n == 0) continue;
      D2O_RETURN_IF_ERROR(r.items(pos, n, "cold positions"));
      D2O_RETURN_IF_ERROR(r.items(score, n, "cold scores"));
      D2O_RETURN_IF_ERROR(r.items(merged, n, "cold merge counts"));
      const size_t kb = cold.key_row_bytes(), vb = cold.value_row_bytes();
      D2O_RETURN_IF_ERROR(r.need(n * (kb + vb), "cold rows"));
      const uint8_t* k = r.take(n * kb);
      const uint8_t* v = r.take(n * vb);
      if (!rows_finite(k, n, t.k, c.head_dim) || !rows_finite(v, n, t.v, c.head_dim) ||
          !all_finite(score))
        return bad("layer " + std::to_string(il) + ": a cold value is not a finite number");
      for (uint32_t j = 0; j < n; ++j) {
        if (pos[j] < 0 || pos[j] >= next_pos || merged[j] < 0 || merged[j] > n_past)
          return bad("layer " + std::to_string(il) + ": a cold slot's position or merge count "
                     "is out of range");
      }
      cold.restore_head(il, h, n, pos.data(), score.data(), merged.data(), k, v);
    }
  }
  return {};
}

// The recurrent layers' state (kv/recurrent_state.h), when the model has them: i64 tokens folded
// in, then per recurrent layer its convolution state and its delta-rule state (f32).
void encode_recurrent(Writer& w, const RecurrentState& rs, const KvCacheConfig& c) {
  w.put(rs.n_tokens);
  for (int il = 0; il < c.n_layer; ++il) {
    if (!c.recurrent(il)) continue;
    const auto& conv = rs.conv[static_cast<size_t>(il)];
    const auto& delta = rs.delta[static_cast<size_t>(il)];
    w.bytes(conv.data(), conv.size() * sizeof(float));
    w.bytes(delta.data(), delta.size() * sizeof(float));
  }
}

Status decode_recurrent(Reader& r, const KvCacheConfig& c, int64_t n_past, RecurrentState& rs) {
  int64_t n_tokens = 0;
  D2O_RETURN_IF_ERROR(r.get(n_tokens, "the recurrent state"));
  // The state is the whole conversation's: it cannot stand for fewer tokens than were seen.
  if (n_tokens != n_past)
    return bad("the recurrent state holds " + std::to_string(n_tokens) + " tokens, the session " +
               std::to_string(n_past));
  std::vector<float> conv, delta;
  for (int il = 0; il < c.n_layer; ++il) {
    if (!c.recurrent(il)) continue;
    D2O_RETURN_IF_ERROR(r.items(conv, static_cast<size_t>(c.recurrent_conv), "a recurrent state"));
    D2O_RETURN_IF_ERROR(
        r.items(delta, static_cast<size_t>(c.recurrent_delta), "a recurrent state"));
    if (!all_finite(conv) || !all_finite(delta))
      return bad("layer " + std::to_string(il) +
                 ": a recurrent state value is not a finite number");
    rs.conv[static_cast<size_t>(il)] = conv;
    rs.delta[static_cast<size_t>(il)] = delta;
  }
  rs.n_tokens = n_tokens;
  return {};
}

}  // namespace

uint64_t fnv1a64(const uint8_t* data, size_t size, uint64_t h) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {  // a word per step: a byte per step took 20-30 ms for 6 MB
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * kPrime;
  }
  for (; i < size; ++i) h = (h ^ data[i]) * kPrime;
  return h;
}

Result<ModelIdentity> model_identity(const std::string& gguf_path) {
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::open(gguf_path));
  ModelIdentity id;
  id.file_size = f->file_size();
  const uint64_t n = f->data_offset();
  std::ifstream in(gguf_path, std::ios::binary);
  std::vector<uint8_t> head(static_cast<size_t>(n));
  if (!in.read(reinterpret_cast<char*>(head.data()), static_cast<std::streamsize>(n)))
    return io_error("cannot read the header of " + gguf_path);
  id.header_hash = fnv1a64(head.data(), head.size());
  return id;
}

size_t max_session_file_bytes(const SessionFileContext& ctx) {
  const KvCacheConfig& c = ctx.cache;
  const size_t np = static_cast<size_t>(std::max<int64_t>(ctx.max_positions, 1));
  const size_t nl = static_cast<size_t>(c.n_layer), heads = static_cast<size_t>(c.n_head_kv);
  const size_t row = kv_row_bytes(c.type.k, c.head_dim) + kv_row_bytes(c.type.v, c.head_dim) + 16;
  const size_t state = 64 + nl * (4 + 8 + 8) + nl * heads * 5 + nl * 8 + (4 + nl * 4 + 8);
  // A cold tier holds at most every token of a head, in rows of at most F32.
  const size_t cold = nl * heads * (4 + np * (12 + 8 * static_cast<size_t>(c.head_dim)));
  const size_t recurrent =
      8 + nl * static_cast<size_t>(c.recurrent_conv + c.recurrent_delta) * sizeof(float);
  return kFixedHeader + 8 + kMaxIdBytes + kMaxSpecBytes + 8 + 4 + np * 4 + state +
         nl * (4 + heads * np * row) + cold + recurrent + 8;
}

Status encode_session(const SessionFileContext& ctx, const std::string& id,
                      const std::string& kv_spec, const std::vector<TokenId>& tokens,
                      int64_t n_past, const KvCache& cache, const PolicyState& st,
                      std::string& out) {
  const KvCacheConfig& c = cache.config();
  D2O_RETURN_IF_ERROR(check_cache_layout(ctx, static_cast<uint32_t>(c.n_layer),
                                         static_cast<uint32_t>(c.n_head_kv),
                                         static_cast<uint32_t>(c.head_dim), c.type));
  const ComposedPolicyState* own = composed_state(st);
  if (st.ext.get() && !own) return unsupported("the session's KV policy state cannot be saved");
  if (id.empty() || id.size() > kMaxIdBytes || kv_spec.size() > kMaxSpecBytes)
    return invalid_argument("session id or policy spec too long to save");
  if (static_cast<int64_t>(tokens.size()) != n_past)
    return invalid_argument("the session's token history does not match its position");
  out.clear();
  size_t size = kFixedHeader + 8 + id.size() + kv_spec.size() + 12 + 4 * tokens.size() + 64;
  for (int il = 0; il < cache.n_layer(); ++il) {
    const KvLayer& L = cache.layer(il);
    // The format holds one slot count per layer; heads=ada layers hold one per head.
    if (!L.uniform())
      return unsupported("sessions whose policy gives heads different slot counts (heads=ada) "
                         "cannot be saved yet");
    size += 4 + static_cast<size_t>(L.n_head_kv()) * static_cast<size_t>(L.n_slot()) *
                    (L.key_row_bytes() + L.value_row_bytes() + 16);
  }
  out.reserve(size);
  Writer w(out);
  w.bytes(kMagic, sizeof kMagic);
  w.put(kSessionFileVersion);
  w.put((cache.cold() ? kColdFlag : uint32_t{0}) | (c.has_recurrent() ? kRecurrentFlag : 0u));
  w.put(ctx.model.file_size);
  w.put(ctx.model.header_hash);
  w.put(static_cast<uint32_t>(c.n_layer));
  w.put(static_cast<uint32_t>(c.n_head_kv));
  w.put(static_cast<uint32_t>(c.head_dim));
  w.put(static_cast<uint8_t>(c.type.k));
  w.put(static_cast<uint8_t>(c.type.v));
  w.put(static_cast<uint8_t>(c.type.rot_k));
  w.put(static_cast<uint8_t>(c.type.rot_v));
  w.str(id);
  w.str(kv_spec);
  w.put(n_past);
  w.array(tokens);
  w.put(static_cast<uint8_t>(st.budgets_set));
  w.put(static_cast<uint8_t>(own != nullptr));
  w.array(st.budgets);
  w.array(st.evicted);
  w.array(st.merged);
  w.put(st.n_compactions);
  w.put(st.pos_shift);
  if (own) {
    static const D2oMergeState kNoThresholds;
    const D2oMergeState* d2o = d2o_merge_state(own->merger.get());
    if (!d2o) d2o = &kNoThresholds;
    w.array(d2o->tau);
    w.bytes(d2o->tau_ready.data(), d2o->tau_ready.size());
    w.array(own->layer_variance);
    w.array(own->pressure_floor);
    w.put(own->prompt_end);
  }
  for (int il = 0; il < cache.n_layer(); ++il) {
    const KvLayer& L = cache.layer(il);
    const size_t n = static_cast<size_t>(L.n_slot());
    w.put(static_cast<uint32_t>(n));
    if (n == 0) continue;
    // Rows in slot order (the cache's row map read through); a head holding fewer slots than
    // the layer's most is padded with its unused rows, as the layout pads it.
    for (const bool key : {true, false}) {
      const size_t rb = key ? L.key_row_bytes() : L.value_row_bytes();
      for (int h = 0; h < L.n_head_kv(); ++h) {
        const uint8_t* base = key ? L.key_base(h) : L.value_base(h);
        for (int j = 0; j < static_cast<int>(n); ++j)
          w.bytes(base + static_cast<size_t>(j < L.n_slot(h) ? L.rows(h)[j] : j) * rb, rb);
      }
    }
    for (int h = 0; h < L.n_head_kv(); ++h) w.bytes(L.pos(h), n * 4);
    for (int h = 0; h < L.n_head_kv(); ++h) w.bytes(L.score(h), n * 4);
    for (int h = 0; h < L.n_head_kv(); ++h) w.bytes(L.window(h), n * 4);
    for (int h = 0; h < L.n_head_kv(); ++h) w.bytes(L.merged(h), n * 4);
  }
  if (const ColdTier* cold = cache.cold()) encode_cold(w, *cold, c);
  if (c.has_recurrent()) encode_recurrent(w, cache.recurrent(), c);
  w.put(fnv1a64(reinterpret_cast<const uint8_t*>(out.data()), out.size()));
  return {};
}

Result<SessionData> decode_session(const SessionFileContext& ctx, const uint8_t* data,
                                   size_t size) {
  if (size > max_session_file_bytes(ctx))
    return bad("larger (" + std::to_string(size) + " bytes) than any session of this context");
  Reader r(data, size);
  char magic[8];
  D2O_RETURN_IF_ERROR(r.need(sizeof magic, "the magic"));
  std::memcpy(magic, r.take(sizeof magic), sizeof magic);
  if (std::memcmp(magic, kMagic, sizeof magic) != 0) return bad("not a d2o session file");
  uint32_t version = 0, flags = 0;
  D2O_RETURN_IF_ERROR(r.get(version, "the version"));
  if (version < kSessionFileOldestVersion || version > kSessionFileVersion) {
    return bad("version " + std::to_string(version) + ", this build reads versions " +
               std::to_string(kSessionFileOldestVersion) + " to " +
               std::to_string(kSessionFileVersion));
  }
  D2O_RETURN_IF_ERROR(r.get(flags, "the flags"));
  if ((flags & ~(kColdFlag | kRecurrentFlag)) != 0)
    return bad("unknown flags " + std::to_string(flags));
  if (((flags & kRecurrentFlag) != 0) != ctx.cache.has_recurrent())
    return bad((flags & kRecurrentFlag) ? "a recurrent state for a model without recurrent layers"
                                        : "no recurrent state for a model with recurrent layers");
  // The checksum before anything else is believed.
  if (size < r.at() + 8) return bad("truncated (no checksum)");
  uint64_t sum = 0;
  std::memcpy(&sum, data + size - 8, 8);
  if (sum != fnv1a64(data, size - 8)) return bad("checksum mismatch (a damaged or truncated file)");
  Reader body(data, size - 8);
  body.take(r.at());
  ModelIdentity model;
  D2O_RETURN_IF_ERROR(body.get(model.file_size, "the model identity"));
  D2O_RETURN_IF_ERROR(body.get(model.header_hash, "the model identity"));
  if (!(model == ctx.model)) {
    return invalid_argument("the session was saved for another model (GGUF of " +
                            std::to_string(model.file_size) + " bytes, this one " +
                            std::to_string(ctx.model.file_size) + ", or another header)");
  }
  uint32_t n_layer = 0, n_head_kv = 0, head_dim = 0;
  uint8_t tk = 0, tv = 0, rk = 0, rv = 0;
  D2O_RETURN_IF_ERROR(body.get(n_layer, "the cache layout"));
  D2O_RETURN_IF_ERROR(body.get(n_head_kv, "the cache layout"));
  D2O_RETURN_IF_ERROR(body.get(head_dim, "the cache layout"));
  D2O_RETURN_IF_ERROR(body.get(tk, "the storage type"));
  D2O_RETURN_IF_ERROR(body.get(tv, "the storage type"));
  D2O_RETURN_IF_ERROR(body.get(rk, "the storage type"));
  D2O_RETURN_IF_ERROR(body.get(rv, "the storage type"));
  const uint8_t max_type = static_cast<uint8_t>(KvElemType::kQ4_0);
  if (tk > max_type || tv > max_type || rk > 1 || rv > 1) return bad("unknown KV storage type");
  const KvType type{static_cast<KvElemType>(tk), static_cast<KvElemType>(tv), rk == 1, rv == 1};
  D2O_RETURN_IF_ERROR(check_cache_layout(ctx, n_layer, n_head_kv, head_dim, type));

  SessionData d;
  D2O_RETURN_IF_ERROR(body.str(d.id, kMaxIdBytes, "the session id"));
  D2O_RETURN_IF_ERROR(body.str(d.kv_spec, kMaxSpecBytes, "the policy spec"));
  auto policy = parse_kv_policy(d.kv_spec);
  if (!policy.ok()) return bad("bad policy spec: " + policy.status().message());
  if ((*policy)->spec() != d.kv_spec) {
    // Written under the old key names or d2o's paper-era defaults (recorded_spec_today).
    const std::string today = recorded_spec_today(d.kv_spec);
    if (today.empty()) return bad("the policy spec is not canonical");
    d.kv_spec = today;  // the policy the file was written under, in today's spelling
    policy = parse_kv_policy(today);  // (the recorded spelling may parse to another policy today)
    if (!policy.ok()) return bad("bad policy spec: " + policy.status().message());
  }
  D2O_RETURN_IF_ERROR(body.get(d.n_past, "the position"));
  if (d.n_past < 1 || d.n_past > ctx.max_positions) {
    return invalid_argument("the session holds " + std::to_string(d.n_past) +
                            " tokens, the context allows " + std::to_string(ctx.max_positions));
  }
  D2O_RETURN_IF_ERROR(body.array(d.tokens, static_cast<size_t>(d.n_past), "the token history"));
  if (static_cast<int64_t>(d.tokens.size()) != d.n_past)
    return bad("the token history does not match the position");
  for (TokenId t : d.tokens) {
    if (t < 0 || t >= ctx.n_vocab) return bad("token id " + std::to_string(t) + " out of range");
  }
  D2O_RETURN_IF_ERROR(decode_policy_state(body, ctx, version, d.n_past, d.state));
  if ((*policy)->is_full() && (d.state.budgets_set || d.state.ext.get() || d.state.pos_shift))
    return bad("a full cache with a compressing policy's state");
  d.cache.emplace(ctx.cache);
  d.cache->enable_cold((*policy)->cold_tier());  // restored below, or empty
  const int64_t next_pos = d.n_past - d.state.pos_shift;
  for (int il = 0; il < ctx.cache.n_layer; ++il)
    D2O_RETURN_IF_ERROR(decode_layer(body, ctx, il, d.n_past, next_pos, *d.cache));
  if (flags & kColdFlag) {
    if (!d.cache->cold()) return bad("a cold tier for a policy without one");
    D2O_RETURN_IF_ERROR(decode_cold(body, ctx, d.n_past, next_pos, *d.cache->cold()));
  }
  if (flags & kRecurrentFlag)
    D2O_RETURN_IF_ERROR(
        decode_recurrent(body, ctx.cache, d.n_past, d.cache->recurrent_for_update()));
  if (body.left() != 0)
    return bad(std::to_string(body.left()) + " bytes after the last layer");
  return d;
}

}  // namespace d2o::serve
