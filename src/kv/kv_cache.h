// KvCache: the per-sequence key/value store, one block per layer, with per-slot metadata.
//
// Layout of a layer (one KvLayer):
//   k, v   [n_head_kv, capacity, head_dim]  keys after RoPE / values, in F32, F16, Q8_0 or Q4_0
//                                           (KvType: keys and values may differ)
//   pos    [n_head_kv, capacity]            absolute token position of the slot (the position
//                                           its key was rotated for)
//   score  [n_head_kv, capacity]            accumulated attention (StatsNeeds::accumulate)
//   window [n_head_kv, capacity]            attention of the last w queries (StatsNeeds::window), transient
//   merged [n_head_kv, capacity]            how many evicted tokens were folded into the slot
//   row    [n_head_kv, capacity]            the physical row of k and v that holds the slot
// Entries are per KV head, never expanded per query head. Slots stay in chronological order
// (append at the end; compaction keeps relative order), so "the recent window" is always the
// last slots and "the sinks" the first ones of a head that kept them.
// The metadata is indexed by slot; the key and value rows are reached through `row`. A head's n
// slots always occupy physical rows [0, n), in any order: a new slot takes row n, and a
// compaction moves each kept row that lies at or past the new count into the row of an evicted
// slot below it (one row copy per such hole), instead of moving every key and value behind an
// evicted slot. Only the 4-byte metadata entries move with the slot order. Rows out of slot
// order are read scattered (no hardware prefetch), so once kReorderAfter slots have been evicted
// since the rows were last in order, the compaction puts them back in order (each row out of
// place copied once), which keeps the reads mostly sequential for a tenth or less of the moves.
// A layer copied into a new allocation (reserve, trim, copies, restore) gets its rows in order.
// The heads of a layer usually hold the same number of slots (n_slot); which tokens they hold may
// differ. A policy with per-head budgets (heads=ada) leaves them holding different counts
// (n_slot(h)); n_slot() is then the largest, the one the [n_head_kv, capacity] layout is sized
// for. Layers may hold different numbers of slots (per-layer budgets). Memory: the layout
// pads every head to the layer's capacity, so kv_bytes_allocated() counts n_head_kv x capacity
// rows while kv_bytes_used() counts the rows the heads hold (sum over heads).
//
// The only mutators are append() (new tokens), apply() (a CompactionPlan from a policy),
// replace_value() and replace_scores() (a policy's values and scores written while planning), for
// sliding-window layers drop_oldest(), truncate() (a conversation cut back to a prefix), the
// allocation calls (reserve, trim, ...), statistics resets and copies; KvLayer is read-only
// outside KvCache, except that the attention kernel accumulates statistics through
// KvCache::layer_for_attention().
//
// Sliding-window layers (KvCacheConfig::layer_window[il] = W > 0; Gemma 3's local layers): a
// query sees only the last W positions, so the layer keeps a ring of the last W - 1 slots plus
// the pass being appended; slots older than that are dropped in batches (drop_oldest, at most
// every kSlidingSlack tokens while decoding, so dropping moves O(W / kSlidingSlack) slots per
// token). Such a layer never exceeds sliding_capacity(W, chunk) slots, is not subject to the slot
// limit, and is never compacted by a KV policy (layer_compressible()).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/mem.h"
#include "d2o/status.h"
#include "kv/query_window.h"
#include "kv/recurrent_state.h"
#include "ops/ggml_type.h"

