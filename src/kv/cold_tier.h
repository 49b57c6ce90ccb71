// ColdTier: where a KV cache's evicted slots go instead of away, so that a later turn of a
// conversation can bring back what its question needs (policy key cold=memory).
//
// Each compaction (KvCache::apply) hands the tier the slots it evicts, as they were: key and value
// rows re-stored in the tier's own storage type (cold_type=; q8_0 on disk, q4_0r in memory), with
// their position, accumulated score and merge count. Per layer and KV head, in order of arrival;
// cold_size= bounds the slots each head keeps (the oldest go first).
//
// When a new turn of several tokens is fed to a sequence whose tier holds slots, the turn's last
// `window` queries score the cold slots of each layer's KV heads, inside the turn's pass, just
// before the layer's attention (model/kv_attention.cpp): a slot's score is the attention those
// queries (and the query heads of the KV head) give it among the cold slots, summed over them
// (as the compaction that ends the turn sums the window's attention over hot and recalled slots),
// then summed over its `kernel` neighbours in position order (so that a passage comes back whole
// around the token its question found, as SnapKV's pooling keeps it; recall_ranking=max: the
// most any query gives it, the best of its neighbours). While a head's tier holds at most
// `recall_all_up_to` slots, or `recall` covers every one, nothing is scored: all come back. The
// best `recall` slots of each head go back into the hot cache at their place in position order
// (KvCache::insert_recalled), so the turn, and the answer after it, attend to them; the
// compaction that ends the turn then ranks hot and recalled slots alike by the turn's window
// attention (PassInfo::recalled), and what it evicts goes to the tier again.
//
// Bytes: rows_bytes() + meta_bytes(), in memory. Positions are the slots' own: a policy that
// renumbers positions (positions=shifted) cannot have a cold tier.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/kv_cache.h"

namespace d2o {

class ColdFile;

// Where the tier's slots live: memory, or a file (kv/cold_file.h) with a small staging tail per
// KV head in memory.
enum class ColdPlace { kNone, kMemory, kDisk };

// How a turn ranks the cold slots it may recall (recall_ranking=).
enum class RecallRanking {
  kMax,    // the most attention any of the window's queries gives a slot among the cold slots, in
           // log space, then the best over its `kernel` neighbours (the first form of the tier)
  kSum,    // the window's attention over the cold slots summed over its queries, then over the
           // `kernel` neighbours: the sum the compaction that ends the turn ranks by
  kWhole,  // as kSum, each query's attention taken over the whole context (the hot slots, the
           // turn's own keys up to the query and every cold slot), not over the cold slots
           // alone: the statistic the turn's compaction would rank the cold slots by had all of
           // them been recalled, so a query that looks at the hot slots adds little
};

// Which rows of a turn attend to what it recalls (recall_reach=).
enum class RecallReach {
  kTurn,    // every row of the pass that recalls: the recall comes before the pass attends
  kWindow,  // the window's rows only (the queries that scored the recall): the rows before the
            // window attend to the hot slots first, then the window recalls and attends; a large
            // recall then costs the window's attention to it, not the whole turn's
};

struct ColdTierConfig {
  ColdPlace place = ColdPlace::kNone;
  RecallRanking ranking = RecallRanking::kSum;
  RecallReach reach = RecallReach::kTurn;
  // The rows' storage type: q8_0 on disk, q4_0r in memory, unless cold_type= says otherwise
  // (default_type; a bare config holds q4_0r).
  KvType type{KvElemType::kQ4_0, KvElemType::kQ4_0, true, true};
  int64_t max_slots = 0;  // per layer and KV head (0: no bound)
  int recall = 512;       // slots per layer and KV head recalled per turn, ranked
  // While a head's tier holds at most this many slots, a turn recalls every one of them (nothing
  // ranked, the turn attends to the whole context); beyond it, the best `recall` (0: never).
  int recall_all_up_to = 2048;
  int window = 32;        // the turn's last queries that score the cold slots
  int kernel = 21;        // a slot's score: the best of its `kernel` neighbours in position order
  bool enabled() const { return place != ColdPlace::kNone; }
  // The storage type a tier in `p` gets unless told: on disk, where bytes are cheap, q8_0 (the
  // recalled rows close to what was evicted); in memory, where they count, q4_0r.
  static KvType default_type(ColdPlace p) {
    return p == ColdPlace::kDisk ? KvType{KvElemType::kQ8_0, KvElemType::kQ8_0, false, false}
                                 : KvType{KvElemType::kQ4_0, KvElemType::kQ4_0, true, true};
  }
  // Slots a turn recalls from a head whose tier holds `held`.
  int64_t recall_count(int64_t held) const {
    return held <= recall_all_up_to ? held : std::min<int64_t>(recall, held);
  }
  // The most slots a turn may recall from one head.
  int64_t max_recall() const { return std::max<int64_t>(recall, recall_all_up_to); }
  bool operator==(const ColdTierConfig&) const = default;
};

// What one KV head recalls, in position order: rows as floats in the hot cache's storage space.
struct ColdRecall {
  std::vector<int32_t> pos, merged;
  std::vector<float> score;
  std::vector<float> k, v;  // [count, head_dim]
  int count() const { return static_cast<int>(pos.size()); }
  void clear() {
    pos.clear();
    merged.clear();
    score.clear();
    k.clear();
    v.clear();
  }
};

// recall_ranking=whole: each of a KV head's window queries' log-sum-exp over what the turn
// attends to outside the cold tier: head g's hot slots (a merged slot with log(1 + merged) added
// under proportional attention, as the attention adds it) and the turn's own keys up to the
// query's row (rows r0 .. of this pass; earlier passes of the turn are hot already). Query r is
// qs[r * hd], of window row r_first + r / group; hot_log_sum_exp fills lse[r] for r in [r0, r1).
struct HotLse {
  const KvLayer* layer = nullptr;
  int g = 0, hd = 0, kv_dim = 0, group = 0, r0 = 0, r_first = 0;
  float scale = 1.0f;
  bool mass = false;
  const float* k = nullptr;  // the pass's keys [rows, kv_dim], or null (a layer that reads
                             // another's slots appends none)
};

void hot_log_sum_exp(const HotLse& a, const float* qs, int r0, int r1, float* lse);

class ColdTier {
 public:
  ColdTier(const ColdTierConfig& cfg, const KvCacheConfig& hot);
  ~ColdTier();
  // A copy holds the same slots (on disk: in a file of its own).
  ColdTier(const ColdTier& o);
  ColdTier& operator=(const ColdTier& o);

