#include "kv/cold_tier.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/assert.h"
#include "kv/cold_file.h"
#include "kv/kv_rotation.h"
#include "kv/policy.h"
#include "kv/policy/similarity.h"
#include "ops/hadamard.h"
#include "ops/ops.h"

namespace d2o {

namespace {

// Removes the entries of `v` (each `width` elements wide) whose index is marked in `gone`.
template <class T>
void erase_marked(std::vector<T>& v, const std::vector<char>& gone, size_t width) {
  size_t out = 0;
  for (size_t i = 0; i < gone.size(); ++i) {
    if (gone[i]) continue;
    if (out != i) std::memmove(v.data() + out * width, v.data() + i * width, width * sizeof(T));
    ++out;
  }
  v.resize(out * width);
}

}  // namespace

ColdTier::ColdTier(const ColdTierConfig& cfg, const KvCacheConfig& hot)
    : cfg_(cfg),
      hot_type_(hot.type),
      n_head_kv_(hot.n_head_kv),
      head_dim_(hot.head_dim),
      krb_(kv_row_bytes(cfg.type.k, hot.head_dim)),
      vrb_(kv_row_bytes(cfg.type.v, hot.head_dim)),
      heads_(static_cast<size_t>(hot.n_layer) * static_cast<size_t>(hot.n_head_kv)) {
  if (on_disk()) file_ = std::make_unique<ColdFile>();
}

ColdTier::~ColdTier() = default;

ColdTier::ColdTier(const ColdTier& o)
    : cfg_(o.cfg_),
      hot_type_(o.hot_type_),
      n_head_kv_(o.n_head_kv_),
      head_dim_(o.head_dim_),
      krb_(o.krb_),
      vrb_(o.vrb_),
      heads_(o.heads_.size()) {
  *this = o;
}

ColdTier& ColdTier::operator=(const ColdTier& o) {
  if (this == &o) return *this;
  D2O_ASSERT(o.cfg_ == cfg_ && o.heads_.size() == heads_.size());
  recalled_ = o.recalled_;
  turns_ = o.turns_;
  recall_s_ = o.recall_s_;
  reported_ = o.reported_;
  lost_ = o.lost_.load();
  recalled_in_pass = o.recalled_in_pass;
  if (!on_disk()) {
    heads_ = o.heads_;
    return *this;
  }
  // On disk: the same slots in this tier's own file.
  if (!file_) file_ = std::make_unique<ColdFile>();
  file_->clear();
  for (size_t i = 0; i < heads_.size(); ++i) {
    Head all;
    if (!o.read_whole(*o.file_, o.heads_[i], all)) lost_ += o.heads_[i].n_disk;
    heads_[i] = Head();
    store_whole(heads_[i], all);
  }
  return *this;
}

void ColdTier::note_turn() {
  ++turns_;
  if (!file_) return;
  int64_t live = 0;
  for (const Head& hd : heads_) live += hd.n_disk;
  live *= static_cast<int64_t>(12 + krb_ + vrb_);
  if (file_->size() <= 2 * live + (int64_t{1} << 20)) return;
  // Head by head into a fresh file: memory holds one head's slots at a time.
  auto fresh = std::make_unique<ColdFile>();
  if (!fresh->ok()) return;  // the old file stays as it is
  const std::unique_ptr<ColdFile> old = std::move(file_);
  file_ = std::move(fresh);
  for (Head& hd : heads_) {
    Head all;
    if (!read_whole(*old, hd, all)) lost_ += hd.n_disk;
    store_whole(hd, all);
  }
}

bool ColdTier::ok() const {
  return !on_disk() || (file_ && file_->ok());
}

std::string ColdTier::error() const {
  return ok() ? std::string() : file_ ? file_->error() : std::string("no cold tier file");
}

int64_t ColdTier::disk_bytes() const {
  return file_ ? file_->size() : 0;
}

ColdTier::Extent ColdTier::write_extent(const Head& from, size_t first, size_t n) {
  std::vector<uint8_t> buf(n * (12 + krb_ + vrb_));
  uint8_t* p = buf.data();
  auto put = [&p](const void* src, size_t bytes) {
    if (bytes) std::memcpy(p, src, bytes);
    p += bytes;
  };
  put(from.pos.data() + first, n * 4);
  put(from.score.data() + first, n * 4);
  put(from.merged.data() + first, n * 4);
  put(from.k.data() + first * krb_, n * krb_);
  put(from.v.data() + first * vrb_, n * vrb_);
  const int64_t off = file_ ? file_->append(buf.data(), buf.size()) : -1;
  if (off < 0) {
    lost_ += static_cast<int64_t>(n);
    return {0, 0};
  }
  return {off, static_cast<int64_t>(n)};
}

bool ColdTier::read_extent(const Extent& e, Head& into) const {
  return file_ && read_extent(*file_, e, into);
}

bool ColdTier::read_extent(const ColdFile& f, const Extent& e, Head& into) const {
  const size_t n = static_cast<size_t>(e.n);
  std::vector<uint8_t> buf(n * (12 + krb_ + vrb_));
  if (!f.read(e.offset, buf.data(), buf.size())) return false;
  const uint8_t* p = buf.data();
  auto take = [&p](auto& v, size_t count) {
    using T = typename std::remove_reference_t<decltype(v)>::value_type;
    const size_t at = v.size();
    v.resize(at + count);
    if (count) std::memcpy(v.data() + at, p, count * sizeof(T));
    p += count * sizeof(T);
  };
  take(into.pos, n);
  take(into.score, n);
  take(into.merged, n);
  take(into.k, n * krb_);
  take(into.v, n * vrb_);
  return true;
}

bool ColdTier::read_whole(const ColdFile& f, const Head& hd, Head& into) const {
  // Sized once for the whole head (appending extent by extent would leave up to twice that).
  const size_t n = static_cast<size_t>(hd.n()) + into.pos.size();
  into.pos.reserve(n);
  into.score.reserve(n);
  into.merged.reserve(n);
  into.k.reserve(n * krb_);
  into.v.reserve(n * vrb_);
  bool ok = true;
  for (const Extent& e : hd.ext) ok = read_extent(f, e, into) && ok;
  into.pos.insert(into.pos.end(), hd.pos.begin(), hd.pos.end());
  into.score.insert(into.score.end(), hd.score.begin(), hd.score.end());
  into.merged.insert(into.merged.end(), hd.merged.begin(), hd.merged.end());
  into.k.insert(into.k.end(), hd.k.begin(), hd.k.end());
  into.v.insert(into.v.end(), hd.v.begin(), hd.v.end());
  return ok;
}

void ColdTier::flush(Head& hd) {
  const size_t n = static_cast<size_t>(hd.n_tail());
  if (n == 0) return;
  const Extent e = write_extent(hd, 0, n);
  if (e.n > 0) {
    hd.ext.push_back(e);
    hd.n_disk += e.n;
  }
  if (n > static_cast<size_t>(kFlushRecords)) {
    // A head written whole (after a recall, a rewrite, a copy): its memory goes back, or every
    // head a turn recalled would hold its whole tier in memory again, unused, from then on.
    std::vector<int32_t>().swap(hd.pos);
    std::vector<float>().swap(hd.score);
    std::vector<int32_t>().swap(hd.merged);
    std::vector<uint8_t>().swap(hd.k);
    std::vector<uint8_t>().swap(hd.v);
    return;
  }
  hd.pos.clear();
  hd.score.clear();
  hd.merged.clear();
  hd.k.clear();
  hd.v.clear();
}

ColdTier::Head& ColdTier::whole(int il, int h, Head& scratch, bool* ok) {
  Head& hd = head(il, h);
  *ok = true;
  if (hd.ext.empty()) return hd;
  scratch = Head();
  if (!read_whole(*file_, hd, scratch)) {
    lost_ += hd.n_disk;
    *ok = false;
  }
  return scratch;
}

void ColdTier::store_whole(Head& hd, Head& all) {
  // The old extents become garbage in the file (clear() or a copy drops them).
  hd.ext.clear();
  hd.n_disk = 0;
  hd.pos = std::move(all.pos);
  hd.score = std::move(all.score);
  hd.merged = std::move(all.merged);
  hd.k = std::move(all.k);
  hd.v = std::move(all.v);
  flush(hd);
}

void ColdTier::convert(float* row, bool from_rot, bool to_rot, bool key) const {
  if (from_rot == to_rot) return;
  hadamard_blocks(row, head_dim_, key ? kv_rot_block_k(head_dim_) : kv_rot_block_v(head_dim_));
}

void ColdTier::take(int il, const KvLayer& L, int h, int j) {
  Head& hd = head(il, h);
  // One row of scratch per layer and head would do; a local row keeps layers independent.
  float row[512];
  std::vector<float> big;
  float* r = row;
  if (head_dim_ > 512) {
    big.resize(static_cast<size_t>(head_dim_));
    r = big.data();
  }
  hd.pos.push_back(L.pos(h)[j]);
  hd.score.push_back(L.score(h)[j]);
  hd.merged.push_back(L.merged(h)[j]);
  const size_t ko = hd.k.size(), vo = hd.v.size();
  hd.k.resize(ko + krb_);
  hd.v.resize(vo + vrb_);
  L.load_key(h, j, r);
  convert(r, hot_type_.rot_k, cfg_.type.rot_k, true);
  kv_store_row(cfg_.type.k, r, head_dim_, hd.k.data() + ko);
  L.load_value(h, j, r);
  convert(r, hot_type_.rot_v, cfg_.type.rot_v, false);
  kv_store_row(cfg_.type.v, r, head_dim_, hd.v.data() + vo);
  // Bounded: the oldest arrivals go, in batches (a decode step evicts one slot per head).
  const int64_t cap = cfg_.max_slots;
  if (cap > 0 && hd.n() > cap + std::max<int64_t>(16, cap / 8)) {
    Head scratch;
    bool ok = true;
    Head& all = whole(il, h, scratch, &ok);
    drop_oldest(all, all.n() - cap);
    if (&all != &hd) store_whole(hd, all);
  }
  if (on_disk() && hd.n_tail() >= kFlushRecords) flush(hd);
}

void ColdTier::drop_oldest(Head& hd, int64_t n) {
  const auto cut = [n](auto& v, size_t width) {
    v.erase(v.begin(), v.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(n) * width));
  };
  cut(hd.pos, 1);
  cut(hd.score, 1);
  cut(hd.merged, 1);
  cut(hd.k, krb_);
  cut(hd.v, vrb_);
}