namespace d2o {

class ThreadPool;       // core/thread_pool.h
class ColdTier;         // kv/cold_tier.h
struct ColdTierConfig;  // kv/cold_tier.h
struct ColdRecall;      // kv/cold_tier.h

// Storage of one key or value row of head_dim elements: F32, F16, or GGUF's Q8_0 / Q4_0 blocks
// (32 elements per block, ops/quant.h; head_dim must then be a multiple of 32).
enum class KvElemType { kF32, kF16, kQ8_0, kQ4_0 };
const char* kv_elem_type_name(KvElemType t);
// Bytes of one row of `head_dim` elements.
size_t kv_row_bytes(KvElemType t, int head_dim);
// The GGUF type of a quantised storage type (Q8_0 / Q4_0); F32 / F16 for the others.
GgmlType kv_ggml_type(KvElemType t);
inline bool kv_quantized(KvElemType t) {
  return t == KvElemType::kQ8_0 || t == KvElemType::kQ4_0;
}

// One row of n elements read as floats / stored (rounded or quantised) in storage type t.
void kv_load_row(KvElemType t, const uint8_t* p, int n, float* out);
void kv_store_row(KvElemType t, const float* in, int n, uint8_t* p);

// Storage types of keys and of values. rot_k / rot_v: the rows are stored rotated by a
// normalised Walsh-Hadamard transform (kv/kv_rotation.h; spelt with an "r" suffix, "q4_0r"),
// which the model applies to keys and queries, and to values and the attention output, so that
// an outlier channel is spread over its block before quantisation. The row layout and byte
// counts are those of the element type; attention kernels and policies need not know.
struct KvType {
  KvElemType k = KvElemType::kF16;
  KvElemType v = KvElemType::kF16;
  bool rot_k = false;
  bool rot_v = false;
  static const KvType kF32, kF16, kQ8_0, kQ4_0;  // one type for both
  bool operator==(const KvType&) const = default;
};
inline constexpr KvType KvType::kF32{KvElemType::kF32, KvElemType::kF32};
inline constexpr KvType KvType::kF16{KvElemType::kF16, KvElemType::kF16};
inline constexpr KvType KvType::kQ8_0{KvElemType::kQ8_0, KvElemType::kQ8_0};
inline constexpr KvType KvType::kQ4_0{KvElemType::kQ4_0, KvElemType::kQ4_0};
// "f16" when both are the same, else "k:q8_0r,v:f16" (a static string).
const char* kv_type_name(KvType t);
// Parses "TYPE" (both) or "k:TYPE,v:TYPE" (either part may be left out: F16), TYPE one of f32,
// f16, q8_0, q4_0, each optionally followed by "r" (rotated storage).
Result<KvType> parse_kv_type(const std::string& s);
// An error unless every quantised part of `t` can store rows of `head_dim` elements and every
// rotated part's rotation fits the head (head_dim a multiple of 64).
Status check_kv_type(KvType t, int head_dim);

// One term of a merge: slot `dst` of `head` becomes sum over its terms of w * row(src).
// The terms of one (head, dst) are contiguous in a plan, and include the dst itself (src == dst).
struct MergeTerm {
  int32_t head;
  int32_t dst;  // old slot index (kept)
  int32_t src;  // old slot index (evicted, or == dst)
  float w;
};

// The accumulated score a merged slot has afterwards.
enum class MergedScore {
  kSum,   // the sum of the merged slots' scores: attention mass is conserved (the default)
  kKeep,  // the retained slot keeps its own score
  kMean,  // the mean of the merged slots' scores (the retained slot included)
  kMax,   // the largest of the merged slots' scores
};

// Positions a plan moves down after the gather (positions renumbered, keys re-rotated): slots from
// `first_slot` (new index) on get position - by, their keys re-rotated by -by with `rope` (RoPE
// rotations compose: R(p) R(-r) = R(p - r)).
struct PositionShift {
  int first_slot = 0;
  int by = 0;  // 0: no shift
  const RopeParams* rope = nullptr;
};

// What a policy decides for one layer. Slot indices refer to the layer before the plan.
// KvCache::apply() runs it in this order: merges, the gather of kept slots, the position shift.
struct CompactionPlan {
  int n_head_kv = 0;
  int n_keep = 0;             // slots each head keeps (per-head counts: the most any keeps)
  std::vector<int32_t> keep;  // [n_head_kv, n_keep], strictly ascending per head
  // Per-head budgets (reset_heads): head h keeps head_keep[h] slots, listed from keep[head_off[h]]
  // (the lists packed one after another). Empty: every head keeps n_keep.
  std::vector<int32_t> head_keep, head_off;
  std::vector<MergeTerm> merges;  // see MergeTerm
  MergedScore merged_score = MergedScore::kSum;
  // Non-null: keys are merged un-rotated. A source key cached for position p_src is rotated by
  // p_dst - p_src before it is weighted, so the merged key is the weighted sum of the un-rotated
  // keys, rotated for the retained slot's position p_dst (RoPE rotations compose).
  const RopeParams* rope = nullptr;
  PositionShift shift;

