#include "kv/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "kv/attention_kernels.h"
#include "ops/quant.h"

namespace d2o {

const char* score_agg_name(ScoreAgg a) {
  switch (a) {
    case ScoreAgg::kSum:
      return "sum";
    case ScoreAgg::kMean:
      return "mean";
    case ScoreAgg::kMax:
      return "max";
  }
  return "?";
}

namespace {

constexpr int QB = AttnScratch::kQueryBlock;
constexpr int TC = AttnScratch::kTile;

template <class T>
void grow(AlignedBuffer<T>& b, size_t n) {
  if (b.size() < n) b.resize(n);
}

}  // namespace

void AttnScratch::ensure(const Shape& s) {
  const int grp = s.n_head / s.n_head_kv;
  // Grow the slot capacity geometrically so a growing context reallocates O(log n) times.
  if (s.n_slot > n_slot_cap) {
    n_slot_cap = std::max(s.n_slot, n_slot_cap + n_slot_cap / 2);
    n_slot_cap = (n_slot_cap + TC - 1) / TC * TC;
  }
  n_tiles_cap = n_slot_cap / TC;
  const size_t cap = static_cast<size_t>(n_slot_cap), tiles = static_cast<size_t>(n_tiles_cap);
  const size_t hd = static_cast<size_t>(s.head_dim);
  const int n_blocks = (s.n_tok + QB - 1) / QB;
  if (s.split_chunks) {
    const size_t rows = static_cast<size_t>(s.n_tok) * static_cast<size_t>(s.n_head);
    rows_cap = std::max(rows_cap, static_cast<int>(rows));
    const size_t rc = static_cast<size_t>(rows_cap);
    grow(e_all, rc * cap);
    grow(part_m, tiles * rc);
    grow(part_l, tiles * rc);
    grow(part_acc, tiles * rc * hd);
    grow(row_max, rc);
    grow(row_inv, rc);
  } else if (s.stats) {
    n_blocks_cap = std::max(n_blocks_cap, n_blocks);
    const size_t cols = static_cast<size_t>(n_blocks_cap) * static_cast<size_t>(s.n_head_kv) * cap;
    grow(col_score, cols);
    grow(col_window, cols);
  }
  if (threads.size() < static_cast<size_t>(s.n_threads))
    threads.resize(static_cast<size_t>(s.n_threads));
  const size_t rows = static_cast<size_t>(QB) * static_cast<size_t>(grp);
  const size_t stride = s.stats && !s.split_chunks ? cap : static_cast<size_t>(TC);
  e_stride = std::max(e_stride, stride);
  for (Thread& t : threads) {
    grow(t.e, rows * e_stride);
    grow(t.m_chunk, rows * tiles);
    grow(t.f, rows);
    grow(t.kf, static_cast<size_t>(TC) * hd);
    grow(t.vf, static_cast<size_t>(TC) * hd);
    grow(t.acc, rows * hd);
    grow(t.o, rows * hd);
    grow(t.m, rows);
    grow(t.l, rows);
    grow(t.cm, rows);
    grow(t.cl, rows);
  }
}

void attention_forward(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats,
                       ThreadPool& pool, AttnScratch& sc) {
  attention_forward_isa(in, L, stats, pool, sc, best_kernel_isa());
}

namespace {

// Everything about one call that the tasks share.
struct Call {
  const AttnInput* in;
  KvLayer* L;
  const attn::Kernels* kern;
  AttnScratch* sc;
  KernelIsa isa;
  int H, G, grp, hd, n_tok, n_blocks;
  int n_old_all;          // slots before the chunk when every head holds the same count
  const int32_t* head_n;  // else [G] per-head counts (KvLayer::head_counts)
  bool want_score, want_window, mass, window_max;
  int window_first;
  ScoreAgg agg;
  int window;  // > 0: sliding window of this many positions (AttnInput::window)
  // AttnProbe armed for this call: [G * hd] vectors, formed[g] for the heads to form, and the
  // output [G * n_slot]; null when none.
  const float* probe_key = nullptr;
  const uint8_t* probe_on = nullptr;
  float* probe_dot = nullptr;