namespace {

// recall_ranking=max: each slot's most log-attention from any query, l - logsumexp(l) (the
// ranking is that of the attention, and there is no exponential per slot to keep).
void max_log_attention(const float* logits, int n_q, int64_t n, std::vector<float>& best) {
  best.assign(static_cast<size_t>(n), -std::numeric_limits<float>::infinity());
  for (int r = 0; r < n_q; ++r) {
    const float* l = logits + static_cast<size_t>(r) * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, l[i]);
    float z = 0;
    for (int64_t i = 0; i < n; ++i) z += std::exp(l[i] - m);
    const float lz = m + std::log(z);
    for (int64_t i = 0; i < n; ++i) best[i] = std::max(best[i], l[i] - lz);
  }
}

}  // namespace

void ColdTier::begin_recall(int il, int h, const float* q, int n_q, int count, RecallJob& job) {
  job = RecallJob();
  job.il = il;
  job.h = h;
  job.n_q = n_q;
  job.hd = &whole(il, h, job.read, &job.read_ok);  // on disk: read whole, written back at the end
  const int64_t n = job.hd->n();
  job.count = static_cast<int>(std::min<int64_t>(count, n));
  // Every slot coming back ranks nothing; nothing to score either.
  job.scored = job.count > 0 && n_q > 0 && job.count < n;
  if (!job.scored) return;
  const int D = head_dim_;
  // The queries moved into the tier's key space instead of every cold key out of it (q.k is
  // unchanged by the rotation, which is orthonormal and its own inverse).
  job.qt.assign(q, q + static_cast<size_t>(n_q) * D);
  if (cfg_.type.rot_k != hot_type_.rot_k) {
    for (int r = 0; r < n_q; ++r)
      convert(job.qt.data() + static_cast<size_t>(r) * D, false, true, true);
  }
  job.logits.resize(static_cast<size_t>(n) * static_cast<size_t>(n_q));
}

