// Greedy answers of several KV policies to questions about one context, in either question
// setting (src/eval/turns.h). Shared by `eval ruler` and `eval niah`.
//
//   1. The context is prefilled once for every policy (one pass per statistics group and storage
//      type) and compacted by each, exactly as Engine::forward compacts after a prompt pass
//      (src/eval/fork.h); with a chunk, each policy is fed the context in passes of its own.
//   2. Before setting (no question turns): each policy answers from the context pass's logits.
//      After setting: for each question, every policy's compacted sequence (a copy, but for the
//      last question) is fed the question turn in one pass through Engine::forward, as a server
//      session's next request is (the policy compacts after that pass as after any pass), and
//      answers from that pass's logits.
//   3. Greedy decoding as generate() does it: stop at an end-of-generation token (not kept) or
//      after max_new tokens; every policy advances in one batch per step.
// A policy's answers do not depend on which other policies run beside it: question passes are
// batched only while they fit one micro-batch, so no pass is cut between micro-batches.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "eval/harness.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"

namespace d2o::eval {

struct AnswerRequest {
  std::span<const TokenId> context;  // compressed on its own (with the question: before)
  // After setting: each question's turn, the tokens that follow the context. Empty: the context
  // holds the question (before setting).
  std::vector<std::span<const TokenId>> questions;
  std::span<const PolicyUnderTest> policies;  // each in its own storage type, else kv_type
  int max_new = 0;                            // >= 1
  KvType kv_type = KvType::kF16;
  // > 0: the context is fed to each policy in passes of this many tokens (prefill_in_chunks,
  // src/eval/fork.h), so fixed budgets and prefill=bounded compact between them; 0: one pass
  // shared by the policies.
  int chunk = 0;
};

struct GreedyAnswers {
  // [question][policy] (one question row in the before setting).
  std::vector<std::vector<std::vector<TokenId>>> tokens;
  std::vector<std::vector<std::string>> text;
  // [policy] slots per KV head and layer right after the context's compaction, over the
  // context's tokens.
  std::vector<double> kept;
  int n_prefills = 0;  // context passes (statistics groups x storage types)
};

// Errors: max_new < 1, an empty context or question, no policies, engine errors.
Result<GreedyAnswers> answer_questions(Engine& engine, const Tokenizer& tok,
                                       const AnswerRequest& r);

}  // namespace d2o::eval
