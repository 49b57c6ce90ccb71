#include "runtime/engine.h"

#include <algorithm>
#include <limits>

#include "core/timer.h"
#include "kv/cold_tier.h"

namespace d2o {

Engine::Engine(const Model& model, ThreadPool& pool, const EngineOptions& opts)
    : model_(model), pool_(pool), opts_(opts) {
  if (opts_.n_ubatch < 1) opts_.n_ubatch = 1;
  ForwardOptions fo;
  fo.max_rows = opts_.n_ubatch;
  fo.attn_split = opts_.attn_split;
  forward_ = ModelForward::create(model, pool, fo);
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
    if (const ColdTier* cold = be.seq->cache().cold()) {
      if (!cold->ok()) return resource_exhausted("KV policy cold=disk: " + cold->error());
      if (Status st = check_kv_type(cold->config().type, h.head_dim); !st.ok())
        return invalid_argument("KV policy cold_type=" +
                                std::string(kv_type_name(cold->config().type)) +
                                " does not fit this model: " + st.message());
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
  // Window statistics (StatsNeeds::window) cover only this pass (a no-op for a cache whose window
  // statistics no pass has collected since the last reset).
  for (const BatchEntry& be : batch) {
    if (be.seq->policy().needs().window <= 0) continue;
    KvCache& c = be.seq->cache();
    for (int il = 0; il < c.n_layer(); ++il) {
      c.reset_window_stats(il);
    }
  }

  // A prompt the policy will reconstruct is kept until it is whole (KvPolicy::reconstruction_chunk).
  for (const BatchEntry& be : batch) {
    if (be.seq->policy().reconstruction_chunk(be.seq->policy_state()) <= 0) continue;
    std::vector<int32_t>& kept = be.seq->prompt_tokens();
    kept.insert(kept.end(), be.tokens.begin(), be.tokens.end());
  }

  // Micro-batches: rows of the entries in order, each entry's rows contiguous.
  const int ub = opts_.n_ubatch;
  size_t e = 0;
  size_t next_tok = 0;
  while (e < batch.size()) {
    rows_.clear();
    tokens_.clear();
    pos_.clear();
    while (e < batch.size() && static_cast<int>(rows_.size()) < ub) {
      const BatchEntry& be = batch[e];
      const size_t take =
          std::min(be.tokens.size() - next_tok, static_cast<size_t>(ub) - rows_.size());
      for (size_t t = next_tok; t < next_tok + take; ++t) {
        const int64_t pos =
            be.seq->n_past() - be.seq->policy_state().pos_shift + static_cast<int64_t>(t);
        rows_.push_back({static_cast<int>(e), static_cast<int>(t)});
        tokens_.push_back(be.tokens[t]);
        pos_.push_back(static_cast<int32_t>(pos));
      }
      next_tok += take;
      if (next_tok == be.tokens.size()) {
        ++e;
        next_tok = 0;
      }
    }
    D2O_RETURN_IF_ERROR(run_ubatch(batch, sink));
  }

  for (const BatchEntry& be : batch) {
    if (be.seq->prompt_tokens().empty() || be.prompt_rest > 0) continue;
    if (be.tokens.size() > 1) D2O_RETURN_IF_ERROR(reconstruct(be));
    std::vector<int32_t>().swap(be.seq->prompt_tokens());
  }

  // Advance and compact each sequence. Compactions of different sequences are independent (each
  // touches only its own cache and policy state), so several run in parallel, one sequence per
  // task; a lone sequence plans its layers in parallel instead. Results are the same either way.
  Stopwatch sw;
  compact_status_.assign(batch.size(), Status());
  auto compact = [&](size_t e, ThreadPool* layer_pool) {
    compact_status_[e] = finish_pass(batch[e], layer_pool);
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

Status Engine::finish_pass(const BatchEntry& be, ThreadPool* layer_pool) const {
  const bool first = !be.seq->started();
  be.seq->advance(static_cast<int64_t>(be.tokens.size()));
  PassInfo pass;
  pass.n_tokens = static_cast<int>(be.tokens.size());
  pass.n_past = be.seq->n_past();
  pass.first_pass = first;
  pass.prompt_rest = be.prompt_rest;
  pass.rope = &rope();
  pass.pool = layer_pool;
  be.seq->set_prompt_pending(be.prompt_rest);
  KvCache& cache = be.seq->cache();
  if (ColdTier* cold = cache.cold(); cold && cold->recalled_in_pass) {
    cold->recalled_in_pass = false;
    cold->note_turn();
    pass.recalled = true;
  }
  const int64_t before = cache.total_slots();
  const bool layered = be.seq->policy_state().layer_compacted;  // compacted during the pass
  D2O_RETURN_IF_ERROR(be.seq->policy().compact(cache, be.seq->policy_state(), pass));
  // A compaction that removed slots hands their memory back, keeping room for the next pass
  // (slack_after_compaction) so steady decoding or chunked feeding does not reallocate.
  if (layered || cache.total_slots() < before)
    D2O_RETURN_IF_ERROR(cache.trim(
        slack_after_compaction(pass.n_tokens, be.prompt_rest > 0 || be.logits_from >= 0)));
  // A long pass that ends its prompt leaves sliding-window layers holding the whole pass until
  // the next one: hand that back now (a sequence may stay idle, as a kept session does).
  if (be.prompt_rest == 0 && pass.n_tokens > kSlidingSlack && cache.config().has_sliding())
    D2O_RETURN_IF_ERROR(cache.settle_sliding());
  return {};
}

Status Engine::run_ubatch(std::span<const BatchEntry> batch, const LogitsSink& sink) {
  const int n = static_cast<int>(rows_.size());
  timings_.rows += n;
  Stopwatch sw;

  // Each entry's rows are contiguous: one SeqRows per entry, with what its policy reads from
  // attention.
  seqs_.clear();
  seq_entry_.clear();
  for (int r0 = 0; r0 < n;) {
    const int entry = rows_[static_cast<size_t>(r0)].entry;
    int r1 = r0;
    while (r1 < n && rows_[static_cast<size_t>(r1)].entry == entry) ++r1;
    const BatchEntry& be = batch[static_cast<size_t>(entry)];
    SeqRows sr;
    sr.cache = &be.seq->cache();
    sr.r0 = r0;
    sr.r1 = r1;
    const KvPolicy& pol = be.seq->policy();
    // A new turn (a pass of several tokens that ends its prompt, of a sequence already started)
    // recalls from the cache's cold tier, if it holds anything: in its last micro-batch, and its
    // compaction then ranks by the turn's window, which every micro-batch of the pass collects.
    const ColdTier* cold = be.seq->cache().cold();
    const bool turn_recalls = cold && !reconstructing_ && be.tokens.size() > 1 &&
                              be.prompt_rest == 0 && be.seq->started() && cold->total_slots() > 0;
    if (reconstructing_) {
      // Every query's attention into the window statistics; the pass's output is not kept.
      const StatsNeeds needs = pol.pass_needs(be.seq->policy_state());
      sr.stats.agg = needs.agg;
      sr.stats.mass = needs.mass;
      sr.stats.window_first = 0;
      sr.stats.window_max = true;
    } else if (!pol.is_full()) {
      const StatsNeeds needs = pol.pass_needs(be.seq->policy_state(), turn_recalls);
      sr.stats.accumulate = needs.accumulate;
      sr.stats.agg = needs.agg;
      sr.stats.mass = needs.mass;
      sr.stats.queries = needs.queries;
      if (needs.window > 0) {
        // Window = the entry's last `window` tokens; rows [r0, r1) hold tokens from first_tok.
        const int first_tok = rows_[static_cast<size_t>(r0)].token;
        const int win_start = static_cast<int>(be.tokens.size()) - needs.window;
        sr.stats.window_first = std::max(0, win_start - first_tok);
      }
    }
    sr.recall = turn_recalls &&
                rows_[static_cast<size_t>(r1 - 1)].token == static_cast<int>(be.tokens.size()) - 1;
    // A one-token pass may be compacted layer by layer (after_attention). So is the micro-batch
    // of a turn that recalls from the cold tier: each layer, holding its recalled slots, goes
    // back to its budget right after its attention rather than every layer at the pass's end.
    // The plans are the same (a layer's cache is not read again in the pass); the pass holds one
    // layer's recall at a time instead of all of them.
    const bool one_token = be.tokens.size() == 1 && be.prompt_rest == 0 && !reconstructing_;
    sr.layer_hook = one_token || (sr.recall && pol.compacts_per_layer(be.seq->policy_state()));
    if (one_token && !pol.is_full()) sr.stats.probe = pol.attention_probe(be.seq->policy_state());
    seqs_.push_back(sr);
    seq_entry_.push_back(entry);
    r0 = r1;
  }

  // The rows that produce logits.
  want_.clear();
  for (int r = 0; r < n; ++r) {
    const Row& row = rows_[static_cast<size_t>(r)];
    const BatchEntry& be = batch[static_cast<size_t>(row.entry)];
    const bool last = be.logits_from != BatchEntry::kNoLogits &&
                      row.token == static_cast<int>(be.tokens.size()) - 1;
    if (last || (be.logits_from >= 0 && row.token >= be.logits_from)) want_.push_back(r);
  }

  UbatchInput in;
  in.tokens = tokens_;
  in.pos = pos_;
  in.seqs = seqs_;
  in.logit_rows = want_;
  batch_ = batch;
  sink_ = &sink;
  thread_policy_s_.assign(static_cast<size_t>(pool_.n_threads()), 0.0);
  alone_policy_s_ = 0;
  ForwardTimings ft;
  const Status st = forward_->run(in, *this, ft);
  batch_ = {};
  sink_ = nullptr;
  D2O_RETURN_IF_ERROR(st);

  // Layer-wise compactions ran inside the attention time: their share of the wall time (thread
  // time / threads) is moved over to the policy's figure.
  double layer_policy_s = 0;
  for (double t : thread_policy_s_) layer_policy_s += t;
  layer_policy_s /= static_cast<double>(pool_.n_threads());
  layer_policy_s += alone_policy_s_;  // compactions that nothing ran beside: wall time
  const double t_policy = std::min(layer_policy_s, ft.attention_s);
  timings_.matmul_s += ft.matmul_s;
  timings_.attention_s += ft.attention_s - t_policy;
  timings_.policy_s += t_policy;
  timings_.other_s += sw.seconds() - ft.matmul_s - ft.attention_s;
  return {};
}

// A one-token pass whose policy allows it compacts this layer right away, in the task that ran
// the layer's attention, while the layer's slots are still in this core's caches (the same result
// as compacting after the pass; the compaction step after the pass then only does its
// bookkeeping). Every layer is compacted alike whatever its LayerDesc.
Status Engine::after_attention(int s, int il, const LayerDesc& /*layer*/, int thread) {
  const BatchEntry& be = batch_[static_cast<size_t>(seq_entry_[static_cast<size_t>(s)])];
  const KvPolicy& pol = be.seq->policy();
  PolicyState& state = be.seq->policy_state();
  if (!pol.compacts_per_layer(state)) return {};
  Stopwatch sw;
  PassInfo pass;
  // A decode step, or a turn's recalling micro-batch (its last: the whole turn is in the cache).
  pass.n_tokens = static_cast<int>(be.tokens.size());
  pass.n_past = be.seq->n_past() + static_cast<int64_t>(be.tokens.size());
  pass.prompt_rest = 0;
  pass.recalled = be.tokens.size() > 1;
  pass.rope = &rope();
  // Alone (thread < 0: no pool task runs), the layer's heads are compacted on the whole pool.
  pass.pool = thread < 0 ? &pool_ : nullptr;
  Status st = pol.compact_layer(be.seq->cache(), state, pass, il);
  // A turn's recall: the layer hands its recalled slots' memory back before the next layer
  // recalls (slack for the decode steps after the turn).
  if (st.ok() && pass.recalled)
    st = be.seq->cache().trim_layer(il, slack_after_compaction(1, false));
  (thread < 0 ? alone_policy_s_ : thread_policy_s_[static_cast<size_t>(thread)]) += sw.seconds();
  return st;
}

void Engine::logits(std::span<const int> rows, const float* logits) {
  if (!*sink_) return;
  const size_t n_vocab = static_cast<size_t>(model_.hparams().n_vocab);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows_[static_cast<size_t>(rows[i])];
    (*sink_)(row.entry, row.token, logits + i * n_vocab);
  }
}

}  // namespace d2o
