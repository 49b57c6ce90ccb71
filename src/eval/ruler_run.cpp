// `d2o eval ruler`'s run: each trial's prompt prefilled once for all policies (src/eval/fork.h),
// compacted per policy, then every policy's greedy answer, scored.
#include "core/timer.h"
#include "eval/fork.h"
#include "eval/ruler.h"

namespace d2o::eval {

Result<std::vector<RulerAnswer>> ruler_answers(Engine& engine, const Tokenizer& tok,
                                               std::span<const TokenId> prompt,
                                               std::span<const PolicyUnderTest> policies,
                                               int max_new, KvType kv_type, int* n_prefills) {
  if (max_new < 1) return invalid_argument("max_new must be at least 1");
  std::vector<std::shared_ptr<const KvPolicy>> ps;
  std::vector<KvType> types;
  for (const PolicyUnderTest& p : policies) {
    ps.push_back(p.policy);
    types.push_back(p.kv_type.value_or(kv_type));
  }
  D2O_ASSIGN_OR_RETURN(ForkedPrefill fork, prefill_forked(engine, prompt, ps, types));
  if (n_prefills) *n_prefills = fork.n_prefills;
  const int nv = engine.model().hparams().n_vocab;
  const size_t n = policies.size();
  std::vector<RulerAnswer> out(n);
  std::vector<std::vector<TokenId>> toks(n);
  for (size_t i = 0; i < n; ++i) {
    const KvCache& c = fork.seqs[i]->cache();
    out[i].kept =
        static_cast<double>(c.total_slots()) / c.n_layer() / static_cast<double>(prompt.size());
  }
  // Greedy decoding as generate() does it: stop at an end-of-generation token (not kept) or
  // after max_new tokens; all policies advance in one batch per step.
  // The first answer token comes from the prompt pass, which depends on the storage type.
  std::vector<TokenId> next(n);
  for (size_t i = 0; i < n; ++i) next[i] = argmax(fork.last_logits_of[i].data(), nv);
  std::vector<uint8_t> active(n, 1);
  std::vector<BatchEntry> batch;
  std::vector<size_t> who;
  std::vector<TokenId> feed(n);
  for (int step = 0; step < max_new; ++step) {
    batch.clear();
    who.clear();
    for (size_t i = 0; i < n; ++i) {
      if (!active[i]) continue;
      if (tok.is_eog(next[i])) {
        active[i] = 0;
        continue;
      }
      toks[i].push_back(next[i]);
      if (static_cast<int>(toks[i].size()) == max_new) {
        active[i] = 0;
        continue;
      }
      feed[i] = next[i];
      batch.push_back(BatchEntry{fork.seqs[i].get(), {&feed[i], 1}, -1});
      who.push_back(i);
    }
    if (batch.empty()) break;
    D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int, const float* l) {
      next[who[static_cast<size_t>(e)]] = argmax(l, nv);
    }));
  }
  for (size_t i = 0; i < n; ++i) {
    auto text = tok.decode(toks[i], /*render_special=*/false);
    out[i].text = text.ok() ? *text : std::string();
  }
  return out;
}

Result<RulerResult> run_ruler(Engine& engine, const Tokenizer& tok, const RulerBuilder& builder,
                              const RulerParams& p, Progress* progress) {
  if (p.policies.empty()) return invalid_argument("no policies to evaluate");
  if (p.tasks.empty() || p.lengths.empty()) return invalid_argument("empty ruler grid");
  if (p.trials < 1) return invalid_argument("--trials must be at least 1");
  auto cell_seed = [&](size_t ti, int len, int trial) {
    return eval::cell_seed(p.seed, ((static_cast<uint64_t>(p.tasks[ti]) + 1) << 56) ^
                                       (static_cast<uint64_t>(len) << 24) ^
                                       static_cast<uint64_t>(trial));
  };
  // Every cell is checked before the first (slow) trial runs.
  for (size_t ti = 0; ti < p.tasks.size(); ++ti) {
    for (int len : p.lengths) {
      if (p.n_ctx_train > 0 && len > p.n_ctx_train) {
        return invalid_argument("length " + std::to_string(len) +
                                " (prompt and answer) exceeds the model's trained context of " +
                                std::to_string(p.n_ctx_train) + " tokens; use --lengths up to " +
                                std::to_string(p.n_ctx_train));
      }
      auto t = builder.build(p.tasks[ti], len, cell_seed(ti, len, 0));
      if (!t.ok()) return t.status();
    }
  }
  RulerResult res;
  Stopwatch sw;
  for (size_t ti = 0; ti < p.tasks.size(); ++ti) {
    const RulerTask task = p.tasks[ti];
    for (int len : p.lengths) {
      for (int trial = 0; trial < p.trials; ++trial) {
        D2O_ASSIGN_OR_RETURN(RulerBuilder::Trial t,
                             builder.build(task, len, cell_seed(ti, len, trial)));
        D2O_ASSIGN_OR_RETURN(std::vector<RulerAnswer> answers,
                             ruler_answers(engine, tok, t.prompt, p.policies, t.max_new, p.kv_type,
                                           &res.n_prefills));
        RulerOutcome o;
        o.task = task;
        o.length = len;
        o.trial = trial;
        o.prompt_tokens = static_cast<int>(t.prompt.size());
        o.query = t.query;
        o.expected = t.expected;
        o.depths = t.depths;
        for (const RulerAnswer& a : answers) {
          o.answers.push_back(a.text);
          o.scores.push_back(ruler_score(a.text, t.expected));
          o.kept.push_back(a.kept);
        }
        res.outcomes.push_back(std::move(o));
        if (progress) {
          progress->add(static_cast<double>(len),
                        std::string(ruler_task_name(task)) + " " + std::to_string(len) + " " +
                            std::to_string(trial + 1) + "/" + std::to_string(p.trials));
        }
      }
    }
  }
  res.seconds = sw.seconds();
  return res;
}

}  // namespace d2o::eval
