// Engine::reconstruct: the prompt's reconstruction before its first compaction, for a policy
// that ranks the prompt by what reconstructing it attends to (KvPolicy::reconstruction_chunk;
// the manner of KVzip, Kim et al., 2025). The prompt is fed again after itself, teacher-forced,
// in passes of the policy's chunk: each pass attends to the whole prompt (and to itself), the
// most attention any one of its queries gives each prompt slot is kept (aggregated over the
// query heads of a KV head as the policy aggregates; AttnStatsRequest::window_max), and its own
// slots are dropped before the next, so the cache holds at most the prompt and one chunk. The
// maxima, scaled to the queries a window of StatsNeeds::window holds, become the window
// statistics the compaction ranks by. Decision: no instruction precedes the repeated prompt (the
// engine has no tokenizer).
#include <algorithm>

#include "core/timer.h"
#include "runtime/engine.h"

namespace d2o {

Status Engine::run_rows(const BatchEntry& be, int64_t first_pos, const LogitsSink& sink) {
  const size_t ub = static_cast<size_t>(opts_.n_ubatch);
  for (size_t t0 = 0; t0 < be.tokens.size(); t0 += ub) {
    rows_.clear();
    tokens_.clear();
    pos_.clear();
    const size_t end = std::min(be.tokens.size(), t0 + ub);
    for (size_t t = t0; t < end; ++t) {
      rows_.push_back({0, static_cast<int>(t)});
      tokens_.push_back(be.tokens[t]);
      pos_.push_back(static_cast<int32_t>(first_pos + static_cast<int64_t>(t)));
    }
    D2O_RETURN_IF_ERROR(run_ubatch(std::span<const BatchEntry>(&be, 1), sink));
  }
  return {};
}

Status Engine::reconstruct(const BatchEntry& be) {
  Sequence& seq = *be.seq;
  const int chunk = seq.policy().reconstruction_chunk(seq.policy_state());
  const std::vector<int32_t>& prompt = seq.prompt_tokens();
  if (chunk <= 0 || prompt.empty()) return {};
  Stopwatch sw;
  const EngineTimings before = timings_;
  KvCache& cache = seq.cache();
  const KvCacheConfig& cc = cache.config();
  const int n_layer = cache.n_layer(), G = cc.n_head_kv;
  // The prompt's slots of each compressible layer, and where their sums start.
  std::vector<int> held(static_cast<size_t>(n_layer), 0);
  std::vector<size_t> at(static_cast<size_t>(n_layer), 0);
  size_t cells = 0;
  for (int il = 0; il < n_layer; ++il) {
    if (!cc.layer_compressible(il)) continue;
    held[static_cast<size_t>(il)] = cache.layer(il).n_slot();
    at[static_cast<size_t>(il)] = cells;
    cells += static_cast<size_t>(held[static_cast<size_t>(il)]) * static_cast<size_t>(G);
  }
  recon_sum_.assign(cells, 0.0f);
  // The repeated prompt's positions follow the prompt (this pass's tokens included).
  const int64_t first_pos =
      seq.n_past() - seq.policy_state().pos_shift + static_cast<int64_t>(be.tokens.size());
  BatchEntry rb;
  rb.seq = &seq;
  rb.logits_from = BatchEntry::kNoLogits;
  const LogitsSink none;
  // The repeated prompt moves the recurrent layers' state on; it is put back afterwards, as the
  // attention layers' slots are dropped (a state cannot be rewound: it is copied).
  const RecurrentState saved = cache.recurrent();
  reconstructing_ = true;
  Status st;
  for (size_t c0 = 0; c0 < prompt.size() && st.ok(); c0 += static_cast<size_t>(chunk)) {
    const size_t n = std::min(prompt.size() - c0, static_cast<size_t>(chunk));
    rb.tokens = std::span<const TokenId>(prompt.data() + c0, n);
    for (int il = 0; il < n_layer; ++il) cache.reset_window_stats(il);
    st = run_rows(rb, first_pos, none);
    for (int il = 0; il < n_layer && st.ok(); ++il) {
      const KvLayer& L = cache.layer(il);
      if (cc.layer_compressible(il)) {
        float* sum = recon_sum_.data() + at[static_cast<size_t>(il)];
        const int h_n = held[static_cast<size_t>(il)];
        for (int g = 0; g < G; ++g) {
          const float* w = L.window(g);
          float* s = sum + static_cast<size_t>(g) * h_n;
          for (int j = 0; j < h_n; ++j) s[j] = std::max(s[j], w[j]);
        }
      }
      // A sliding-window layer may have dropped its oldest slots first (as the next pass would).
      cache.drop_appended(il, std::min(L.n_slot(), static_cast<int>(n)));
    }
  }
  reconstructing_ = false;
  cache.recurrent_for_update() = saved;
  D2O_RETURN_IF_ERROR(st);
  // The maxima as window statistics of the queries a window holds, as if each of them gave the
  // slot that much (the prompt's compaction reads them per window query: prompt_scores=).
  const int w = std::min<int>(seq.policy().needs().window, static_cast<int>(be.tokens.size()));
  const float scale = static_cast<float>(std::max(1, w));
  for (int il = 0; il < n_layer; ++il) {
    cache.reset_window_stats(il);
    if (!cc.layer_compressible(il)) continue;
    const int h_n = held[static_cast<size_t>(il)];
    if (cache.layer(il).n_slot() != h_n)
      return internal_error("prompt reconstruction: a layer lost slots it held");
    float* sum = recon_sum_.data() + at[static_cast<size_t>(il)];
    for (int g = 0; g < G; ++g) {
      float* s = sum + static_cast<size_t>(g) * h_n;
      for (int j = 0; j < h_n; ++j) s[j] *= scale;
      cache.replace_window(il, g, 0, h_n, s);
    }
  }
  std::vector<float>().swap(recon_sum_);
  timings_.reconstruct_s += sw.seconds();
  timings_.reconstruct_rows += timings_.rows - before.rows;
  return {};
}

}  // namespace d2o