  void reset(int n_head_kv_, int n_keep_) {
    n_head_kv = n_head_kv_;
    n_keep = n_keep_;
    // Exactly the entries needed (no geometric growth): a sequence keeps its plans between
    // passes, and what it keeps is reserved for it (KvPolicy::state_bytes).
    const size_t need = static_cast<size_t>(n_head_kv_) * static_cast<size_t>(n_keep_);
    if (keep.capacity() < need) keep.reserve(need);
    keep.resize(need);
    merges.clear();
    head_keep.clear();
    head_off.clear();
    merged_score = MergedScore::kSum;
    rope = nullptr;
    shift = PositionShift();
  }
  // A plan in which head h keeps counts[h] slots.
  void reset_heads(int n_head_kv_, const int32_t* counts) {
    reset(n_head_kv_, 0);
    head_keep.assign(counts, counts + n_head_kv_);
    head_off.resize(static_cast<size_t>(n_head_kv_));
    size_t total = 0;
    for (int h = 0; h < n_head_kv_; ++h) {
      head_off[static_cast<size_t>(h)] = static_cast<int32_t>(total);
      total += static_cast<size_t>(counts[h]);
      n_keep = std::max(n_keep, static_cast<int>(counts[h]));
    }
    if (keep.capacity() < total) keep.reserve(total);
    keep.resize(total);
  }
  size_t keep_index(int head) const {
    return head_off.empty() ? static_cast<size_t>(head) * n_keep
                            : static_cast<size_t>(head_off[static_cast<size_t>(head)]);
  }
  int32_t* keep_of(int head) { return keep.data() + keep_index(head); }
  const int32_t* keep_of(int head) const { return keep.data() + keep_index(head); }
  int n_keep_of(int head) const {
    return head_keep.empty() ? n_keep : head_keep[static_cast<size_t>(head)];
  }
};

// One layer's slots. Read-only for everything but KvCache: the buffers change only through
// KvCache::append(), apply() (a CompactionPlan), replace_value(), drop_oldest(), the
// allocation calls (reserve, trim, ...) and the narrow operations KvCache names (statistics
// resets, copies). The attention kernel accumulates statistics through score_accum /
// window_accum, reachable only from KvCache::layer_for_attention().
class KvLayer {
 public:
  int n_head_kv() const { return n_head_kv_; }
  int head_dim() const { return head_dim_; }
  KvType type() const { return type_; }
  int capacity() const { return capacity_; }  // slots allocated per head
  int n_slot() const { return n_slot_; }      // slots in use per head (the most any head holds)
  // Slots head h holds (n_slot() unless the heads hold different counts).
  int n_slot(int h) const { return head_n_.empty() ? n_slot_ : head_n_[static_cast<size_t>(h)]; }
  // True when every head holds n_slot() slots.
  bool uniform() const { return head_n_.empty(); }
  // Null when uniform(), else the [n_head_kv] per-head counts.
  const int32_t* head_counts() const { return head_n_.empty() ? nullptr : head_n_.data(); }
  // Slots held, summed over the heads.
  int64_t held_slots() const;