void ColdTier::score_recall(RecallJob& job, float scale) const {
  if (!job.scored) return;
  const Head& hd = *job.hd;
  const int64_t n = hd.n();
  const int D = head_dim_;
  // Logits [n_q, n] by the SIMD dot kernels, over the cold keys as floats a tile of kKeyTile
  // rows at a time (16 KB: 64 rows at head_dim 64; the tile stays in the first-level cache while
  // every query reads it, several queries a row load): a tier that holds a long prompt's evictions
  // would otherwise need n x head_dim floats per head recalled in parallel (on Gemma 3, a 27K-token
  // prompt's cold head is 27 MB of them), at the moment the prompt's last pass recalls.
  const int64_t kKeyTile =
      std::max<int64_t>(8, (16384 / (static_cast<int64_t>(sizeof(float)) * D)) & ~7);
  std::vector<float> keys(static_cast<size_t>(std::min(n, kKeyTile)) * D);
  RowDots rd;
  rd.base = reinterpret_cast<const uint8_t*>(keys.data());
  rd.row_bytes = sizeof(float) * static_cast<size_t>(D);
  rd.dim = D;
  for (int64_t t0 = 0; t0 < n; t0 += kKeyTile) {
    const int64_t tn = std::min(kKeyTile, n - t0);
    for (int64_t i = 0; i < tn; ++i) {
      kv_load_row(cfg_.type.k, hd.k.data() + static_cast<size_t>(t0 + i) * krb_, D,
                  keys.data() + static_cast<size_t>(i) * D);
    }
    rd.n = static_cast<int>(tn);
    float* dot = job.logits.data() + t0;
    row_dots_queries(rd, job.qt.data(), static_cast<size_t>(D), job.n_q, scale, dot,
                     static_cast<size_t>(n));
  }
}

