#include "kv/policy/merge_d2o.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "core/mem.h"
#include "kv/attention_kernels.h"
#include "kv/policy/nearest.h"
#include "kv/policy/similarity.h"
#include "ops/ops.h"

namespace d2o {

namespace {

// kD2oFewEvicted: nearest_rows above it, the stored rows directly up to it.
constexpr int kManyEvicted = kD2oFewEvicted;

// Asks for slot j's key (and value) rows ahead of their use: a compaction reads them in the
// order of its slot lists, whose gaps defeat the hardware's stride prefetch.
void prefetch_rows(const KvLayer& L, int head, int j, bool keys, bool values) {
  if (keys) prefetch_bytes(L.key_row(head, j), L.key_row_bytes());
  if (values) prefetch_bytes(L.value_row(head, j), L.value_row_bytes());
}

// Cosines of one evicted row against every kept row, for one of keys/values, added (times
// `scale`) into sim[n_keep]. kept_inv[n_keep] holds 1 / |row_c| (0 for a zero row): given
// (`given`: the policy's cached key norms), or computed on first use and reused for the other
// evicted rows of the compaction.
struct ModalityPass {
  const KvLayer* layer;
  int head;
  bool values;
  const int32_t* keep;
  int n_keep;
  float* kept_inv;               // [n_keep]
  float* dots;                   // [n_keep] scratch
  float* row;                    // [head_dim] scratch
  const float* given = nullptr;  // [n_keep] 1 / |row_c| known already, or null
};

// With `best` (the last modality of the sum), also returns the first kept index of the largest
// similarity and that similarity in *best_sim, in the same pass (ties: the older kept slot).
// sim == nullptr (one modality: the sum is 0 + its cosines): only the argmax, vectorised
// (scaled_argmax), nothing stored. given_inv_e >= 0: 1 / |row_e| known already (cached norms).
int add_cosines(const ModalityPass& p, int e, bool first, float scale, float* __restrict sim,
                float* best_sim = nullptr, float given_inv_e = -1.0f) {
  const KvLayer& L = *p.layer;
  if (p.values)
    L.load_value(p.head, e, p.row);
  else
    L.load_key(p.head, e, p.row);
  float inv_e = given_inv_e;
  if (inv_e < 0.0f) {
    double ne = 0.0;
    for (int d = 0; d < L.head_dim(); ++d) ne += static_cast<double>(p.row[d]) * p.row[d];
    // Zero vectors have cosine 0 with everything.
    inv_e = ne > 0.0 ? static_cast<float>(1.0 / std::sqrt(ne)) : 0.0f;
  }
  RowDots rd;
  rd.dim = L.head_dim();
  rd.n = p.n_keep;
  rd.q = p.row;
  rd.dot = p.dots;
  rd.inv_norm = first && !p.given ? p.kept_inv : nullptr;
  rd.base = p.values ? L.value_base(p.head) : L.key_base(p.head);
  rd.map = L.rows(p.head);
  const KvElemType t = p.values ? L.type().v : L.type().k;
  rd.row_bytes = p.values ? L.value_row_bytes() : L.key_row_bytes();
  rd.f16 = t == KvElemType::kF16;
  if (kv_quantized(t)) rd.quant = kv_ggml_type(t);
  rd.rows = p.keep;
  row_dots(rd);
  const float* __restrict dots = p.dots;
  const float* __restrict inv = p.given ? p.given : p.kept_inv;
  const float f = scale * inv_e;
  if (sim == nullptr) return scaled_argmax(p.dots, inv, p.n_keep, f, best_sim);
  if (best_sim == nullptr) {
    for (int i = 0; i < p.n_keep; ++i) sim[i] += f * dots[i] * inv[i];
    return 0;
  }
  int best = 0;
  float bs = sim[0] + f * dots[0] * inv[0];
  for (int i = 1; i < p.n_keep; ++i) {
    const float s = sim[i] + f * dots[i] * inv[i];
    if (s > bs) {
      bs = s;
      best = i;
    }
  }
  *best_sim = bs;
  return best;
}

// Writes row / |row| (zeros for a zero row) times `scale` into out[hd] (unit_row). With `rope`, a
// key is first rotated back to position 0 (merge_keys=unrotated).
void load_unit(const KvLayer& L, int head, bool values, int slot, float scale, float* out,
               const RopeParams* rope) {
  const int hd = L.head_dim();
  if ((values ? L.type().v : L.type().k) == KvElemType::kF16 && !(rope && !values)) {
    const uint8_t* row = values ? L.value_row(head, slot) : L.key_row(head, slot);
    unit_row_f16(reinterpret_cast<const uint16_t*>(row), hd, scale, out);
    return;
  }
  if (values) {
    L.load_value(head, slot, out);
  } else {
    L.load_key(head, slot, out);
    if (rope) rope_apply(*rope, -static_cast<float>(L.pos(head)[slot]), 1, out);
  }
  unit_row(out, hd, scale, out);
}

// Step 1 for many evicted slots: cosine similarity = dot product of unit rows (keys, values or
// both concatenated, each half scaled by `scale`), nearest kept row four evicted rows at a time.
void nearest_many(const D2oHeadMerge& h, bool use_k, bool use_v, float scale, D2oScratch& scratch,
                  int32_t* cstar, float* m_e) {
  const KvLayer& L = *h.layer;
  const int S = h.n_keep, E = h.n_evicted, hd = L.head_dim();
  const int dim = hd * ((use_k ? 1 : 0) + (use_v ? 1 : 0));
  const size_t kept_floats = static_cast<size_t>(S) * dim;
  if (scratch.kept.size() < kept_floats + 4 * static_cast<size_t>(dim))
    scratch.kept.resize(kept_floats + 4 * static_cast<size_t>(dim));
  float* kept = scratch.kept.data();
  float* q = kept + kept_floats;
  auto unit_row = [&](int slot, float s, float* out) {
    if (use_k) load_unit(L, h.head, false, slot, s, out, h.rope);
    if (use_v) load_unit(L, h.head, true, slot, s, out + (use_k ? hd : 0), nullptr);
  };
  constexpr int kAhead = 8;  // rows
  for (int c = 0; c < std::min(S, kAhead); ++c) prefetch_rows(L, h.head, h.keep[c], use_k, use_v);
  for (int c = 0; c < S; ++c) {
    if (c + kAhead < S) prefetch_rows(L, h.head, h.keep[c + kAhead], use_k, use_v);
    unit_row(h.keep[c], 1.0f, kept + static_cast<size_t>(c) * dim);
  }
  pack_rows(kept, S, dim, scratch.packed);
  for (int i = 0; i < std::min(E, kAhead); ++i)
    prefetch_rows(L, h.head, h.evicted[i], use_k, use_v);
  for (int i = 0; i < E; i += 4) {
    const int nq = std::min(4, E - i);
    for (int r = i + kAhead; r < std::min(E, i + 4 + kAhead); ++r)
      prefetch_rows(L, h.head, h.evicted[r], use_k, use_v);
    for (int r = 0; r < nq; ++r)
      unit_row(h.evicted[i + r], scale, q + static_cast<size_t>(r) * dim);
    nearest_rows(scratch.packed, q, nq, cstar + i, m_e + i);
  }
}

}  // namespace

bool d2o_decode_dots(const PolicyConfig& cfg, const KvLayer& L, int n_evicted, bool unrotated) {
  return d2o_uses_kept_norms(cfg, n_evicted, unrotated) && n_evicted == 1 && !L.type().rot_k &&
         L.head_dim() <= kD2oMaxHeadDim;
}

bool d2o_uses_kept_norms(const PolicyConfig& cfg, int n_evicted, bool unrotated) {
  return cfg.sim == SimOn::kKey && !unrotated && n_evicted >= 1 && n_evicted <= kManyEvicted;
}

void d2o_key_inv_norms(const KvLayer& L, int head, int first, int count, float* out) {
  // Through row_dots' four-row loop, the last group padded by repeating its last row, so that a
  // norm is the same bits wherever its slot sits; fewer than four rows of F32 or F16 keys (a new
  // or a merged slot) through row_inv_norm, which gives that loop's bits for one row.
  constexpr int kMaxDim = 1024;
  D2O_ASSERT(L.head_dim() <= kMaxDim);
  static const float zeros[kMaxDim] = {};
  const KvElemType t = L.type().k;
  RowDots rd;
  rd.base = L.key_base(head);
  rd.map = L.rows(head);
  rd.row_bytes = L.key_row_bytes();
  rd.f16 = t == KvElemType::kF16;
  if (kv_quantized(t)) rd.quant = kv_ggml_type(t);
  rd.dim = L.head_dim();
  rd.q = zeros;
  rd.n = 4;
  float dot[4], inv[4];
  rd.dot = dot;
  rd.inv_norm = inv;
  int32_t rows[4];
  rd.rows = rows;
  if (count < 4 && !kv_quantized(t)) {  // a new or a merged slot: the same bits, one row's work
    rd.rows = nullptr;
    for (int i = 0; i < count; ++i) out[i] = row_inv_norm(rd, first + i);
    return;
  }
  for (int i = 0; i < count; i += 4) {
    const int m = std::min(4, count - i);
    for (int r = 0; r < 4; ++r) rows[r] = first + i + std::min(r, m - 1);
    row_dots(rd);
    for (int r = 0; r < m; ++r) out[i + r] = inv[r];
  }
}

void d2o_nearest(const D2oHeadMerge& h, D2oScratch& scratch, int32_t* cstar, float* m_e) {
  const PolicyConfig& cfg = *h.cfg;
  const KvLayer& L = *h.layer;
  const int S = h.n_keep, E = h.n_evicted, hd = L.head_dim();
  if (E == 0 || S == 0) return;
  const bool use_k = cfg.sim != SimOn::kValue, use_v = cfg.sim != SimOn::kKey;
  const int n_mod = (use_k ? 1 : 0) + (use_v ? 1 : 0);
  const float scale = n_mod == 2 ? 0.5f : 1.0f;
  // Un-rotated keys are formed in memory, so the packed path serves every count then.
  if (E > kManyEvicted || (h.rope && use_k)) {
    nearest_many(h, use_k, use_v, scale, scratch, cstar, m_e);
    return;
  }
  // Scratch layout: sim[S] dots[S] kinv[S] vinv[S] row[hd] (and all[S + 1]).
  const size_t nf = 5 * static_cast<size_t>(S) + hd + 1;
  if (scratch.sim.size() < nf) scratch.sim.resize(nf);
  float* sim = scratch.sim.data();
  if (h.kept_inv && h.evicted_inv && d2o_decode_dots(cfg, L, E, h.rope != nullptr) &&
      S + 1 == L.n_slot(h.head)) {
    // A decode step: the dots of the evicted key with every slot of the head, in the attention
    // kernels' arithmetic (formed by the attention pass when it was told which slot goes; here
    // otherwise), so that both give the same bits.
    const int e = h.evicted[0];
    const float* all = h.all_dots;
    float inv_scale = 1.0f / h.all_dots_scale;
    if (!all) {
      float* buf = sim + 4 * static_cast<size_t>(S) + hd;
      float* row = buf - hd;
      L.load_key(h.head, e, row);
      attn::KvRows k;
      k.base = L.key_base(h.head);
      k.row_bytes = L.key_row_bytes();
      k.type = L.type().k;
      k.idx = L.rows(h.head);
      const float* q[1] = {row};
      float* s[1] = {buf};
      attn::best_kernels().scores(q, 1, k, S + 1, hd, 1.0f, s);
      all = buf;
      inv_scale = 1.0f;
    }
    // The kept slots are the slots before e and after it: the running maximum over the two
    // runs of `all`, the second taking over only when strictly greater (the first maximum wins,
    // and a NaN first similarity stays, as in one pass). inv_scale is a power of two, so
    // (f * inv_scale) * dot is f * (dot * inv_scale) to the bit.
    const float f = h.evicted_inv[0] * inv_scale;
    float best = 0.0f;
    int arg = -1;
    if (e > 0) arg = scaled_argmax(all, h.kept_inv, e, f, &best);
    if (e < S) {
      float b2 = 0.0f;
      const int a2 = scaled_argmax(all + e + 1, h.kept_inv + e, S - e, f, &b2);
      if (arg < 0 || b2 > best) {
        arg = e + a2;
        best = b2;
      }
    }
    cstar[0] = arg;
    m_e[0] = best;
    return;
  }
  float* dots = sim + S;
  float* kinv = dots + S;
  float* vinv = kinv + S;
  float* row = vinv + S;
  const ModalityPass pk{&L, h.head, false, h.keep, S, kinv, dots, row, h.kept_inv};
  const ModalityPass pv{&L, h.head, true, h.keep, S, vinv, dots, row, nullptr};
  // sim = 0 + (key cosine) [+ value cosine], the argmax taken in the last pass.
  for (int i = 0; i < E; ++i) {
    if (use_k && use_v) {
      std::fill(sim, sim + S, 0.0f);
      add_cosines(pk, h.evicted[i], i == 0, scale, sim);
      cstar[i] = add_cosines(pv, h.evicted[i], i == 0, scale, sim, &m_e[i]);
    } else {
      cstar[i] = add_cosines(use_k ? pk : pv, h.evicted[i], i == 0, scale, nullptr, &m_e[i],
                             h.evicted_inv && use_k ? h.evicted_inv[i] : -1.0f);
    }
  }
}

int d2o_decide(const PolicyConfig& cfg, const float* m, int E, float* tau, uint8_t* tau_ready,
               uint8_t* merge) {
  if (E == 0) return 0;
  int n_merged = 0;
  auto decide = [&](int i, double t) {
    merge[i] = static_cast<double>(m[i]) >= t ? 1 : 0;
    n_merged += merge[i];
  };
  if (!*tau_ready) {
    double mean = 0.0;
    for (int i = 0; i < E; ++i) mean += m[i];
    *tau = static_cast<float>(mean / E);
    *tau_ready = 1;
    for (int i = 0; i < E; ++i) decide(i, *tau);
  } else if (cfg.ema == EmaRule::kPaper) {
    double t = *tau;
    for (int i = 0; i < E; ++i) {
      decide(i, t);
      t = cfg.beta * m[i] + (1.0 - cfg.beta) * t;
    }
    *tau = static_cast<float>(t);
  } else {
    double mean = 0.0;
    for (int i = 0; i < E; ++i) mean += m[i];
    *tau = static_cast<float>(0.5 * *tau + 0.5 * (mean / E));
    for (int i = 0; i < E; ++i) decide(i, *tau);
  }
  return n_merged;
}

namespace {

// One evicted slot merged into kept slot dst with similarity m (a decode step's merge): the two
// terms of its group.
void emit_one(const D2oHeadMerge& h, int32_t dst, float m, std::vector<MergeTerm>& terms) {
  const KvLayer& L = *h.layer;
  // merge=sized: tokens a slot stands for.
  auto size_of = [&](int32_t slot) { return 1.0 + static_cast<double>(L.merged(h.head)[slot]); };
  double w_self = 0.0, w = 0.0;
  switch (h.cfg->merge) {
    case MergeRule::kWeighted: {
      const double z = std::exp(1.0) + std::exp(static_cast<double>(m));
      w_self = std::exp(1.0) / z;
      w = std::exp(static_cast<double>(m)) / z;
      break;
    }
    case MergeRule::kSized: {
      const double a = size_of(dst) * std::exp(1.0);
      const double b = size_of(h.evicted[0]) * std::exp(static_cast<double>(m));
      w_self = a / (a + b);
      w = b / (a + b);
      break;
    }
    case MergeRule::kAverage:
      w_self = w = 1.0 / 2.0;
      break;
    case MergeRule::kResearch:
      w_self = 1.0 / 2.0;
      w = static_cast<double>(m) / 2.0;
      break;
    case MergeRule::kOff:
      break;
  }
  terms.push_back({static_cast<int32_t>(h.head), dst, dst, static_cast<float>(w_self)});
  terms.push_back({static_cast<int32_t>(h.head), dst, h.evicted[0], static_cast<float>(w)});
}

}  // namespace

void d2o_emit(const D2oHeadMerge& h, D2oScratch& scratch, const int32_t* cstar, const float* m_e,
              const uint8_t* merge, std::vector<MergeTerm>& terms) {
  const PolicyConfig& cfg = *h.cfg;
  const int S = h.n_keep, E = h.n_evicted;
  if (E == 0 || S == 0 || cfg.merge == MergeRule::kOff) return;
  const KvLayer& L = *h.layer;
  // merge=sized: tokens a slot stands for.
  auto size_of = [&](int32_t slot) { return 1.0 + static_cast<double>(L.merged(h.head)[slot]); };
  if (E == 1) {  // a decode step: one group of one source, no grouping pass over the kept slots
    if (merge[0]) emit_one(h, h.keep[cstar[0]], m_e[0], terms);
    return;
  }

  // Group the merged slots by their kept neighbour (counting sort keeps them ascending).
  // Scratch i2: count[S + 1] members[E].
  if (scratch.group.size() < static_cast<size_t>(E) + S + 1)
    scratch.group.resize(static_cast<size_t>(E) + S + 1);
  int32_t* count = scratch.group.data();
  int32_t* members = count + S + 1;
  std::fill(count, count + S + 1, 0);
  for (int i = 0; i < E; ++i) {
    if (merge[i]) ++count[cstar[i] + 1];
  }
  for (int c = 0; c < S; ++c) count[c + 1] += count[c];
  for (int i = 0; i < E; ++i) {
    if (merge[i]) members[count[cstar[i]]++] = i;
  }
  // count[c] is now the end of group c; group c starts at count[c - 1] (0 for c = 0).
  int begin = 0;
  for (int c = 0; c < S; ++c) {
    const int end = count[c];
    const int k = end - begin;
    if (k > 0) {
      const int32_t dst = h.keep[c];
      double z = 0.0, w_self = 0.0;
      switch (cfg.merge) {
        case MergeRule::kWeighted:
          z = std::exp(1.0);
          for (int t = begin; t < end; ++t) z += std::exp(static_cast<double>(m_e[members[t]]));
          w_self = std::exp(1.0) / z;
          break;
        case MergeRule::kSized:
          z = size_of(dst) * std::exp(1.0);
          for (int t = begin; t < end; ++t) {
            z += size_of(h.evicted[members[t]]) * std::exp(static_cast<double>(m_e[members[t]]));
          }
          w_self = size_of(dst) * std::exp(1.0) / z;
          break;
        case MergeRule::kAverage:
        case MergeRule::kResearch:
          z = 1.0 + k;
          w_self = 1.0 / z;
          break;
        case MergeRule::kOff:
          break;
      }
      terms.push_back({static_cast<int32_t>(h.head), dst, dst, static_cast<float>(w_self)});
      for (int t = begin; t < end; ++t) {
        const int i = members[t];
        double w = 0.0;
        if (cfg.merge == MergeRule::kWeighted)
          w = std::exp(static_cast<double>(m_e[i])) / z;
        else if (cfg.merge == MergeRule::kSized)
          w = size_of(h.evicted[i]) * std::exp(static_cast<double>(m_e[i])) / z;
        else if (cfg.merge == MergeRule::kAverage)
          w = 1.0 / z;
        else
          w = static_cast<double>(m_e[i]) / z;
        terms.push_back({static_cast<int32_t>(h.head), dst, h.evicted[i], static_cast<float>(w)});
      }
    }
    begin = end;
  }
}

int plan_d2o_merges(const D2oHeadMerge& h, D2oScratch& scratch, std::vector<MergeTerm>& terms) {
  const int S = h.n_keep, E = h.n_evicted;
  if (E == 0 || S == 0 || h.cfg->merge == MergeRule::kOff) return 0;
  if (scratch.best_sim.size() < static_cast<size_t>(E))
    scratch.best_sim.resize(static_cast<size_t>(E));
  if (scratch.best.size() < static_cast<size_t>(E)) scratch.best.resize(static_cast<size_t>(E));
  if (scratch.merge.size() < static_cast<size_t>(E)) scratch.merge.resize(static_cast<size_t>(E));
  float* m_e = scratch.best_sim.data();
  int32_t* cstar = scratch.best.data();
  uint8_t* merge = scratch.merge.data();
  d2o_nearest(h, scratch, cstar, m_e);
  const int n_merged = d2o_decide(*h.cfg, m_e, E, h.tau, h.tau_ready, merge);
  if (n_merged > 0) d2o_emit(h, scratch, cstar, m_e, merge, terms);
  return n_merged;
}

}  // namespace d2o
