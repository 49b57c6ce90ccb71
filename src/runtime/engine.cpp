#include "runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/assert.h"
#include "core/timer.h"
#include "ops/ops.h"

namespace d2o {

Engine::Engine(const Model& model, ThreadPool& pool, const EngineOptions& opts)
    : model_(model), pool_(pool), opts_(opts) {
  if (opts_.n_ubatch < 1) opts_.n_ubatch = 1;
  const ModelHParams& h = model.hparams();
  rope_.type = h.rope_type;
  rope_.head_dim = h.head_dim;
  rope_.n_rot = h.n_rot;
  rope_.freq_base = h.rope_freq_base;
  rope_.freq_scale = h.rope_freq_scale;
  rope_.freq_factors =
      model.rope_freq_factors().empty() ? nullptr : model.rope_freq_factors().data();
}

void Engine::ensure_rows(int n_rows) {
  if (n_rows <= rows_cap_) return;
  const ModelHParams& h = model_.hparams();
  const size_t n = static_cast<size_t>(n_rows);
  const size_t q_dim = static_cast<size_t>(h.n_head) * h.head_dim;
  const size_t kv_dim = static_cast<size_t>(h.n_head_kv) * h.head_dim;
  x_.resize(n * h.n_embd);
  xn_.resize(n * std::max<size_t>(h.n_embd, q_dim));
  q_.resize(n * q_dim);
  k_.resize(n * kv_dim);
  v_.resize(n * kv_dim);
  attn_out_.resize(n * q_dim);
  gate_.resize(n * h.n_ff);
  up_.resize(n * h.n_ff);
  rows_cap_ = n_rows;
}

namespace {
// Logits are computed for at most this many rows at a time: [kLogitRows, n_vocab] floats.
constexpr int kLogitRows = 32;
}  // namespace

const char* attn_split_name(AttnSplit s) {
  switch (s) {
    case AttnSplit::kAuto:
      return "auto";
    case AttnSplit::kWithinSequence:
      return "within";
    case AttnSplit::kAcrossSequences:
      return "across";
  }
  return "?";
}

Status Engine::validate(std::span<const BatchEntry> batch) const {
  const ModelHParams& h = model_.hparams();
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& be = batch[e];
    auto what = [e] { return "batch entry " + std::to_string(e); };  // built only for errors
    if (!be.seq) return invalid_argument(what() + " has no sequence");
    if (be.tokens.empty()) return invalid_argument(what() + " has no tokens");
    for (size_t f = 0; f < e; ++f) {
      if (batch[f].seq == be.seq) return invalid_argument("a sequence appears twice in one batch");
    }
    for (TokenId t : be.tokens) {
      if (t < 0 || t >= h.n_vocab) {
        return invalid_argument("token id " + std::to_string(t) +
                                " is out of range (vocabulary size " + std::to_string(h.n_vocab) +
                                ")");
      }
    }
    if (be.logits_from < BatchEntry::kNoLogits)
      return invalid_argument(what() + ": bad logits_from");
    if (be.seq->n_past() + static_cast<int64_t>(be.tokens.size()) >
        std::numeric_limits<int32_t>::max()) {
      return invalid_argument("sequence position would overflow");
    }
    if (be.seq->cache().config().n_layer != h.n_layer ||
        be.seq->cache().config().head_dim != h.head_dim ||
        be.seq->cache().config().n_head_kv != h.n_head_kv) {
      return invalid_argument("sequence cache does not match the model's shape");
    }
    // Chunked prefill contract (see BatchEntry::prompt_rest).
    const int64_t n = static_cast<int64_t>(be.tokens.size());
    if (be.prompt_rest < 0) return invalid_argument(what() + ": prompt_rest must be >= 0");
    const int64_t pending = be.seq->prompt_pending();
    if (pending > 0 && n + be.prompt_rest != pending) {
      return invalid_argument(what() + ": this prompt chunk (" + std::to_string(n) + " tokens, " +
                              std::to_string(be.prompt_rest) +
                              " announced after it) does not match the " + std::to_string(pending) +
                              " prompt tokens the previous chunk announced");
    }
    const int w = be.seq->policy().is_full() ? 0 : be.seq->policy().needs().window;
    if (w > 0 && ((be.prompt_rest > 0 && be.prompt_rest < w) ||
                  (pending > 0 && be.prompt_rest == 0 && n < w))) {
      return invalid_argument(
          what() +
          ": the last chunk of a chunked prompt must hold at least the KV policy's "
          "observation window of " +
          std::to_string(w) + " tokens");
    }
  }
  return {};
}