  // KV head g's slots before the chunk (the chunk's are the last n_tok of every head).
  int n_old(int g) const { return head_n ? head_n[g] - n_tok : n_old_all; }
  // First slot query t sees (the chunk's slots hold consecutive positions: see AttnInput).
  int lo(int g, int t) const { return window > 0 ? std::max(0, n_old(g) + t + 1 - window) : 0; }

  int t0(int blk) const { return blk * QB; }
  int nb(int blk) const { return std::min(n_tok, (blk + 1) * QB) - blk * QB; }
  // Slots of KV head g visible to the block's last query.
  int n_vis(int blk, int g) const { return n_old(g) + std::min(n_tok, (blk + 1) * QB); }
  int n_chunks(int blk, int g) const { return (n_vis(blk, g) + TC - 1) / TC; }
  int window_from(int blk) const { return std::max(0, window_first - t0(blk)); }
  bool block_in_window(int blk) const { return want_window && window_from(blk) < nb(blk); }
  // Query row r (= b * grp + hh) of (blk, g): global row index t * H + h.
  size_t row_index(int blk, int g, int r) const {
    return static_cast<size_t>(t0(blk) + r / grp) * H + static_cast<size_t>(g * grp + r % grp);
  }
};

// The kernels read every storage type directly, converting as they load (few rows: decoding
// reads each key once per query head of the group). When many rows share a chunk, its F16 or
// Q8_0 / Q4_0 rows are first converted into `buf` (one chunk, never the whole cache) with the
// call's instruction-set level. The copies hold the values the kernels would compute on the fly,
// so results do not depend on it.
void to_f32_tile(const Call& C, int rows, int n_keys, attn::KvRows& r, float* buf) {
  const bool quant = kv_quantized(r.type);
  if (r.type == KvElemType::kF32 || rows <= 4) return;
  const int64_t n = int64_t{n_keys} * C.hd;
  // Rows in order are converted in one call; rows through the row map one row per call.
  const int n_conv = r.idx ? n_keys : 1;
  const int64_t n_row = r.idx ? C.hd : n;
  for (int j = 0; j < n_conv; ++j) {
    float* out = buf + static_cast<size_t>(j) * static_cast<size_t>(n_row);
    if (quant) {
      dequantize_row_isa(C.isa, kv_ggml_type(r.type), r.row(j), out, n_row);
    } else {
      fp16_to_fp32_row_isa(C.isa, reinterpret_cast<const uint16_t*>(r.row(j)), out, n_row);
    }
  }
  // (No prefetch hint: the values are converted before the keys are scored.)
  r = {reinterpret_cast<const uint8_t*>(buf), sizeof(float) * static_cast<size_t>(C.hd),
       KvElemType::kF32};
}

// One chunk of the rows of (block, KV head g): e = exp(s - m_chunk) (scores first), per-row chunk
// maxima cm and sums cl, and partial outputs acc = sum e v. `conv` holds F32 copies of the chunk
// (to_f32_tile).
void chunk_partials(const Call& C, int blk, int g, int c, float* const* e, float* cm, float* cl,
                    float* const* acc, AttnScratch::Thread& conv) {
  const KvLayer& L = *C.L;
  const int t0 = C.t0(blk), nb = C.nb(blk), rows = nb * C.grp;
  const int j0 = c * TC;
  const int n_vis = C.n_vis(blk, g), n_old = C.n_old(g);
  const int n_keys = std::min(TC, n_vis - j0);
  const float* q[QB * AttnScratch::kMaxGroup];
  for (int r = 0; r < rows; ++r)
    q[r] = C.in->q + C.row_index(blk, g, r) * static_cast<size_t>(C.hd);
  attn::KvRows k{L.key_base(g), L.key_row_bytes(), L.type().k};
  attn::KvRows v{L.value_base(g), L.value_row_bytes(), L.type().v};
  // The chunk's rows through the row map, unless they lie in slot order (a cache never compacted:
  // then the kernels read one stream, as before there was a map).
  const int32_t* map = L.rows(g) + j0;
  int in_order = 0;
  while (in_order < n_keys && map[in_order] == j0 + in_order) ++in_order;
  if (in_order == n_keys) {
    k.base += static_cast<size_t>(j0) * k.row_bytes;
    v.base += static_cast<size_t>(j0) * v.row_bytes;
  } else {
    k.idx = v.idx = map;
  }
  // A head that fits in one chunk is a short stream: fetch its values while scoring its keys
  // (long heads are streamed well by the hardware; prefetching them costs more than it saves).
  if (n_vis <= TC && k.row_bytes == v.row_bytes) k.prefetch = v.base;
  to_f32_tile(C, rows, n_keys, k, conv.kf.data());
  to_f32_tile(C, rows, n_keys, v, conv.vf.data());
  if (C.probe_key && C.probe_on[g]) {
    // One more row: the probe's vector, its scores written to the probe (AttnProbe).
    const float* qp[QB * AttnScratch::kMaxGroup + 1];
    float* sp[QB * AttnScratch::kMaxGroup + 1];
    std::copy(q, q + rows, qp);
    std::copy(e, e + rows, sp);
    qp[rows] = C.probe_key + static_cast<size_t>(g) * C.hd;
    sp[rows] = C.probe_dot + static_cast<size_t>(g) * C.L->n_slot() + j0;
    C.kern->scores(qp, rows + 1, k, n_keys, C.hd, C.in->scale, sp);
  } else {
    C.kern->scores(q, rows, k, n_keys, C.hd, C.in->scale, e);
  }
  if (C.mass) {
    // Proportional attention: slots that merged tokens count once per token they stand for.
    const int32_t* merged = L.merged(g) + j0;
    for (int j = 0; j < n_keys; ++j) {
      if (merged[j] <= 0) continue;
      const float b = std::log1p(static_cast<float>(merged[j]));
      for (int r = 0; r < rows; ++r) e[r][j] += b;
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int n_valid = std::clamp(n_old + t0 + r / C.grp + 1 - j0, 0, n_keys);
    // Sliding window: the row sees slots [lo, ...) only; the chunk's keys below lo are masked
    // (the sum runs over the visible part alone, so masked keys are exact zeros).
    const int n_lo = C.window > 0 ? std::clamp(C.lo(g, t0 + r / C.grp) - j0, 0, n_valid) : 0;
    cm[r] = C.kern->max(e[r] + n_lo, n_valid - n_lo);
    cl[r] = C.kern->exp_sum(e[r] + n_lo, n_valid - n_lo, n_keys - n_lo, cm[r]);
    std::fill_n(e[r], n_lo, 0.0f);
  }
  C.kern->pv(e, rows, v, n_keys, C.hd, acc);
}

// Merges chunk c's partials (cm, cl, acc) into a row's running max m, sum l and output o, in
// chunk order; chunk 0 initialises them. A chunk the row sees nothing of (cm = -inf: past the
// causal limit, or before a sliding window) leaves them unchanged.
inline void merge_chunk(const attn::Kernels& kern, int c, float cm, float cl, const float* acc,
                        float& m, float& l, float* o, int hd) {
  if (c == 0) {
    m = cm;
    l = cl;
    std::memcpy(o, acc, sizeof(float) * static_cast<size_t>(hd));
    return;
  }
  if (cm == -INFINITY) return;  // the row sees nothing of this chunk (o * 1 + acc * 0 == o)
  if (m == -INFINITY) {         // nor of any earlier one (a sliding window's first chunks)
    m = cm;
    l = cl;
    std::memcpy(o, acc, sizeof(float) * static_cast<size_t>(hd));
    return;
  }
  const float mn = std::max(m, cm);
  const float a = std::exp(m - mn);
  const float b = std::exp(cm - mn);
  l = l * a + cl * b;
  kern.rescale_add(o, acc, a, b, hd);
  m = mn;
}

// Probability factor of a chunk's e values: exp(m_chunk - m_row) / l_row.
inline float stats_factor(float m_chunk, float m_row, float inv_l) {
  return std::exp(m_chunk - m_row) * inv_l;
}

// One task per (KV head, block of queries): sweeps the block's chunks in order, merging as it
// goes; with statistics, keeps the block's e values and forms its column sums.
void run_blocks(const Call& C, ThreadPool& pool) {
  AttnScratch& sc = *C.sc;
  const bool stats = C.want_score || C.want_window;
  const size_t cap = static_cast<size_t>(sc.n_slot_cap);
  const size_t hd = static_cast<size_t>(C.hd);
  // Later blocks see more slots: they go first so the last tasks are the short ones.
  pool.run(int64_t{C.n_blocks} * C.G, [&](int64_t task, int thread) {
    const int blk = C.n_blocks - 1 - static_cast<int>(task / C.G);
    const int g = static_cast<int>(task % C.G);
    AttnScratch::Thread& T = sc.threads[static_cast<size_t>(thread)];
    const int rows = C.nb(blk) * C.grp, n_ch = C.n_chunks(blk, g);
    const size_t tiles = static_cast<size_t>(sc.n_tiles_cap);
    float* e[QB * AttnScratch::kMaxGroup];
    float* acc[QB * AttnScratch::kMaxGroup];
    for (int r = 0; r < rows; ++r) acc[r] = T.acc.data() + static_cast<size_t>(r) * hd;
    for (int c = 0; c < n_ch; ++c) {
      const size_t off = stats ? static_cast<size_t>(c) * TC : 0;
      for (int r = 0; r < rows; ++r) e[r] = T.e.data() + static_cast<size_t>(r) * sc.e_stride + off;
      chunk_partials(C, blk, g, c, e, T.cm.data(), T.cl.data(), acc, T);
      for (int r = 0; r < rows; ++r) {
        merge_chunk(*C.kern, c, T.cm[r], T.cl[r], acc[r], T.m[r], T.l[r],
                    T.o.data() + static_cast<size_t>(r) * hd, C.hd);
        if (stats) T.m_chunk[static_cast<size_t>(r) * tiles + static_cast<size_t>(c)] = T.cm[r];
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float inv = 1.0f / T.l[r];
      T.l[r] = inv;
      const float* o = T.o.data() + static_cast<size_t>(r) * hd;
      float* out = C.in->out + C.row_index(blk, g, r) * hd;
      for (size_t d = 0; d < hd; ++d) out[d] = o[d] * inv;
    }
    if (!stats) return;
    // Column sums of this block over its visible slots, added to the cache in block order later.
    // A single block (decoding) adds them straight to the cache: 0 + col == col, so the bits are
    // those of the two-step sum.
    const int n_vis = C.n_vis(blk, g);
    float* col_s = nullptr;
    float* col_w = nullptr;
    if (C.n_blocks == 1) {
      col_s = C.L->score_accum(g);
      col_w = C.L->window_accum(g);
    } else {
      col_s = sc.col_score.data() + (static_cast<size_t>(blk) * C.G + g) * cap;
      col_w = sc.col_window.data() + (static_cast<size_t>(blk) * C.G + g) * cap;
      if (C.want_score) std::fill_n(col_s, n_vis, 0.0f);
      if (C.block_in_window(blk)) std::fill_n(col_w, n_vis, 0.0f);
    }
    for (int c = 0; c < n_ch; ++c) {
      const int j0 = c * TC;
      for (int r = 0; r < rows; ++r) {
        e[r] = T.e.data() + static_cast<size_t>(r) * sc.e_stride + j0;
        T.f[r] = stats_factor(T.m_chunk[static_cast<size_t>(r) * tiles + static_cast<size_t>(c)],
                              T.m[r], T.l[r]);
      }
      attn::StatsArgs a;
      a.p = e;
      a.f = T.f.data();
      a.nb = C.nb(blk);
      a.grp = C.grp;
      a.agg = static_cast<int>(C.agg);
      a.n_cols = std::min(TC, n_vis - j0);
      a.score = C.want_score ? col_s + j0 : nullptr;
      a.window = C.block_in_window(blk) ? col_w + j0 : nullptr;
      a.window_from = C.window_from(blk);
      a.window_max = C.window_max;
      C.kern->stats(a);
    }
  });
  if (!stats || C.n_blocks == 1) return;
  // Add the blocks' column sums in block order, each slot tile owned by one task.
  KvLayer& L = *C.L;
  const int n_tiles = (L.n_slot() + TC - 1) / TC;
  pool.run(int64_t{C.G} * n_tiles, [&](int64_t task, int) {
    const int g = static_cast<int>(task / n_tiles);
    const int j0 = static_cast<int>(task % n_tiles) * TC;
    for (int blk = 0; blk < C.n_blocks; ++blk) {
      const int j1 = std::min(j0 + TC, C.n_vis(blk, g));
      const size_t base = (static_cast<size_t>(blk) * C.G + g) * cap;
      if (C.want_score) {
        float* s = L.score_accum(g);
        const float* col = sc.col_score.data() + base;
        for (int j = j0; j < j1; ++j) s[j] += col[j];
      }
      if (C.block_in_window(blk)) {
        float* w = L.window_accum(g);
        const float* col = sc.col_window.data() + base;
        if (C.window_max) {
          for (int j = j0; j < j1; ++j) w[j] = std::max(w[j], col[j]);
        } else {
          for (int j = j0; j < j1; ++j) w[j] += col[j];
        }
      }
    }
  });
}

// GCC 12 cannot see that the row-pointer arrays below are filled for every row a callee reads.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// One task per (block, KV head, chunk): partials are stored, merged per row afterwards in chunk
// order; statistics run per (KV head, chunk), blocks in order.
void run_split(const Call& C, ThreadPool& pool) {
  AttnScratch& sc = *C.sc;
  const size_t cap = static_cast<size_t>(sc.n_slot_cap);
  const size_t rc = static_cast<size_t>(sc.rows_cap);
  const size_t hd = static_cast<size_t>(C.hd);
  // Tasks in (block, KV head, chunk) order; a head's chunks depend on its slot count.
  int64_t n_tasks = 0;
  for (int blk = 0; blk < C.n_blocks; ++blk)
    for (int g = 0; g < C.G; ++g) n_tasks += C.n_chunks(blk, g);
  pool.run(n_tasks, [&](int64_t task, int thread) {
    int blk = 0, g = 0;
    while (task >= C.n_chunks(blk, g)) {
      task -= C.n_chunks(blk, g);
      if (++g == C.G) {
        g = 0;
        ++blk;
      }
    }
    const int c = static_cast<int>(task);
    const int rows = C.nb(blk) * C.grp;
    float* e[QB * AttnScratch::kMaxGroup];
    float* acc[QB * AttnScratch::kMaxGroup];
    float cm[QB * AttnScratch::kMaxGroup], cl[QB * AttnScratch::kMaxGroup];
    for (int r = 0; r < rows; ++r) {
      const size_t row = C.row_index(blk, g, r);
      e[r] = sc.e_all.data() + row * cap + static_cast<size_t>(c) * TC;
      acc[r] = sc.part_acc.data() + (static_cast<size_t>(c) * rc + row) * hd;
    }
    chunk_partials(C, blk, g, c, e, cm, cl, acc, sc.threads[static_cast<size_t>(thread)]);
    for (int r = 0; r < rows; ++r) {
      const size_t row = C.row_index(blk, g, r);
      sc.part_m[static_cast<size_t>(c) * rc + row] = cm[r];
      sc.part_l[static_cast<size_t>(c) * rc + row] = cl[r];
    }
  });
  // Merge per row, in chunk order (few rows: this is cheap next to the chunks).
  float* o = sc.threads[0].o.data();
  for (int blk = 0; blk < C.n_blocks; ++blk) {
    for (int t = C.t0(blk); t < C.t0(blk) + C.nb(blk); ++t) {
      for (int h = 0; h < C.H; ++h) {
        const int n_ch = C.n_chunks(blk, h / C.grp);
        const size_t row = static_cast<size_t>(t) * C.H + static_cast<size_t>(h);
        float m = 0, l = 0;
        for (int c = 0; c < n_ch; ++c) {
          const size_t pi = static_cast<size_t>(c) * rc + row;
          merge_chunk(*C.kern, c, sc.part_m[pi], sc.part_l[pi], sc.part_acc.data() + pi * hd, m, l,
                      o, C.hd);
        }
        const float inv = 1.0f / l;
        sc.row_max[row] = m;
        sc.row_inv[row] = inv;
        float* out = C.in->out + row * hd;
        for (size_t d = 0; d < hd; ++d) out[d] = o[d] * inv;
      }
    }
  }
  if (!C.want_score && !C.want_window) return;
  int n_ch_all = 0;
  for (int g = 0; g < C.G; ++g) n_ch_all = std::max(n_ch_all, C.n_chunks(C.n_blocks - 1, g));
  KvLayer& L = *C.L;
  pool.run(int64_t{C.G} * n_ch_all, [&](int64_t task, int) {
    const int g = static_cast<int>(task / n_ch_all), c = static_cast<int>(task % n_ch_all);
    const int j0 = c * TC;
    const float* p[QB * AttnScratch::kMaxGroup];
    float f[QB * AttnScratch::kMaxGroup];
    for (int blk = 0; blk < C.n_blocks; ++blk) {
      if (c >= C.n_chunks(blk, g)) continue;
      const int rows = C.nb(blk) * C.grp;
      for (int r = 0; r < rows; ++r) {
        const size_t row = C.row_index(blk, g, r);
        p[r] = sc.e_all.data() + row * cap + static_cast<size_t>(j0);
        f[r] = stats_factor(sc.part_m[static_cast<size_t>(c) * rc + row], sc.row_max[row],
                            sc.row_inv[row]);
      }
      attn::StatsArgs a;
      a.p = p;
      a.f = f;
      a.nb = C.nb(blk);
      a.grp = C.grp;
      a.agg = static_cast<int>(C.agg);
      a.n_cols = std::min(TC, C.n_vis(blk, g) - j0);
      a.score = C.want_score ? L.score_accum(g) + j0 : nullptr;
      a.window = C.block_in_window(blk) ? L.window_accum(g) + j0 : nullptr;
      a.window_from = C.window_from(blk);
      a.window_max = C.window_max;
      C.kern->stats(a);
    }
  });
}

#pragma GCC diagnostic pop

// The probe of a one-token pass over a layer whose heads hold the same count, when armed for this
// layer and the scale is a power of two (AttnProbe).
void arm_probe(const AttnStatsRequest& stats, Call& C) {
  AttnProbe* P = stats.probe;
  if (!P) return;
  P->dot_layer = -1;
  const size_t base = static_cast<size_t>(stats.layer) * static_cast<size_t>(C.G);
  int exp2 = 0;
  if (stats.layer < 0 || C.n_tok != 1 || C.head_n || C.window > 0 || P->n_head_kv != C.G ||
      P->slot.size() < base + static_cast<size_t>(C.G) || std::frexp(C.in->scale, &exp2) != 0.5f)
    return;
  const int n = C.L->n_slot();
  const size_t hd = static_cast<size_t>(C.hd);
  P->formed.assign(static_cast<size_t>(C.G), 0);
  P->key.resize(static_cast<size_t>(C.G) * hd);
  bool any = false;
  for (int g = 0; g < C.G; ++g) {
    const int32_t s = P->slot[base + static_cast<size_t>(g)];
    if (s < 0 || s >= n) continue;
    C.L->load_key(g, s, P->key.data() + static_cast<size_t>(g) * hd);
    P->formed[static_cast<size_t>(g)] = 1;
    any = true;
  }
  if (!any) return;
  const size_t need = static_cast<size_t>(C.G) * static_cast<size_t>(n);
  if (P->dot.size() < need) P->dot.resize(need);
  P->dot_layer = stats.layer;
  P->dot_n = n;
  P->dot_scale = C.in->scale;
  C.probe_key = P->key.data();
  C.probe_on = P->formed.data();
  C.probe_dot = P->dot.data();
}

}  // namespace

void attention_forward_isa(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats,
                           ThreadPool& pool, AttnScratch& sc, KernelIsa isa) {
  const int n_tok = in.n_tok;
  const int H = in.n_head;
  const int G = L.n_head_kv();
  D2O_ASSERT(n_tok >= 1 && H % G == 0);
  for (int g = 0; g < G; ++g) D2O_ASSERT(n_tok <= L.n_slot(g));
  D2O_ASSERT(H / G <= AttnScratch::kMaxGroup);
  Call C;
  C.in = &in;
  C.L = &L;
  C.kern = &attn::kernels_for(isa);
  C.sc = &sc;
  C.isa = isa;
  C.H = H;
  C.G = G;
  C.grp = H / G;
  C.hd = L.head_dim();
  C.n_tok = n_tok;
  C.n_old_all = L.n_slot() - n_tok;
  C.head_n = L.head_counts();
  C.n_blocks = (n_tok + QB - 1) / QB;
  C.want_score = stats.accumulate;
  C.want_window = stats.window_first < n_tok;
  if (C.want_window) L.open_window_stats();
  C.window_first = stats.window_first;
  C.window_max = stats.window_max;
  C.mass = stats.mass;
  C.agg = stats.agg;
  C.window = in.window;
  arm_probe(stats, C);
  // Per-block tasks keep every thread busy once there are enough of them; otherwise (decoding)
  // chunks of one block are shared out. Both give the same results.
  AttnScratch::Shape shape;
  shape.n_threads = pool.n_threads();
  shape.n_head = H;
  shape.n_head_kv = G;
  shape.head_dim = C.hd;
  shape.n_slot = L.n_slot();
  shape.n_tok = n_tok;
  shape.split_chunks =
      pool.n_threads() > 1 && int64_t{C.n_blocks} * G < 2 * int64_t{pool.n_threads()};
  shape.stats = C.want_score || C.want_window;
  sc.ensure(shape);
  if (shape.split_chunks) {
    run_split(C, pool);
  } else {
    run_blocks(C, pool);
  }
}

void attention_reference(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats) {
  const int H = in.n_head;
  const int G = L.n_head_kv();
  if (stats.window_first < in.n_tok) L.open_window_stats();
  const int grp = H / G;
  const int hd = L.head_dim();
  std::vector<float> k(static_cast<size_t>(hd)), v(static_cast<size_t>(hd));
  std::vector<double> p(static_cast<size_t>(L.n_slot()));
  // probs[t][h][j] kept to aggregate per group afterwards.
  std::vector<std::vector<double>> probs(static_cast<size_t>(H));
  for (int t = 0; t < in.n_tok; ++t) {
    for (int h = 0; h < H; ++h) {
      const int g = h / grp;
      const int n_vis = L.n_slot(g) - in.n_tok + t + 1;  // KV head g's old slots, then the chunk's
      const int lo = in.window > 0 ? std::max(0, n_vis - in.window) : 0;
      const float* q = in.q + (static_cast<size_t>(t) * H + h) * hd;
      double m = -INFINITY;
      std::fill(p.begin(), p.begin() + lo, 0.0);
      for (int j = lo; j < n_vis; ++j) {
        L.load_key(g, j, k.data());
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * k[static_cast<size_t>(d)];
        p[static_cast<size_t>(j)] = s * in.scale;
        if (stats.mass) p[static_cast<size_t>(j)] += std::log1p(L.merged(g)[j]);
        m = std::max(m, p[static_cast<size_t>(j)]);
      }
      double sum = 0.0;
      for (int j = lo; j < n_vis; ++j)
        sum += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - m));
      std::vector<double> o(static_cast<size_t>(hd), 0.0);
      for (int j = lo; j < n_vis; ++j) {
        p[static_cast<size_t>(j)] /= sum;
        L.load_value(g, j, v.data());
        for (int d = 0; d < hd; ++d)
          o[static_cast<size_t>(d)] += p[static_cast<size_t>(j)] * v[static_cast<size_t>(d)];
      }
      float* out = in.out + (static_cast<size_t>(t) * H + h) * hd;
      for (int d = 0; d < hd; ++d) out[d] = static_cast<float>(o[static_cast<size_t>(d)]);
      probs[static_cast<size_t>(h)].assign(p.begin(), p.begin() + n_vis);
    }
    for (int g = 0; g < G; ++g) {
      const int n_vis = L.n_slot(g) - in.n_tok + t + 1;
      for (int j = 0; j < n_vis; ++j) {
        double a = 0.0;
        for (int hh = 0; hh < grp; ++hh) {
          const double x = probs[static_cast<size_t>(g * grp + hh)][static_cast<size_t>(j)];
          a = stats.agg == ScoreAgg::kMax ? (hh == 0 ? x : std::max(a, x)) : a + x;
        }
        if (stats.agg == ScoreAgg::kMean) a /= grp;
        if (stats.accumulate) L.score_accum(g)[j] += static_cast<float>(a);
        if (t >= stats.window_first) {
          float& w = L.window_accum(g)[j];
          w = stats.window_max ? std::max(w, static_cast<float>(a)) : w + static_cast<float>(a);
        }
      }
    }
  }
}

}  // namespace d2o