  // On disk: records a head stages in memory before they go to the file as one extent.
  static constexpr int64_t kFlushRecords = 64;
  // On disk: whether its file could be created (else why not). In memory: always true.
  bool ok() const;
  std::string error() const;
  // Bytes of the file on disk (live extents and garbage; 0 in memory), and slots lost to a
  // failed write or read there (evicted for good instead).
  int64_t disk_bytes() const;
  int64_t lost_slots() const { return lost_; }

  const ColdTierConfig& config() const { return cfg_; }

  // Slot j of head h of hot layer L (layer il) is evicted: kept here. Heads of different layers
  // may be taken from in parallel; one layer's heads from one thread.
  void take(int il, const KvLayer& L, int h, int j);

  // Scores head h's cold slots of layer il by the queries q ([n_q, head_dim] floats in the hot
  // storage's space, `scale` the attention scale), takes the best `count` out of the tier and
  // returns them in position order. Different heads may be recalled in parallel; the caller
  // counts what came back (note_recalled).
  // recall_ranking=whole: lse_hot[r] is query r's log-sum-exp over the slots outside the tier
  // (null for the other rankings).
  void recall(int il, int h, const float* q, int n_q, float scale, int count, ColdRecall& out,
              const float* lse_hot = nullptr);

  int64_t n_slots(int il, int h) const { return head(il, h).n(); }
  int64_t total_slots() const;
  size_t rows_bytes() const;  // key and value rows held
  size_t meta_bytes() const;  // positions, scores, merge counts
  size_t bytes() const { return rows_bytes() + meta_bytes(); }

  // Counters: slots recalled, turns that recalled, seconds spent recalling (scoring + moving).
  int64_t recalled_slots() const { return recalled_; }
  int64_t recall_turns() const { return turns_; }
  double recall_seconds() const { return recall_s_; }
  void add_recall_seconds(double s) { recall_s_ += s; }
  void note_recalled(int64_t slots) { recalled_ += slots; }
  // A turn ended: counted; on disk, the file is rewritten without its garbage once that is more
  // than what it holds live (recalls rewrite each head's slots as one new extent).
  void note_turn();
  // What was recalled since the last call (a server's counters take it when a turn ends).
  struct Counts {
    int64_t turns = 0, slots = 0;
    double seconds = 0;
  };
  Counts take_unreported() {
    Counts c{turns_ - reported_.turns, recalled_ - reported_.slots, recall_s_ - reported_.seconds};
    reported_ = {turns_, recalled_, recall_s_};
    return c;
  }
  // Set while a pass recalls; read (and cleared) by the compaction that ends the pass.
  bool recalled_in_pass = false;