Status Engine::forward(std::span<const BatchEntry> batch, const LogitsSink& sink) {
  // Validate everything before touching any sequence.
  D2O_RETURN_IF_ERROR(validate(batch));
  // SnapKV-style window statistics cover only this pass.
  for (const BatchEntry& be : batch) {
    if (be.seq->policy().needs().window <= 0) continue;
    KvCache& c = be.seq->cache();
    for (int il = 0; il < c.n_layer(); ++il) {
      KvLayer& L = c.layer(il);
      if (L.n_slot == 0) continue;  // nothing stored yet (maybe not even allocated)
      for (int g = 0; g < L.n_head_kv; ++g) {
        std::fill_n(&L.window[L.meta_index(g, 0)], L.n_slot, 0.0f);
      }
    }
  }

  // Micro-batches: rows of the entries in order, each entry's rows contiguous.
  const int ub = opts_.n_ubatch;
  ensure_rows(ub);
  size_t e = 0;
  size_t next_tok = 0;
  while (e < batch.size()) {
    rows_.clear();
    while (e < batch.size() && static_cast<int>(rows_.size()) < ub) {
      const BatchEntry& be = batch[e];
      const size_t take =
          std::min(be.tokens.size() - next_tok, static_cast<size_t>(ub) - rows_.size());
      for (size_t t = next_tok; t < next_tok + take; ++t) {
        const int64_t pos =
            be.seq->n_past() - be.seq->policy_state().pos_shift + static_cast<int64_t>(t);
        rows_.push_back({static_cast<int>(e), static_cast<int>(t), static_cast<int32_t>(pos)});
      }
      next_tok += take;
      if (next_tok == be.tokens.size()) {
        ++e;
        next_tok = 0;
      }
    }
    D2O_RETURN_IF_ERROR(run_ubatch(batch, rows_, sink));
  }

  // Advance and compact each sequence. Compactions of different sequences are independent (each
  // touches only its own cache and policy state), so several run in parallel, one sequence per
  // task; a lone sequence plans its layers in parallel instead. Results are the same either way.
  Stopwatch sw;
  compact_status_.assign(batch.size(), Status());
  auto compact = [&](size_t e, ThreadPool* layer_pool) {
    const BatchEntry& be = batch[e];
    const bool first = !be.seq->started();
    be.seq->advance(static_cast<int64_t>(be.tokens.size()));
    PassInfo pass;
    pass.n_tokens = static_cast<int>(be.tokens.size());
    pass.n_past = be.seq->n_past();
    pass.first_pass = first;
    pass.prompt_rest = be.prompt_rest;
    pass.rope = &rope_;
    pass.pool = layer_pool;
    be.seq->set_prompt_pending(be.prompt_rest);
    KvCache& cache = be.seq->cache();
    const int64_t before = cache.total_slots();
    Status st = be.seq->policy().compact(cache, be.seq->policy_state(), pass);
    // A compaction that removed slots hands their memory back, keeping room for a pass of the
    // same size (up to 64 tokens) so steady decoding or chunked feeding does not reallocate.
    if (st.ok() && cache.total_slots() < before) st = cache.trim(std::min(pass.n_tokens, 64));
    compact_status_[e] = std::move(st);
  };
  if (batch.size() > 1 && pool_.n_threads() > 1) {
    pool_.run(static_cast<int64_t>(batch.size()),
              [&](int64_t e, int) { compact(static_cast<size_t>(e), nullptr); });
  } else {
    for (size_t e = 0; e < batch.size(); ++e) compact(e, &pool_);
  }
  timings_.policy_s += sw.seconds();
  for (const Status& st : compact_status_) D2O_RETURN_IF_ERROR(st);
  return {};
}