  // Bytes of one key / value row (they differ when keys and values have different types).
  size_t key_row_bytes() const { return kv_row_bytes(type_.k, head_dim_); }
  size_t value_row_bytes() const { return kv_row_bytes(type_.v, head_dim_); }
  // Row pointers: head h, slot j (through the row map: rows of consecutive slots need not be
  // adjacent).
  const uint8_t* key_row(int h, int j) const {
    return k_.data() + row_offset(h, phys(h, j), key_row_bytes());
  }
  const uint8_t* value_row(int h, int j) const {
    return v_.data() + row_offset(h, phys(h, j), value_row_bytes());
  }
  // Head h's physical row 0 and its row map: slot j's key row is key_base(h) + rows(h)[j] *
  // key_row_bytes() (values alike), rows(h)[0..n_slot(h)) a permutation of [0, n_slot(h)).
  const uint8_t* key_base(int h) const { return k_.data() + row_offset(h, 0, key_row_bytes()); }
  const uint8_t* value_base(int h) const { return v_.data() + row_offset(h, 0, value_row_bytes()); }
  const int32_t* rows(int h) const { return row_.data() + meta_index(h, 0); }
  // Evictions after which a compaction puts the rows back in slot order.
  static constexpr int kReorderAfter = 32;
  // Slot metadata of head h: [n_slot(h)] entries, slot j at index j.
  const int32_t* pos(int h) const { return pos_.data() + meta_index(h, 0); }
  const float* score(int h) const { return score_.data() + meta_index(h, 0); }
  const float* window(int h) const { return window_.data() + meta_index(h, 0); }
  const int32_t* merged(int h) const { return merged_.data() + meta_index(h, 0); }
  // Reads a key/value row as floats (dequantised).
  void load_key(int h, int j, float* out) const;
  void load_value(int h, int j, float* out) const;

  // The attention kernel's door: head h's statistics [capacity] as raw pointers to accumulate
  // into (its inner loops must not pay a call per element). A non-const KvLayer exists only
  // through KvCache::layer_for_attention().
  // window_accum: only after open_window_stats() (called once per pass, before any thread
  // accumulates).
  float* score_accum(int h) { return score_.data() + meta_index(h, 0); }
  float* window_accum(int h) { return window_.data() + meta_index(h, 0); }
  void open_window_stats() { window_live_ = true; }

 private:
  friend class KvCache;
  friend struct KvTestAccess;  // tests/unit/kv_test_access.h: tests set up states directly

  size_t meta_index(int h, int j) const { return static_cast<size_t>(h) * capacity_ + j; }
  int32_t phys(int h, int j) const { return row_[meta_index(h, j)]; }
  size_t row_offset(int h, int j, size_t rb) const {
    return (static_cast<size_t>(h) * capacity_ + static_cast<size_t>(j)) * rb;
  }
  uint8_t* mutable_key_row(int h, int j) {
    return k_.data() + row_offset(h, phys(h, j), key_row_bytes());
  }
  uint8_t* mutable_value_row(int h, int j) {
    return v_.data() + row_offset(h, phys(h, j), value_row_bytes());
  }
  // Stores one row (rounded / re-quantised).
  void store_key(int h, int j, const float* in);
  void store_value(int h, int j, const float* in);
  // Moves the metadata of slots [from, from + n) of head h to [to, to + n) (memmove; the rows
  // stay where they are, the row map moves with the rest).
  void move_slots(int h, int to, int from, int n);
  // Copies physical row `from` of head h (key and value) to row `to`.
  void copy_row(int h, int to, int from);
  // Puts the rows of head h's first n slots in slot order (row map: the identity), following the
  // permutation's cycles; those slots hold rows [0, n).
  void order_rows(int h, int n);
  // Notes n_evicted more evictions; true when the rows are due to be put back in order.
  bool note_evictions(int n_evicted) {
    unordered_ += n_evicted;
    if (unordered_ < kReorderAfter) return false;
    unordered_ = 0;
    return true;
  }
  // Head h keeps n_keep slots and evicts slot e (its metadata still in place): when e's row lies
  // below n_keep it is a hole, and the kept slot with the highest row at or past n_keep moves
  // into it. `movers` yields kept slots from the newest down; it is advanced past those it used.
  template <class Movers>
  void fill_hole(int h, int n_keep, int e, Movers& movers) {
    int32_t* map = row_.data() + meta_index(h, 0);
    if (map[e] >= n_keep) return;
    int s = movers();
    while (map[s] < n_keep) s = movers();
    copy_row(h, map[e], map[s]);
    map[s] = map[e];
  }