void ColdTier::rank(RecallJob& job, const float* lse_hot, std::vector<int32_t>& order) const {
  const Head& hd = *job.hd;
  const int64_t n = hd.n();
  const int n_q = job.n_q, count = job.count;
  order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  const auto by_position = [&](int32_t a, int32_t b) { return hd.pos[a] < hd.pos[b]; };
  if (!job.scored) {  // every slot comes back: nothing to rank
    std::sort(order.begin(), order.end(), by_position);
    return;
  }
  std::vector<float> attn, pooled;
  // A slot's attention from the window: each query's softmax over the cold slots, summed over
  // the queries (the sum the turn's compaction ranks hot and recalled slots by), then over its
  // `kernel` neighbours in position order (slots arrive in eviction order), so that a passage
  // comes back whole around the token its question found (recall_ranking=max: the most any
  // query gives it, the best of its neighbours).
  std::vector<float>& logits = job.logits;
  const bool sum = cfg_.ranking != RecallRanking::kMax;
  if (cfg_.ranking == RecallRanking::kWhole) {
    D2O_ASSERT(lse_hot != nullptr);
    attn.assign(static_cast<size_t>(n), 0.0f);
    for (int r = 0; r < n_q; ++r)
      softmax_add_lse(logits.data() + static_cast<size_t>(r) * n, n, lse_hot[r], attn.data());
  } else if (sum) {
    attn.assign(static_cast<size_t>(n), 0.0f);
    for (int r = 0; r < n_q; ++r)
      softmax_add(logits.data() + static_cast<size_t>(r) * n, n, attn.data());
  } else {
    max_log_attention(logits.data(), n_q, n, attn);
  }
  std::vector<float>().swap(logits);  // (a long tier's logits are large)
  std::sort(order.begin(), order.end(), by_position);
  pooled.resize(static_cast<size_t>(n));
  const int64_t half = std::max(0, cfg_.kernel / 2);
  for (int64_t x = 0; x < n; ++x) {
    float acc = sum ? 0.0f : -std::numeric_limits<float>::infinity();
    for (int64_t y = std::max<int64_t>(0, x - half); y <= std::min(n - 1, x + half); ++y)
      acc = sum ? acc + attn[order[y]] : std::max(acc, attn[order[y]]);
    pooled[order[x]] = acc;
  }
  // Best first; ties to the newer position (as the hot selectors break them).
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int32_t a, int32_t b) {
    if (pooled[a] != pooled[b]) return pooled[a] > pooled[b];
    return hd.pos[a] > hd.pos[b];
  });
  order.resize(static_cast<size_t>(count));
  std::sort(order.begin(), order.end(), by_position);
}