Status Engine::run_ubatch(std::span<const BatchEntry> batch, std::span<const Row> rows,
                          const LogitsSink& sink) {
  const ModelHParams& h = model_.hparams();
  const int n = static_cast<int>(rows.size());
  const int n_embd = h.n_embd;
  const int q_dim = h.n_head * h.head_dim;
  const int kv_dim = h.n_head_kv * h.head_dim;
  const int n_ff = h.n_ff;
  timings_.rows += n;
  Stopwatch sw;
  double t_mm = 0, t_attn = 0;
  auto mm = [&](const QMatrix& w, const float* in, float* out) {
    Stopwatch s;
    matmul(w, in, n, out, pool_);
    t_mm += s.seconds();
  };
  // Products that read the same input run as one parallel region, quantising it once.
  auto mm_many = [&](std::initializer_list<MatmulCall> calls) {
    Stopwatch s;
    matmul_many(std::span<const MatmulCall>(calls.begin(), calls.size()), n, pool_);
    t_mm += s.seconds();
  };

  // Each entry's rows are contiguous: one span per entry.
  spans_.clear();
  for (int r0 = 0; r0 < n;) {
    int r1 = r0;
    while (r1 < n && rows[static_cast<size_t>(r1)].entry == rows[static_cast<size_t>(r0)].entry)
      ++r1;
    spans_.push_back({rows[static_cast<size_t>(r0)].entry, r0, r1});
    r0 = r1;
  }

  // Token embeddings.
  pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      const BatchEntry& be = batch[static_cast<size_t>(rows[static_cast<size_t>(r)].entry)];
      const TokenId tok = be.tokens[static_cast<size_t>(rows[static_cast<size_t>(r)].token)];
      model_.token_embd().get_row(tok, x_.data() + r * n_embd);
    }
  });

  const RopeParams& rope = rope_;

  // The residual adds (x += the block's output, left in xn_) run row by row inside the next
  // normalisation's parallel loop: element-wise, so the same values as one pass over all rows.
  bool residual_pending = false;
  auto add_residual = [&](int64_t r) {
    if (residual_pending) add_inplace(x_.data() + r * n_embd, xn_.data() + r * n_embd, n_embd);
  };
  for (int il = 0; il < h.n_layer; ++il) {
    const LayerWeights& L = model_.layer(il);
    // Attention block.
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        add_residual(r);
        rmsnorm(x_.data() + r * n_embd, L.attn_norm.data(), h.rms_eps, n_embd,
                xn_.data() + r * n_embd);
      }
    });
    residual_pending = false;
    mm_many({{&L.wq, xn_.data(), q_.data()},
             {&L.wk, xn_.data(), k_.data()},
             {&L.wv, xn_.data(), v_.data()}});
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        float* q = q_.data() + r * q_dim;
        float* k = k_.data() + r * kv_dim;
        if (h.qkv_bias) {
          add_inplace(q, L.bq.data(), q_dim);
          add_inplace(k, L.bk.data(), kv_dim);
          add_inplace(v_.data() + r * kv_dim, L.bv.data(), kv_dim);
        }
        const float pos = static_cast<float>(rows[static_cast<size_t>(r)].pos);
        float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
        rope_tables(rope, pos, cos_t, sin_t);
        rope_apply_tables(rope, cos_t, sin_t, h.n_head, q);
        rope_apply_tables(rope, cos_t, sin_t, h.n_head_kv, k);
      }
    });

    Stopwatch sa;
    D2O_RETURN_IF_ERROR(attend_layer(il, batch, rows));
    t_attn += sa.seconds();

    mm(L.wo, attn_out_.data(), xn_.data());
    residual_pending = true;

    // Feed-forward block (SwiGLU).
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        add_residual(r);
        rmsnorm(x_.data() + r * n_embd, L.ffn_norm.data(), h.rms_eps, n_embd,
                xn_.data() + r * n_embd);
      }
    });
    residual_pending = false;
    mm_many({{&L.w_gate, xn_.data(), gate_.data()}, {&L.w_up, xn_.data(), up_.data()}});
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        swiglu(gate_.data() + r * n_ff, up_.data() + r * n_ff, n_ff, gate_.data() + r * n_ff);
      }
    });
    mm(L.w_down, gate_.data(), xn_.data());
    residual_pending = true;
  }
  pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) add_residual(r);
  });
  residual_pending = false;

  // Logits for the rows that want them, a few rows at a time.
  std::vector<int>& want = want_;
  want.clear();
  for (int r = 0; r < n; ++r) {
    const Row& row = rows[static_cast<size_t>(r)];
    const BatchEntry& be = batch[static_cast<size_t>(row.entry)];
    const bool last = be.logits_from != BatchEntry::kNoLogits &&
                      row.token == static_cast<int>(be.tokens.size()) - 1;
    if (last || (be.logits_from >= 0 && row.token >= be.logits_from)) want.push_back(r);
  }
  if (!want.empty()) {
    if (logits_.size() < static_cast<size_t>(kLogitRows) * h.n_vocab) {
      logits_.resize(static_cast<size_t>(kLogitRows) * h.n_vocab);
    }
    for (size_t w0 = 0; w0 < want.size(); w0 += kLogitRows) {
      const int cnt = static_cast<int>(std::min<size_t>(kLogitRows, want.size() - w0));
      for (int i = 0; i < cnt; ++i) {
        const int r = want[w0 + static_cast<size_t>(i)];
        rmsnorm(x_.data() + static_cast<size_t>(r) * n_embd, model_.output_norm().data(), h.rms_eps,
                n_embd, xn_.data() + static_cast<size_t>(i) * n_embd);
      }
      Stopwatch s;
      matmul(model_.output(), xn_.data(), cnt, logits_.data(), pool_);
      t_mm += s.seconds();
      if (sink) {
        for (int i = 0; i < cnt; ++i) {
          const Row& row = rows[static_cast<size_t>(want[w0 + static_cast<size_t>(i)])];
          sink(row.entry, row.token, logits_.data() + static_cast<size_t>(i) * h.n_vocab);
        }
      }
    }
  }
  // Layer-wise compactions ran inside the attention stopwatch (attend_layer).
  const double t_policy = std::min(layer_policy_s_, t_attn);
  layer_policy_s_ = 0;
  timings_.matmul_s += t_mm;
  timings_.attention_s += t_attn - t_policy;
  timings_.policy_s += t_policy;
  timings_.other_s += sw.seconds() - t_mm - t_attn;
  return {};
}