  void clear();

  // A head's slots as stored, for session files: positions, scores, merge counts, and rows in the
  // tier's storage type (key_row_bytes() / value_row_bytes() each).
  struct HeadView {
    int64_t n = 0;
    const int32_t* pos = nullptr;
    const float* score = nullptr;
    const int32_t* merged = nullptr;
    const uint8_t* k = nullptr;
    const uint8_t* v = nullptr;
  };
  HeadView view(int il, int h) const;
  size_t key_row_bytes() const { return krb_; }
  size_t value_row_bytes() const { return vrb_; }
  // Head h of layer il becomes n slots read back from a session file (whose reader checked them).
  void restore_head(int il, int h, int64_t n, const int32_t* pos, const float* score,
                    const int32_t* merged, const uint8_t* k, const uint8_t* v);

 private:
  // A head's slots: in memory, all of them; on disk, the extents written (each n records, stored
  // column by column: positions, scores, merge counts, key rows, value rows) and then the staging
  // tail in the vectors, in order of arrival.
  struct Extent {
    int64_t offset = 0, n = 0;
  };
  struct Head {
    std::vector<int32_t> pos, merged;
    std::vector<float> score;
    std::vector<uint8_t> k, v;
    std::vector<Extent> ext;
    int64_t n_disk = 0;
    int64_t n_tail() const { return static_cast<int64_t>(pos.size()); }
    int64_t n() const { return n_tail() + n_disk; }
  };
  bool on_disk() const { return cfg_.place == ColdPlace::kDisk; }

  // recall() in steps: begin (reads the head), score (the queries' logits over the cold keys),
  // end (ranks, takes the slots out). A job refers to itself: it must not move in between.
  struct RecallJob {
    int il = 0, h = 0, n_q = 0, count = 0;
    bool scored = false, read_ok = true;
    Head read;                  // on disk: the head read whole
    Head* hd = nullptr;         // the head recalled from (itself, or `read`)
    std::vector<float> qt;      // [n_q, head_dim] queries in the tier's key space
    std::vector<float> logits;  // [n_q, n] scaled q . k
  };
  void begin_recall(int il, int h, const float* q, int n_q, int count, RecallJob& job);
  void score_recall(RecallJob& job, float scale) const;
  void end_recall(RecallJob& job, ColdRecall& out, const float* lse_hot);
  // Head (il, h) whole, in memory: the head itself, or `scratch` filled from its extents and
  // tail (false: a read failed; the head's disk part is lost then).
  Head& whole(int il, int h, Head& scratch, bool* ok);
  // The job's `count` slots that its scored queries recall, as indices into its head in position
  // order (scratch of its own: heads are ranked in parallel); frees the job's logits.
  void rank(RecallJob& job, const float* lse_hot, std::vector<int32_t>& order) const;
  // On disk: `all` (a head read whole and edited) becomes head hd's only extent.
  void store_whole(Head& hd, Head& all);
  void flush(Head& hd);
  Extent write_extent(const Head& from, size_t first, size_t n);
  bool read_extent(const Extent& e, Head& into) const;  // from file_
  bool read_extent(const ColdFile& f, const Extent& e, Head& into) const;
  // Appends head hd's slots, extents (from f) then tail, to `into`; false if a read failed (the
  // extents that could be read are there).
  bool read_whole(const ColdFile& f, const Head& hd, Head& into) const;
  Head& head(int il, int h) { return heads_[static_cast<size_t>(il) * n_head_kv_ + h]; }
  const Head& head(int il, int h) const {
    return heads_[static_cast<size_t>(il) * n_head_kv_ + h];
  }
  void drop_oldest(Head& hd, int64_t n);
  // A row from storage space `from_rot` to the tier's (or back): the rotation is its own inverse.
  void convert(float* row, bool from_rot, bool to_rot, bool key) const;

  ColdTierConfig cfg_;
  KvType hot_type_;
  int n_head_kv_ = 0, head_dim_ = 0;
  size_t krb_ = 0, vrb_ = 0;  // the tier's row bytes
  std::vector<Head> heads_;   // [n_layer, n_head_kv]
  std::unique_ptr<ColdFile> file_;  // on disk only
  mutable Head view_;               // view()'s head read whole
  mutable std::atomic<int64_t> lost_{0};
  int64_t recalled_ = 0, turns_ = 0;
  double recall_s_ = 0;
  Counts reported_;
};

}  // namespace d2o
