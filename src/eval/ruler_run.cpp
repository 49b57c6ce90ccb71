// `d2o eval ruler`'s run: each trial's context prefilled once for all policies (src/eval/fork.h),
// compacted per policy, then every policy's greedy answer to each question (src/eval/answer.h),
// scored.
#include "core/timer.h"
#include "eval/answer.h"
#include "eval/ruler.h"

namespace d2o::eval {

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
        AnswerRequest req;
        req.policies = p.policies;
        req.max_new = t.max_new;
        req.kv_type = p.kv_type;
        req.chunk = p.chunk;
        const std::span<const TokenId> prompt(t.prompt);
        req.context = prompt.first(static_cast<size_t>(t.context_end));
        if (t.context_end < static_cast<int64_t>(t.prompt.size())) {
          req.questions.push_back(prompt.subspan(static_cast<size_t>(t.context_end)));
          for (const RulerBuilder::Trial::FollowUp& f : t.more) req.questions.push_back(f.tokens);
        }
        D2O_ASSIGN_OR_RETURN(GreedyAnswers answers, answer_questions(engine, tok, req));
        res.n_prefills = answers.n_prefills;
        RulerOutcome o;
        o.task = task;
        o.length = len;
        o.trial = trial;
        o.prompt_tokens = static_cast<int>(t.prompt.size());
        o.context_tokens = static_cast<int>(t.context_end);
        o.query = t.query;
        o.expected = t.expected;
        o.depths = t.depths;
        o.answers = answers.text[0];
        o.kept = answers.kept;
        for (const std::string& a : o.answers) o.scores.push_back(ruler_score(a, t.expected));
        for (size_t m = 0; m < t.more.size(); ++m) {
          o.more_queries.push_back(t.more[m].query);
          o.more_answers.push_back(answers.text[m + 1]);
          o.more_scores.emplace_back();
          for (size_t pi = 0; pi < o.scores.size(); ++pi) {
            o.more_scores.back().push_back(
                ruler_score(answers.text[m + 1][pi], t.more[m].expected));
            o.scores[pi] += o.more_scores.back().back();
          }
        }
        for (double& s : o.scores) s /= static_cast<double>(1 + t.more.size());
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