Status Engine::attend_layer(int il, std::span<const BatchEntry> batch, std::span<const Row> rows) {
  const ModelHParams& h = model_.hparams();
  const int q_dim = h.n_head * h.head_dim;
  const int kv_dim = h.n_head_kv * h.head_dim;
  const float kq_scale = 1.0f / std::sqrt(static_cast<float>(h.head_dim));

  // Appends a span's keys/values to its sequence's cache (each sequence is touched by one task).
  auto append = [&](const Span& sp) -> Status {
    KvCache& cache = batch[static_cast<size_t>(sp.entry)].seq->cache();
    const int cnt = sp.r1 - sp.r0;
    D2O_RETURN_IF_ERROR(cache.reserve(il, cache.layer(il).n_slot + cnt, /*exact=*/false));
    // Positions are consecutive rows: copied on the stack in pieces.
    constexpr int kPosPiece = 64;
    int32_t pos[kPosPiece];
    for (int r0 = sp.r0; r0 < sp.r1; r0 += kPosPiece) {
      const int m = std::min(kPosPiece, sp.r1 - r0);
      for (int r = 0; r < m; ++r) pos[r] = rows[static_cast<size_t>(r0 + r)].pos;
      cache.append(il, k_.data() + static_cast<size_t>(r0) * kv_dim,
                   v_.data() + static_cast<size_t>(r0) * kv_dim, pos, m);
    }
    return {};
  };

  auto attend = [&](const Span& sp, ThreadPool& pool, AttnScratch& scratch) {
    const BatchEntry& be = batch[static_cast<size_t>(sp.entry)];
    AttnStatsRequest req;
    const KvPolicy& pol = be.seq->policy();
    if (!pol.is_full()) {
      const StatsNeeds needs = pol.needs();
      req.accumulate = needs.accumulate;
      req.agg = needs.agg;
      req.mass = needs.mass;
      if (needs.window > 0) {
        // Window = the entry's last `window` tokens; rows [r0, r1) hold tokens from first_tok.
        const int first_tok = rows[static_cast<size_t>(sp.r0)].token;
        const int win_start = static_cast<int>(be.tokens.size()) - needs.window;
        req.window_first = std::max(0, win_start - first_tok);
      }
    }
    AttnInput in;
    in.q = q_.data() + static_cast<size_t>(sp.r0) * q_dim;
    in.out = attn_out_.data() + static_cast<size_t>(sp.r0) * q_dim;
    in.n_tok = sp.r1 - sp.r0;
    in.n_head = h.n_head;
    in.scale = kq_scale;
    attention_forward(in, be.seq->cache().layer(il), req, pool, scratch);
  };

  // Spans run one per task (single-threaded attention, sequences in parallel): short chunks
  // under kAuto, all under kAcrossSequences; only worth it for two or more of them.
  constexpr int kAcrossMaxRows = 4;
  across_.clear();
  if (opts_.attn_split != AttnSplit::kWithinSequence && pool_.n_threads() > 1) {
    for (size_t i = 0; i < spans_.size(); ++i) {
      const int cnt = spans_[i].r1 - spans_[i].r0;
      if (opts_.attn_split == AttnSplit::kAcrossSequences || cnt <= kAcrossMaxRows) {
        across_.push_back(static_cast<int>(i));
      }
    }
    if (across_.size() < 2) across_.clear();
  }
  size_t next_across = 0;
  for (size_t i = 0; i < spans_.size(); ++i) {
    if (next_across < across_.size() && across_[next_across] == static_cast<int>(i)) {
      ++next_across;
      continue;
    }
    D2O_RETURN_IF_ERROR(append(spans_[i]));
    attend(spans_[i], pool_, attn_scratch_);
  }
  if (!across_.empty()) {
    const size_t nt = static_cast<size_t>(pool_.n_threads());
    if (solo_pools_.size() < nt) {
      solo_scratch_.resize(nt);
      while (solo_pools_.size() < nt) solo_pools_.push_back(std::make_unique<ThreadPool>(1));
    }
    // A one-token pass whose policy allows it compacts this layer right away, in the same task,
    // while the layer's slots are still in this core's caches (the same result as compacting
    // after the pass; the engine's compaction step then only does its bookkeeping).
    layer_status_.assign(across_.size(), Status());
    thread_policy_s_.assign(nt, 0.0);
    pool_.run(static_cast<int64_t>(across_.size()), [&](int64_t task, int thread) {
      const Span& sp = spans_[static_cast<size_t>(across_[static_cast<size_t>(task)])];
      Status st = append(sp);
      if (!st.ok()) {
        layer_status_[static_cast<size_t>(task)] = std::move(st);
        return;
      }
      attend(sp, *solo_pools_[static_cast<size_t>(thread)],
             solo_scratch_[static_cast<size_t>(thread)]);
      const BatchEntry& be = batch[static_cast<size_t>(sp.entry)];
      if (be.tokens.size() != 1 || be.prompt_rest != 0) return;
      const KvPolicy& pol = be.seq->policy();
      PolicyState& state = be.seq->policy_state();
      if (!pol.compacts_per_layer(state)) return;
      Stopwatch sw;
      PassInfo pass;
      pass.n_tokens = 1;
      pass.n_past = be.seq->n_past() + 1;
      pass.prompt_rest = 0;
      pass.rope = &rope_;
      layer_status_[static_cast<size_t>(task)] =
          pol.compact_layer(be.seq->cache(), state, pass, il);
      thread_policy_s_[static_cast<size_t>(thread)] += sw.seconds();
    });
    // The attention stopwatch around this call counts these compactions too: their share of the
    // wall time (thread time / threads) is moved over to the policy's figure.
    double t_policy = 0;
    for (double t : thread_policy_s_) t_policy += t;
    layer_policy_s_ += t_policy / static_cast<double>(nt);
    for (const Status& st : layer_status_) D2O_RETURN_IF_ERROR(st);
  }
  return {};
}

}  // namespace d2o
