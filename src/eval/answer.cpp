#include "eval/answer.h"

#include <algorithm>
#include <memory>

#include "eval/fork.h"
#include "runtime/sequence.h"

namespace d2o::eval {

namespace {

// Greedy decoding of every sequence from its first answer token `next` (see answer.h, step 3).
Status decode_greedy(Engine& engine, const Tokenizer& tok, std::span<Sequence* const> seqs,
                     std::vector<TokenId> next, int max_new,
                     std::vector<std::vector<TokenId>>& out) {
  const int nv = engine.model().hparams().n_vocab;
  const size_t n = seqs.size();
  out.assign(n, {});
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
      out[i].push_back(next[i]);
      if (static_cast<int>(out[i].size()) == max_new) {
        active[i] = 0;
        continue;
      }
      feed[i] = next[i];
      batch.push_back(BatchEntry{seqs[i], {&feed[i], 1}, -1});
      who.push_back(i);
    }
    if (batch.empty()) break;
    D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int, const float* l) {
      next[who[static_cast<size_t>(e)]] = argmax(l, nv);
    }));
  }
  return {};
}

// Feeds `question` to every sequence (one pass each) and returns each one's next token. Passes
// are batched while their rows fit one micro-batch.
Result<std::vector<TokenId>> feed_question(Engine& engine, std::span<Sequence* const> seqs,
                                           std::span<const TokenId> question) {
  const int nv = engine.model().hparams().n_vocab;
  const size_t rows = question.size();
  const size_t per_batch =
      std::max<size_t>(1, static_cast<size_t>(engine.options().n_ubatch) / rows);
  std::vector<TokenId> next(seqs.size());
  std::vector<BatchEntry> batch;
  for (size_t first = 0; first < seqs.size(); first += per_batch) {
    const size_t last = std::min(seqs.size(), first + per_batch);
    batch.clear();
    for (size_t i = first; i < last; ++i) batch.push_back(BatchEntry{seqs[i], question, -1});
    D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int, const float* l) {
      next[first + static_cast<size_t>(e)] = argmax(l, nv);
    }));
  }
  return next;
}

}  // namespace

Result<GreedyAnswers> answer_questions(Engine& engine, const Tokenizer& tok,
                                       const AnswerRequest& r) {
  if (r.max_new < 1) return invalid_argument("max_new must be at least 1");
  if (r.policies.empty()) return invalid_argument("no policies to evaluate");
  for (std::span<const TokenId> q : r.questions) {
    if (q.empty()) return invalid_argument("a question turn is empty");
  }
  std::vector<std::shared_ptr<const KvPolicy>> ps;
  std::vector<KvType> types;
  for (const PolicyUnderTest& p : r.policies) {
    ps.push_back(p.policy);
    types.push_back(p.kv_type.value_or(r.kv_type));
  }
  D2O_ASSIGN_OR_RETURN(ForkedPrefill fork,
                       prefill_in_chunks(engine, r.context, ps, types, r.chunk));
  const size_t n = r.policies.size();
  GreedyAnswers out;
  out.n_prefills = fork.n_prefills;
  for (size_t i = 0; i < n; ++i) {
    const KvCache& c = fork.seqs[i]->cache();
    out.kept.push_back(static_cast<double>(c.total_slots()) / c.n_layer() /
                       static_cast<double>(r.context.size()));
  }
  const int nv = engine.model().hparams().n_vocab;
  std::vector<Sequence*> seqs(n);
  if (r.questions.empty()) {
    // The first answer token comes from the context pass, which depends on the storage type.
    std::vector<TokenId> next(n);
    for (size_t i = 0; i < n; ++i) {
      seqs[i] = fork.seqs[i].get();
      next[i] = argmax(fork.last_logits_of[i].data(), nv);
    }
    out.tokens.emplace_back();
    D2O_RETURN_IF_ERROR(
        decode_greedy(engine, tok, seqs, std::move(next), r.max_new, out.tokens.back()));
  }
  const ModelHParams& hp = engine.model().hparams();
  for (size_t q = 0; q < r.questions.size(); ++q) {
    // Every question but the last is asked of copies, so the next one finds the context's
    // compacted cache as it was.
    const bool last = q + 1 == r.questions.size();
    std::vector<std::unique_ptr<Sequence>> copies;
    for (size_t i = 0; i < n; ++i) {
      if (last) {
        seqs[i] = fork.seqs[i].get();
        continue;
      }
      copies.push_back(std::make_unique<Sequence>(hp, types[i], ps[i]));
      D2O_RETURN_IF_ERROR(copies.back()->copy_from(*fork.seqs[i]));
      seqs[i] = copies.back().get();
    }
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> next, feed_question(engine, seqs, r.questions[q]));
    out.tokens.emplace_back();
    D2O_RETURN_IF_ERROR(
        decode_greedy(engine, tok, seqs, std::move(next), r.max_new, out.tokens.back()));
  }
  for (const auto& row : out.tokens) {
    out.text.emplace_back();
    for (const std::vector<TokenId>& t : row) {
      auto text = tok.decode(t, /*render_special=*/false);
      out.text.back().push_back(text.ok() ? *text : std::string());
    }
  }
  return out;
}

}  // namespace d2o::eval