  int n_head_kv_ = 0;
  int head_dim_ = 0;
  KvType type_ = KvType::kF16;
  int capacity_ = 0;
  int n_slot_ = 0;
  std::vector<int32_t> head_n_;  // [n_head_kv] per-head counts, or empty: all hold n_slot_
  // Sets the per-head counts (empty: all hold n); n_slot_ = the largest. Equal counts: uniform.
  void set_counts(const int32_t* counts, int n);
  AlignedBuffer<uint8_t> k_, v_;   // [n_head_kv, capacity, row bytes]
  AlignedBuffer<int32_t> pos_;     // [n_head_kv, capacity]
  AlignedBuffer<float> score_;     // [n_head_kv, capacity]
  AlignedBuffer<float> window_;    // [n_head_kv, capacity]
  AlignedBuffer<int32_t> merged_;  // [n_head_kv, capacity]
  AlignedBuffer<int32_t> row_;     // [n_head_kv, capacity] physical row of each slot
  int64_t unordered_ = 0;          // slots evicted since the rows were last in slot order
  // False while window_ / merged_ are zero for every slot held (no window statistics since the
  // last reset; no merge): compactions then need not move them. A decode step that merges
  // nothing moves 3 of the 5 metadata entries behind its evicted slot, one that merges 4.
  bool window_live_ = false;
  bool merged_live_ = false;
};

struct KvCacheConfig {
  KvCacheConfig() = default;
  KvCacheConfig(int n_layer_, int n_head_kv_, int head_dim_, KvType type_,
                std::vector<int> layer_window_ = {})
      : n_layer(n_layer_),
        n_head_kv(n_head_kv_),
        head_dim(head_dim_),
        type(type_),
        layer_window(std::move(layer_window_)) {}

  int n_layer = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  KvType type = KvType::kF16;
  // Query heads (0: unknown, taken as n_head_kv): the queries a layer records
  // (KvCache::queries) are per query head.
  int n_head = 0;
  // Per layer: > 0 marks a sliding-window layer of that window; empty: every layer is global.
  std::vector<int> layer_window;

  // Per layer: != 0 marks a recurrent layer (LayerKind::kRecurrent), which holds no slots but a
  // state of recurrent_conv + recurrent_delta floats (KvCache::recurrent); empty: none.
  std::vector<uint8_t> layer_recurrent;
  int recurrent_conv = 0;
  int recurrent_delta = 0;

  // Per layer: its head width (gemma4's sliding and global layers differ); empty: head_dim.
  std::vector<int> layer_head_dim;
  // Per layer: the layer whose slots its queries attend over (gemma4's last layers read an
  // earlier layer's keys and values: such a layer holds no slots and no policy compresses it);
  // empty: every layer its own.
  std::vector<int> layer_kv_source;