void ColdTier::recall(int il, int h, const float* q, int n_q, float scale, int count,
                      ColdRecall& out, const float* lse_hot) {
  RecallJob job;
  begin_recall(il, h, q, n_q, count, job);
  score_recall(job, scale);
  end_recall(job, out, lse_hot);
}

void ColdTier::end_recall(RecallJob& job, ColdRecall& out, const float* lse_hot) {
  out.clear();
  Head& stored = head(job.il, job.h);
  Head& hd = *job.hd;
  const int64_t n = hd.n();
  const int count = job.count;
  if (count <= 0 || job.n_q <= 0) {
    if (&hd != &stored && !job.read_ok) store_whole(stored, hd);  // what could be read
    return;
  }
  std::vector<int32_t> order;
  rank(job, lse_hot, order);
  const int D = head_dim_;
  out.k.resize(static_cast<size_t>(count) * D);
  out.v.resize(static_cast<size_t>(count) * D);
  std::vector<char> gone(static_cast<size_t>(n), 0);
  for (int c = 0; c < count; ++c) {
    const int32_t i = order[static_cast<size_t>(c)];
    gone[static_cast<size_t>(i)] = 1;
    out.pos.push_back(hd.pos[i]);
    out.score.push_back(hd.score[i]);
    out.merged.push_back(hd.merged[i]);
    float* k = out.k.data() + static_cast<size_t>(c) * D;
    float* v = out.v.data() + static_cast<size_t>(c) * D;
    kv_load_row(cfg_.type.k, hd.k.data() + static_cast<size_t>(i) * krb_, D, k);
    convert(k, cfg_.type.rot_k, hot_type_.rot_k, true);
    kv_load_row(cfg_.type.v, hd.v.data() + static_cast<size_t>(i) * vrb_, D, v);
    convert(v, cfg_.type.rot_v, hot_type_.rot_v, false);
  }
  erase_marked(hd.pos, gone, 1);
  erase_marked(hd.score, gone, 1);
  erase_marked(hd.merged, gone, 1);
  erase_marked(hd.k, gone, krb_);
  erase_marked(hd.v, gone, vrb_);
  if (&hd != &stored) store_whole(stored, hd);
}

int64_t ColdTier::total_slots() const {
  int64_t n = 0;
  for (const Head& hd : heads_) n += hd.n();
  return n;
}

