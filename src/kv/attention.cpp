#include "kv/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "kv/attention_kernels.h"

namespace d2o {

const char* score_agg_name(ScoreAgg a) {
  switch (a) {
    case ScoreAgg::kSum: return "sum";
    case ScoreAgg::kMean: return "mean";
    case ScoreAgg::kMax: return "max";
  }
  return "?";
}

void AttnScratch::ensure(int n_threads_, int n_head_, int head_dim_, int n_slot) {
  const int tiles = (n_slot + kTile - 1) / kTile;
  if (n_threads_ <= n_threads && n_head_ <= n_head && head_dim_ <= head_dim && n_slot <= n_slot_cap &&
      tiles <= n_tiles_cap) {
    return;
  }
  n_threads = std::max(n_threads, n_threads_);
  n_head = std::max(n_head, n_head_);
  head_dim = std::max(head_dim, head_dim_);
  // Grow the slot capacity geometrically so a growing context reallocates O(log n) times.
  if (n_slot > n_slot_cap) n_slot_cap = std::max(n_slot, n_slot_cap + n_slot_cap / 2);
  n_slot_cap = (n_slot_cap + kTile - 1) / kTile * kTile;
  n_tiles_cap = n_slot_cap / kTile;
  const size_t qb = kQueryBlock, h = static_cast<size_t>(n_head), d = static_cast<size_t>(head_dim);
  scores.resize(qb * h * static_cast<size_t>(n_slot_cap));
  tile_max.resize(qb * h * static_cast<size_t>(n_tiles_cap));
  tile_sum.resize(qb * h * static_cast<size_t>(n_tiles_cap));
  partial.resize(static_cast<size_t>(n_tiles_cap) * qb * h * d);
  row_max.resize(qb * h);
  row_inv.resize(qb * h);
}

void attention_forward(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats,
                       ThreadPool& pool, AttnScratch& sc) {
  attention_forward_isa(in, L, stats, pool, sc, best_kernel_isa());
}

void attention_forward_isa(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats,
                           ThreadPool& pool, AttnScratch& sc, KernelIsa isa) {
  const attn::Kernels& kern = attn::kernels_for(isa);
  const int n_tok = in.n_tok;
  const int H = in.n_head;
  const int G = L.n_head_kv;
  D2O_ASSERT(H % G == 0 && n_tok <= L.n_slot);
  const int grp = H / G;
  D2O_ASSERT(grp <= AttnScratch::kMaxGroup);
  const int hd = L.head_dim;
  const int n_old = L.n_slot - n_tok;
  constexpr int QB = AttnScratch::kQueryBlock;
  constexpr int TC = AttnScratch::kTile;
  constexpr int R = attn::kMaxRows;
  sc.ensure(pool.n_threads(), H, hd, L.n_slot);
  const size_t cap = static_cast<size_t>(sc.n_slot_cap);
  const int ntc = sc.n_tiles_cap;
  auto rows_of = [&](int g) {
    attn::KvRows k{L.key_row(g, 0), L.row_bytes(), L.type};
    attn::KvRows v{L.value_row(g, 0), L.row_bytes(), L.type};
    return std::pair{k, v};
  };

  for (int t0 = 0; t0 < n_tok; t0 += QB) {
    const int t1 = std::min(n_tok, t0 + QB);
    const int nb = t1 - t0;
    const int n_vis = n_old + t1;  // slots visible to the block's last query
    const int n_tiles = (n_vis + TC - 1) / TC;
    const int64_t n_tasks = int64_t{G} * n_tiles;
    const int n_rows = nb * grp;  // (b, head-in-group) rows of one KV head

    // Phase 1: scores s = q k^T * scale, and each tile's maximum over the visible slots.
    pool.run(n_tasks, [&](int64_t task, int) {
      const int g = static_cast<int>(task / n_tiles);
      const int tile = static_cast<int>(task % n_tiles);
      const int j0 = tile * TC;
      const int j1 = std::min(j0 + TC, n_vis);
      attn::KvRows k = rows_of(g).first;
      k.base += static_cast<size_t>(j0) * k.row_bytes;
      const float* qp[R];
      float* sp[R];
      for (int r0 = 0; r0 < n_rows; r0 += R) {
        const int nr = std::min(R, n_rows - r0);
        for (int i = 0; i < nr; ++i) {
          const int b = (r0 + i) / grp, h = g * grp + (r0 + i) % grp;
          qp[i] = in.q + (static_cast<size_t>(t0 + b) * H + h) * hd;
          sp[i] = sc.scores.data() + (static_cast<size_t>(b) * H + h) * cap + j0;
        }
        kern.scores(qp, nr, k, j1 - j0, hd, in.scale, sp);
      }
      for (int r = 0; r < n_rows; ++r) {
        const int b = r / grp, h = g * grp + r % grp;
        const int jend = std::min(j1, n_old + t0 + b + 1);
        const float* srow = sc.scores.data() + (static_cast<size_t>(b) * H + h) * cap;
        float m = -INFINITY;
        for (int j = j0; j < jend; ++j) m = std::max(m, srow[j]);
        sc.tile_max[(static_cast<size_t>(b) * H + h) * ntc + tile] = m;
      }
    });

    // Phase 2: row maxima, in tile order.
    for (int b = 0; b < nb; ++b) {
      for (int h = 0; h < H; ++h) {
        const float* tm = sc.tile_max.data() + (static_cast<size_t>(b) * H + h) * ntc;
        float m = -INFINITY;
        for (int tile = 0; tile < n_tiles; ++tile) m = std::max(m, tm[tile]);
        sc.row_max[static_cast<size_t>(b) * H + h] = m;
      }
    }

    // Phase 3: p = exp(s - max) in place (0 where not visible), per-tile sums, p-weighted values.
    pool.run(n_tasks, [&](int64_t task, int) {
      const int g = static_cast<int>(task / n_tiles);
      const int tile = static_cast<int>(task % n_tiles);
      const int j0 = tile * TC;
      const int j1 = std::min(j0 + TC, n_vis);
      attn::KvRows v = rows_of(g).second;
      v.base += static_cast<size_t>(j0) * v.row_bytes;
      const float* pp[R];
      float* acc[R];
      for (int r0 = 0; r0 < n_rows; r0 += R) {
        const int nr = std::min(R, n_rows - r0);
        for (int i = 0; i < nr; ++i) {
          const int b = (r0 + i) / grp, h = g * grp + (r0 + i) % grp;
          const size_t rh = static_cast<size_t>(b) * H + h;
          float* srow = sc.scores.data() + rh * cap + j0;
          const int n_valid = std::max(0, std::min(j1, n_old + t0 + b + 1) - j0);
          sc.tile_sum[rh * ntc + tile] = kern.exp_sum(srow, n_valid, j1 - j0, sc.row_max[rh]);
          pp[i] = srow;
          acc[i] = sc.partial.data() + ((static_cast<size_t>(tile) * QB + b) * H + h) * hd;
        }
        kern.pv(pp, nr, v, j1 - j0, hd, acc);
      }
    });

    // Phase 4: normalise and combine the tiles, in tile order.
    for (int b = 0; b < nb; ++b) {
      for (int h = 0; h < H; ++h) {
        const float* ts = sc.tile_sum.data() + (static_cast<size_t>(b) * H + h) * ntc;
        float l = 0.0f;
        for (int tile = 0; tile < n_tiles; ++tile) l += ts[tile];
        const float inv = 1.0f / l;
        sc.row_inv[static_cast<size_t>(b) * H + h] = inv;
        float* out = in.out + (static_cast<size_t>(t0 + b) * H + h) * hd;
        std::fill(out, out + hd, 0.0f);
        for (int tile = 0; tile < n_tiles; ++tile) {
          const float* acc = sc.partial.data() + ((static_cast<size_t>(tile) * QB + b) * H + h) * hd;
          for (int d = 0; d < hd; ++d) out[d] += acc[d];
        }
        for (int d = 0; d < hd; ++d) out[d] *= inv;
      }
    }

    // Phase 5: statistics, each slot owned by one task, queries summed in order.
    const bool want_window = stats.window_first < t1;
    if (!stats.accumulate && !want_window) continue;
    pool.run(n_tasks, [&](int64_t task, int) {
      const int g = static_cast<int>(task / n_tiles);
      const int tile = static_cast<int>(task % n_tiles);
      const int j0 = tile * TC;
      const int j1 = std::min(j0 + TC, n_vis);
      const float* prow[QB * AttnScratch::kMaxGroup];
      float inv[QB * AttnScratch::kMaxGroup];
      for (int r = 0; r < n_rows; ++r) {
        const int b = r / grp, h = g * grp + r % grp;
        const size_t rh = static_cast<size_t>(b) * H + h;
        prow[r] = sc.scores.data() + rh * cap + j0;
        inv[r] = sc.row_inv[rh];
      }
      attn::StatsArgs a;
      a.p = prow;
      a.inv = inv;
      a.nb = nb;
      a.grp = grp;
      a.agg = static_cast<int>(stats.agg);
      a.n_cols = j1 - j0;
      a.score = stats.accumulate ? &L.score[L.meta_index(g, j0)] : nullptr;
      a.window = want_window ? &L.window[L.meta_index(g, j0)] : nullptr;
      a.window_from = std::max(0, stats.window_first - t0);
      kern.stats(a);
    });
  }
}

void attention_reference(const AttnInput& in, KvLayer& L, const AttnStatsRequest& stats) {
  const int H = in.n_head;
  const int G = L.n_head_kv;
  const int grp = H / G;
  const int hd = L.head_dim;
  const int n_old = L.n_slot - in.n_tok;
  std::vector<float> k(static_cast<size_t>(hd)), v(static_cast<size_t>(hd));
  std::vector<double> p(static_cast<size_t>(L.n_slot));
  // probs[t][h][j] kept to aggregate per group afterwards.
  std::vector<std::vector<double>> probs(static_cast<size_t>(H));
  for (int t = 0; t < in.n_tok; ++t) {
    const int n_vis = n_old + t + 1;
    for (int h = 0; h < H; ++h) {
      const int g = h / grp;
      const float* q = in.q + (static_cast<size_t>(t) * H + h) * hd;
      double m = -INFINITY;
      for (int j = 0; j < n_vis; ++j) {
        L.load_key(g, j, k.data());
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * k[static_cast<size_t>(d)];
        p[static_cast<size_t>(j)] = s * in.scale;
        m = std::max(m, p[static_cast<size_t>(j)]);
      }
      double sum = 0.0;
      for (int j = 0; j < n_vis; ++j) sum += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - m));
      std::vector<double> o(static_cast<size_t>(hd), 0.0);
      for (int j = 0; j < n_vis; ++j) {
        p[static_cast<size_t>(j)] /= sum;
        L.load_value(g, j, v.data());
        for (int d = 0; d < hd; ++d) o[static_cast<size_t>(d)] += p[static_cast<size_t>(j)] * v[static_cast<size_t>(d)];
      }
      float* out = in.out + (static_cast<size_t>(t) * H + h) * hd;
      for (int d = 0; d < hd; ++d) out[d] = static_cast<float>(o[static_cast<size_t>(d)]);
      probs[static_cast<size_t>(h)].assign(p.begin(), p.begin() + n_vis);
    }
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < n_vis; ++j) {
        double a = 0.0;
        for (int hh = 0; hh < grp; ++hh) {
          const double x = probs[static_cast<size_t>(g * grp + hh)][static_cast<size_t>(j)];
          a = stats.agg == ScoreAgg::kMax ? (hh == 0 ? x : std::max(a, x)) : a + x;
        }
        if (stats.agg == ScoreAgg::kMean) a /= grp;
        const size_t mi = L.meta_index(g, j);
        if (stats.accumulate) L.score[mi] += static_cast<float>(a);
        if (t >= stats.window_first) L.window[mi] += static_cast<float>(a);
      }
    }
  }
}

}  // namespace d2o