  int window(int il) const {
    return layer_window.empty() ? 0 : layer_window[static_cast<size_t>(il)];
  }
  bool recurrent(int il) const {
    return !layer_recurrent.empty() && layer_recurrent[static_cast<size_t>(il)] != 0;
  }
  bool has_recurrent() const {
    return std::any_of(layer_recurrent.begin(), layer_recurrent.end(),
                       [](uint8_t r) { return r != 0; });
  }
  int head_dim_of(int il) const {
    return layer_head_dim.empty() ? head_dim : layer_head_dim[static_cast<size_t>(il)];
  }
  int kv_source(int il) const {
    return layer_kv_source.empty() ? il : layer_kv_source[static_cast<size_t>(il)];
  }
  bool shares_kv(int il) const { return kv_source(il) != il; }
  // The widest head of any layer.
  int max_head_dim() const;
  bool layer_compressible(int il) const {
    return window(il) == 0 && !recurrent(il) && !shares_kv(il);
  }
  bool has_sliding() const;
  int n_compressible() const;
};

// Slots a sliding-window layer of window W holds before a pass drops them (see above), and the
// most it holds while a pass of `chunk` tokens is appended.
constexpr int kSlidingSlack = 64;
inline int sliding_capacity(int window, int chunk) {
  return window - 1 + (chunk > kSlidingSlack ? chunk : kSlidingSlack);
}

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& cfg);

  const KvCacheConfig& config() const { return cfg_; }
  int n_layer() const { return cfg_.n_layer; }
  const KvLayer& layer(int il) const { return layers_[static_cast<size_t>(il)]; }
  // Layer il for the attention kernel (attention_forward), which accumulates its statistics
  // (KvLayer::score_accum / window_accum); nothing else may use it.
  KvLayer& layer_for_attention(int il) { return layers_[static_cast<size_t>(il)]; }

  // Makes room for `n_slots` slots per head in layer il, keeping the contents. Growth is
  // geometric (amortised O(1) copies per appended token) up to the slot limit; `exact` asks for
  // exactly n_slots (used after compaction to hand memory back). Asking for more slots than the
  // limit is an error (resource_exhausted), never a silent overcommit.
  Status reserve(int il, int n_slots, bool exact);
  // Caps every layer's capacity at `max_slots` per head (0: no limit), and lets one layer at a
  // time hold up to `one_layer_extra` slots more (a turn's recall from a cold tier, which each
  // layer hands back before the next recalls), so the cache never allocates more than
  // bytes_for_slots(config(), max_slots) + bytes_for_one_layer(config(), one_layer_extra): a
  // memory pool reserves that much for the sequence (runtime/kv_pool.h). Layers already above
  // the limit are an error.
  Status set_slot_limit(int max_slots, int one_layer_extra = 0);
  int slot_limit() const { return slot_limit_; }
  int slot_limit_extra() const { return slot_extra_; }
  // Shrinks every layer's allocation to its n_slot + `slack` if it holds more than that.
  Status shrink_to_fit(int slack);
  // After a compaction: hands back memory of layers holding more than n_slot + slack + a small
  // hysteresis (so a steady decode step, which adds one slot and evicts one, never reallocates).
  Status trim(int slack);
  // trim() for layer il alone (a layer compacted inside a pass, while the others still hold it).
  Status trim_layer(int il, int slack);
  // Slots in use, summed over layers (one KV head's count per layer; with per-head counts, the
  // layer's held_slots() / n_head_kv, rounded down).
  int64_t total_slots() const;

  // Appends n_tok tokens to layer il: k and v are [n_tok, n_head_kv * head_dim] floats, pos the
  // tokens' positions. Capacity must already suffice. New slots get score 0, merged 0. Each head
  // appends after its own last slot (n_slot(h)).
  void append(int il, const float* k, const float* v, const int32_t* pos, int n_tok);

  // Applies a plan to layer il (merges first, then the gather of kept slots). With `pool` (and
  // called outside its tasks), the heads' slots are gathered in parallel; the result is the same.
  void apply(int il, const CompactionPlan& plan, ThreadPool* pool = nullptr);

  // While planning layer il (a merger that spreads evicted values over the slots after them):
  // slot j of head h, a slot the plan keeps, gets the value `row` (head_dim floats) that evicted
  // slots were merged into. Done in place rather than through the plan, which would have to hold
  // a copy of the recent window's values of every layer. Layers are independent: different
  // layers may be written in parallel.
  void replace_value(int il, int h, int j, const float* row);

  // While planning layer il: slots [first, first + count) of head h get the accumulated scores
  // `scores` (a policy that re-scores slots at a compaction), before the plan's merges combine
  // them. Layers are independent, and so are heads.
  void replace_scores(int il, int h, int first, int count, const float* scores);

  // Slots [first, first + count) of head h of layer il get the window statistics `window` (a
  // window formed over several passes, KvPolicy::reconstruction_chunk), read by the compaction
  // that follows. Layers are independent, and so are heads.
  void replace_window(int il, int h, int first, int count, const float* window);

  // Removes the `count` slots appended last to layer il, which nothing may have moved since
  // (they hold the highest rows: append). A pass run to read its attention statistics (the
  // prompt's reconstruction, KvPolicy::reconstruction_chunk) leaves the cache as it found it.
  void drop_appended(int il, int count);

  // The longest prefix of positions [0, p), p <= n, that this cache holds as a cache fed only
  // those p tokens would: in every global layer, each head's first p slots are positions 0..p-1
  // as appended (nothing evicted below p, nothing merged into them); in every sliding-window
  // layer of window W, the positions a query at p sees, [max(0, p - W + 1), p). A compaction
  // that reached below n ends the prefix there; a sliding window that has moved past what p
  // needs gives 0. The accumulated statistics of the slots kept are not checked: they are the
  // cache's as it was fed (what the later tokens' queries gave them included).
  int64_t intact_prefix(int64_t n) const;
  // Removes from every layer the slots at positions >= n, so that the cache holds the prefix
  // intact_prefix() vouched for (it must return n: asserted). The memory stays allocated; the
  // cold tier is not touched.
  void truncate(int64_t n);

  // Sliding-window layer il, before a pass of n_tok tokens is appended: drops the oldest slots
  // if the layer would otherwise exceed sliding_capacity(W, n_tok), keeping the last W - 1 (all
  // the pass's first query can see). Returns the slots dropped.
  int drop_oldest(int il, int n_tok);
  // After a pass of more than kSlidingSlack tokens that no pass of the same prompt follows: every
  // sliding-window layer drops now what the next pass's drop_oldest would drop first (keeping the
  // last W - 1 slots) and hands back the memory above its steady capacity, so that a sequence
  // left idle after a long pass (a server session whose turn ended with its prompt) holds its
  // window, not the whole pass. The slots kept and their order are those the next pass would
  // have found: results do not change.
  Status settle_sliding();

  // Layer il's recorded queries (StatsNeeds::queries, kv/query_window.h): empty unless a policy
  // asked the attention pass for them.
  const QueryWindow& queries(int il) const { return queries_[static_cast<size_t>(il)]; }
  // The attention pass's door to them (model/kv_attention.cpp records a pass's last queries).
  QueryWindow& queries_for_attention(int il) { return queries_[static_cast<size_t>(il)]; }
  // Forgets every layer's recorded queries and frees them (a policy that reads them no more, or a
  // copy of a cache whose policy never asked for them).
  void drop_queries();

  // Zeroes layer il's accumulated scores / window statistics (the window statistics cover one
  // pass; a forked cache drops statistics its policy does not ask for).
  void reset_score_stats(int il);
  void reset_window_stats(int il);

  // Drops everything (a new conversation), the cold tier's slots, the recorded queries and the
  // recurrent state included.
  void clear();

  // The recurrent layers' state (kv/recurrent_state.h; empty without recurrent layers). Copies of
  // the cache copy it; no KV policy and no compaction touches it. While it holds tokens
  // (n_tokens > 0), intact_prefix() vouches only for all of them: it cannot be taken back.
  const RecurrentState& recurrent() const { return rec_; }
  // The forward pass's door to it (model/delta_net.cpp), and a saved conversation's.
  RecurrentState& recurrent_for_update() { return rec_; }

  // The cold tier (kv/cold_tier.h), where apply() puts the slots it evicts; null unless enabled.
  // Copies of the cache (copy_from, copy_slots_from) copy its contents into this cache's tier, if
  // this cache has one (the other cache's tier, or none, does not change that).
  void enable_cold(const ColdTierConfig& cfg);
  ColdTier* cold() { return cold_.get(); }
  const ColdTier* cold() const { return cold_.get(); }
  // Layer il takes back slots recalled from the cold tier: per_head[h] (position order) goes into
  // head h at its place in position order, with its score and merge count and window statistics
  // 0. The slots that follow keep their order; a pass appends after them as usual.
  Status insert_recalled(int il, const std::vector<ColdRecall>& per_head);

  // Makes this cache an exact copy of `other` (same configuration required): slots, metadata,
  // recorded queries and capacities. Used to save and restore a prefilled state (benchmarks, forks).
  Status copy_from(const KvCache& other);
  // Copies the slots, metadata and recorded queries of `other` (same configuration required), each layer
  // allocated for exactly its slot count (at least 1): a compact copy that appends grow as usual.
  Status copy_slots_from(const KvCache& other);

  // Layer il becomes n_slot slots per head, allocated exactly (at least 1), read from packed
  // arrays [n_head_kv][n_slot] (rows of key_row_bytes() / value_row_bytes()): a saved
  // conversation read back (serve/session_file.*), whose reader validated the contents.
  Status restore_layer(int il, int n_slot, const uint8_t* k, const uint8_t* v, const int32_t* pos,
                       const float* score, const float* window, const int32_t* merged);

  // Bytes of key and value storage allocated (n_head_kv x capacity rows) / in use (the rows the
  // heads hold, sum over heads), over all layers.
  size_t kv_bytes_allocated() const;
  size_t kv_bytes_used() const;
  // Bytes of slot metadata allocated (pos, score, window, merged, row).
  size_t meta_bytes_allocated() const;
  // Bytes the keys and values of n tokens take in a full cache of this configuration.
  size_t full_kv_bytes(int64_t n_tokens) const;
  // Everything the cache holds in memory: key and value storage, slot metadata, the recorded
  // queries and the cold tier's rows and metadata (kv/cold_tier.h).
  size_t bytes_held() const;
  // The most key and value storage and slot metadata allocated at once since the cache was made
  // or cleared (measured after each allocation; the cold tier not counted): what a prompt's
  // passes needed at their peak.
  size_t peak_bytes_allocated() const { return peak_bytes_; }
  // Starts the peak over from what is allocated now (the peak of the passes that follow).
  void reset_peak() { peak_bytes_ = kv_bytes_allocated() + meta_bytes_allocated(); }
  // Bytes a cache of configuration `cfg` allocates when every layer has a capacity of `slots`
  // per KV head: keys, values and slot metadata (what kv_bytes_allocated() +
  // meta_bytes_allocated() report for that capacity). A sliding-window layer, which no policy
  // compacts, holds min(n_tokens, sliding_capacity(W, max_chunk)) for a sequence of n_tokens fed
  // in passes of at most max_chunk (n_tokens < 0: `slots`).
  static size_t bytes_for_slots(const KvCacheConfig& cfg, int64_t slots, int max_chunk = 512,
                                int64_t n_tokens = -1);
  // Bytes `slots` more slots per KV head take in the widest layer a policy compacts (neither
  // sliding nor reading another layer's slots): what set_slot_limit's one_layer_extra may add.
  static size_t bytes_for_one_layer(const KvCacheConfig& cfg, int64_t slots);

 private:
  // N = L's slots in a fresh allocation of `capacity` slots per head (capacity >= L's n_slot).
  static void copy_layer_slots(const KvLayer& L, int capacity, KvLayer& N);
  // N's first slots = L's slots (N allocated for at least as many).
  static void copy_rows(const KvLayer& L, KvLayer& N);
  Status reallocate(int il, int new_capacity);
  // Whether a layer other than il (not a sliding one) holds more than the slot limit.
  bool other_layer_above_limit(int il) const;
  // Raises peak_bytes_ to what is allocated now.
  void note_peak();
  Status shrink_sliding(int il);
  KvCacheConfig cfg_;
  int slot_limit_ = 0;  // 0: none
  int slot_extra_ = 0;  // what one layer at a time may hold above slot_limit_
  size_t peak_bytes_ = 0;  // peak_bytes_allocated()
  std::vector<KvLayer> layers_;
  std::vector<QueryWindow> queries_;  // [n_layer]
  std::vector<float> tmp_k_, tmp_v_, acc_k_, acc_v_;  // merge scratch [head_dim rounded up to 4]
  std::shared_ptr<ColdTier> cold_;  // never shared: copies of the cache copy the tier
  RecurrentState rec_;
  // The cold tier's contents of `o` when both have the same kind of tier; else an empty tier.
  void copy_cold(const KvCache& o);
  // The slots `plan` evicts from layer il, into the cold tier.
  void to_cold(int il, const CompactionPlan& plan);
  friend struct KvTestAccess;  // tests/unit/kv_test_access.h: tests set up states directly
};

}  // namespace d2o