void hot_log_sum_exp(const HotLse& a, const float* qs, int r0, int r1, float* lse) {
  const KvLayer& L = *a.layer;
  const int n = L.n_slot(a.g);
  const int last_row = a.r_first + (r1 - 1) / a.group;  // the last query's row
  const int n_turn = a.k ? last_row - a.r0 + 1 : 0;
  std::vector<float> logits(static_cast<size_t>(n + std::max(0, n_turn)));
  const KvType t = L.type();
  RowDots hot;
  hot.base = L.key_base(a.g);
  hot.row_bytes = L.key_row_bytes();
  hot.map = L.rows(a.g);
  hot.f16 = t.k == KvElemType::kF16;
  hot.quant = kv_quantized(t.k) ? kv_ggml_type(t.k) : GgmlType::kF32;
  hot.dim = a.hd;
  hot.n = n;
  hot.dot = logits.data();
  RowDots turn;
  if (a.k) {
    turn.base = reinterpret_cast<const uint8_t*>(a.k + static_cast<size_t>(a.r0) * a.kv_dim +
                                                 static_cast<size_t>(a.g) * a.hd);
    turn.row_bytes = sizeof(float) * static_cast<size_t>(a.kv_dim);
    turn.dim = a.hd;
    turn.dot = logits.data() + n;
  }
  const int32_t* merged = L.merged(a.g);
  for (int r = r0; r < r1; ++r) {
    const float* q = qs + static_cast<size_t>(r) * a.hd;
    if (n > 0) {
      hot.q = q;
      row_dots(hot);
    }
    for (int x = 0; x < n; ++x) {
      logits[static_cast<size_t>(x)] *= a.scale;
      if (a.mass && merged[x] > 0) logits[static_cast<size_t>(x)] += std::log1p(float(merged[x]));
    }
    int m = n;
    if (a.k) {
      turn.q = q;
      turn.n = a.r_first + r / a.group - a.r0 + 1;  // causal: the rows up to the query's own
      row_dots(turn);
      for (int x = 0; x < turn.n; ++x) logits[static_cast<size_t>(n + x)] *= a.scale;
      m += turn.n;
    }
    lse[r] = softmax_add_lse(logits.data(), m, -std::numeric_limits<float>::infinity(), nullptr);
  }
}

size_t ColdTier::rows_bytes() const {
  size_t b = 0;
  for (const Head& hd : heads_) b += hd.k.size() + hd.v.size();
  return b;
}

size_t ColdTier::meta_bytes() const {
  size_t b = 0;
  for (const Head& hd : heads_) {
    b += hd.pos.size() * sizeof(int32_t) + hd.score.size() * sizeof(float) +
         hd.merged.size() * sizeof(int32_t) + hd.ext.size() * sizeof(Extent);
  }
  return b;
}

ColdTier::HeadView ColdTier::view(int il, int h) const {
  const Head* hd = &head(il, h);
  if (!hd->ext.empty()) {  // on disk: read whole into view_ (valid until the next view())
    view_ = Head();
    if (!read_whole(*file_, *hd, view_)) lost_ += hd->n_disk;
    hd = &view_;
  }
  return {hd->n_tail(), hd->pos.data(), hd->score.data(), hd->merged.data(), hd->k.data(),
          hd->v.data()};
}

void ColdTier::restore_head(int il, int h, int64_t n, const int32_t* pos, const float* score,
                            const int32_t* merged, const uint8_t* k, const uint8_t* v) {
  Head& hd = head(il, h);
  const size_t c = static_cast<size_t>(n);
  hd = Head();
  hd.pos.assign(pos, pos + c);
  hd.score.assign(score, score + c);
  hd.merged.assign(merged, merged + c);
  hd.k.assign(k, k + c * krb_);
  hd.v.assign(v, v + c * vrb_);
  if (on_disk()) flush(hd);
}

void ColdTier::clear() {
  for (Head& hd : heads_) hd = Head();
  if (file_) file_->clear();
  recalled_in_pass = false;
}

size_t KvPolicy::cold_bytes(const KvCacheConfig& cfg, int64_t n_total) const {
  const ColdTierConfig c = cold_tier();
  if (!c.enabled() || n_total <= 0) return 0;
  // At most every token of a compressible layer's head, or the bound plus its slack.
  int64_t n = n_total;
  if (c.max_slots > 0) n = std::min(n, c.max_slots + std::max<int64_t>(16, c.max_slots / 8));
  const size_t per = kv_row_bytes(c.type.k, cfg.head_dim) + kv_row_bytes(c.type.v, cfg.head_dim) +
                     2 * sizeof(int32_t) + sizeof(float);
  const size_t heads = static_cast<size_t>(cfg.n_head_kv) * static_cast<size_t>(cfg.n_compressible());
  if (c.place == ColdPlace::kDisk) {
    // In memory: each head's staging tail and its extent list (an extent per flush at most).
    const int64_t tail = std::min<int64_t>(n, ColdTier::kFlushRecords);
    return heads * (static_cast<size_t>(tail) * per +
                    static_cast<size_t>(n / ColdTier::kFlushRecords + 1) * 16);
  }
  return static_cast<size_t>(n) * per * heads;
}

}  // namespace d2o
