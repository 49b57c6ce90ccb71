// `d2o eval ruler`: RULER-style synthetic retrieval and aggregation tasks (Hsieh et al. 2024,
// "RULER: What's the Real Context Size of Your Long-Context Language Models?"), generated from a
// seed over a haystack text, many trials per (task, length) cell.
//
// Tasks (templates and sizes as RULER's synthetic set; every prompt is the model's chat template
// around one user message, followed by RULER's answer prefix in the assistant's turn):
//  - niah_single: one needle "One of the special magic numbers for <key> is: <7 digits>." in
//    prose (the haystack), asked for its key;
//  - niah_multikey: four needles with different keys, one asked (three distractors);
//  - niah_multivalue: four needles with the same key, all four values expected;
//  - niah_multiquery: four needles with different keys, all four asked;
//  - vt (variable tracking): a chain "VAR A = 12345", "VAR B = VAR A", ... (four hops) hidden in
//    repeated filler sentences; expected: the five names bound to the value;
//  - cwe (common words extraction): a numbered list where 10 words occur often (6 times each
//    below 4K tokens, 30 from 4K on) and the others rarely (1 / 3 times); expected: the 10; one
//    solved example comes first, as in RULER;
//  - fwe (frequent words extraction): coded words with Zipf(2) counts, the most frequent being
//    the noise "...."; expected: the next three.
// Needle keys and the common words are words of the haystack itself (4-12 letters), so no word
// list is shipped; needles go in at sentence boundaries at depths drawn from 40 evenly spaced
// ones (RULER's), vt's statements between filler sentences at random places.
// A length is RULER's max_seq_length: the prompt plus the answer's token budget (prompt <=
// length - max_new). The niah and vt prompts have exactly that many tokens; cwe and fwe grow
// their lists while they fit.
// Score (RULER's string_match_all): the share of the expected strings found, case-insensitive,
// anywhere in the greedy answer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "d2o/status.h"
#include "eval/harness.h"
#include "eval/progress.h"
#include "eval/stats.h"
#include "eval/turns.h"
#include "runtime/chat_template.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"

namespace d2o::eval {

enum class RulerTask {
  kNiahSingle,
  kNiahMultikey,
  kNiahMultivalue,
  kNiahMultiquery,
  kVt,
  kCwe,
  kFwe
};

const char* ruler_task_name(RulerTask t);
// Errors: an unknown name (the message lists the known ones).
Result<RulerTask> parse_ruler_task(std::string_view name);
const std::vector<RulerTask>& all_ruler_tasks();
// The answer's token budget (RULER's tokens_to_generate, niah shortened to what its values need).
int ruler_max_new(RulerTask t);

// RULER's string_match_all: the share of `expected` found (case-insensitive substring) in
// `answer`. 0 when expected is empty.
double ruler_score(std::string_view answer, std::span<const std::string> expected);

class RulerBuilder {
 public:
  // chat = nullptr: plain text prompt. Tokenizes the haystack once and collects its words.
  // shape (src/eval/turns.h): with K questions the niah tasks hold K times the needles they ask
  // for (K keys, or K groups of four keys for niah_multiquery) and vt K chains, each question
  // asking one; cwe and fwe have one question per context and ask it once.
  // Errors: a haystack with too few distinct words for the keys and the cwe lists; a shape
  // check_question_shape refuses.
  static Result<RulerBuilder> create(const Tokenizer& tok, const ChatTemplate* chat,
                                     std::string_view haystack, QuestionShape shape = {});

  struct Trial {
    RulerTask task = RulerTask::kNiahSingle;
    int length = 0;  // prompt + answer budget
    int max_new = 0;
    std::vector<TokenId> prompt;
    std::string query;                  // the key(s) or value asked for ("" for cwe / fwe)
    std::vector<std::string> expected;  // the strings the answer should contain
    // niah / vt: where the piece holding each expected string starts, as a fraction of the
    // context (0 = its start, 1 = its end); empty for cwe / fwe.
    std::vector<double> depths;
    std::vector<std::string> inserted;  // niah: every needle's text; vt: the statements
    int64_t haystack_offset = 0;        // niah: the first haystack token used
    int n_items = 0;                    // cwe: list entries; fwe: words; vt: filler sentences
    // prompt[0, context_end) is the context turn: what the after setting compresses on its own
    // before the question turn, prompt[context_end, end), comes as the next pass. Before:
    // prompt.size() (everything is compressed together).
    int64_t context_end = 0;
    // Questions 2..K of QuestionShape::questions (after setting): each replaces the first
    // question's turn after prompt[0, context_end).
    struct FollowUp {
      std::vector<TokenId> tokens;
      std::string query;
      std::vector<std::string> expected;
      std::vector<double> depths;
    };
    std::vector<FollowUp> more;
  };
  // The same (task, length, seed) gives the same trial. Errors: a length too short for the task,
  // a haystack shorter than the context needs.
  Result<Trial> build(RulerTask task, int length, uint64_t seed) const;

  int64_t haystack_tokens() const { return static_cast<int64_t>(haystack_.size()); }
  size_t n_words() const { return words_.size(); }
  bool uses_chat_template() const { return turns_.chat(); }
  const QuestionShape& shape() const { return shape_; }

 private:
  // The text after a task's context: {the end of the context turn, the question turn}.
  using Tail = std::pair<std::string, std::string>;
  explicit RulerBuilder(const Tokenizer& tok) : tok_(&tok) {}
  Result<std::vector<TokenId>> encode(const std::string& text, bool add_special) const;
  template <class Int, class Context>
  Status largest_within(Int& lo, Int hi, int64_t budget, const Context& context,
                        std::vector<TokenId>* best) const;
  int64_t sentence_start(std::span<const TokenId> ctx, int64_t at) const;
  // The prompt around a context: head (chat prefix, instruction) + ctx + tail (question, answer
  // prefix). Fills t.prompt and t.context_end; errors when it exceeds the length.
  Status assemble(Trial& t, const std::string& head, std::span<const TokenId> ctx,
                  const Tail& tail) const;
  // A follow-up question's tokens (the question turn of `tail`).
  Result<Trial::FollowUp> follow_up(const Tail& tail) const;
  Result<Trial> build_niah(Trial t, SplitMix64& rng) const;
  Result<Trial> build_vt(Trial t, SplitMix64& rng) const;
  Result<Trial> build_cwe(Trial t, SplitMix64& rng) const;
  Result<Trial> build_fwe(Trial t, SplitMix64& rng) const;
  // Head and tail token counts of a task's text (the chat template included).
  Result<int64_t> fixed_tokens(const std::string& head, const Tail& tail) const;

  const Tokenizer* tok_;
  QuestionShape shape_;
  TurnTexts turns_;
  std::vector<TokenId> haystack_;
  std::vector<std::string> words_;  // distinct lowercase words of the haystack, in first-seen order
  std::vector<TokenId> filler_;     // one filler unit (vt)
};

struct RulerParams {
  std::vector<RulerTask> tasks;
  std::vector<int> lengths;
  int trials = 50;                        // per (task, length) cell
  std::vector<PolicyUnderTest> policies;  // the full cache first
  std::string compression;                // "ratio=0.2" or "budget=512", recorded
  int chunk = 0;  // > 0: contexts fed in passes of this many tokens (AnswerRequest::chunk)
  uint64_t seed = 1;
  int n_ctx_train = 0;
  KvType kv_type = KvType::kF16;
  int head_dim = 0;  // the model's: KV bytes of the equal-bytes section
  // The builder's (recorded in the report): where the question stands, how many per context.
  QuestionShape shape;
};

struct RulerOutcome {
  RulerTask task;
  int length = 0, trial = 0, prompt_tokens = 0;
  int context_tokens = 0;  // the context turn (the after setting compresses it on its own)
  std::string query;
  std::vector<std::string> expected;
  std::vector<double> depths;
  std::vector<std::string> answers;  // per policy (the first question's)
  // Per policy, in [0, 1]: the mean score over the trial's questions (one score per trial, so
  // that the questions of one context, which are not independent, count as one sample).
  std::vector<double> scores;
  std::vector<double> kept;  // per policy: slots per KV head and layer / context tokens
  // Questions 2..K (QuestionShape::questions): [question - 1][policy].
  std::vector<std::string> more_queries;
  std::vector<std::vector<std::string>> more_answers;
  std::vector<std::vector<double>> more_scores;
};

struct RulerResult {
  std::vector<RulerOutcome> outcomes;
  int n_prefills = 0;  // prompt passes per trial
  double seconds = 0;
};

// Errors: no policies or tasks, a length beyond the trained context or too short for a task.
Result<RulerResult> run_ruler(Engine& engine, const Tokenizer& tok, const RulerBuilder& builder,
                              const RulerParams& p, Progress* progress);

struct RulerReportText {
  std::string haystack, haystack_note;
  bool chat_template = false;
};

// Writes <name>.json (every trial), <name>.md (scores, shares of the full cache's score, paired
// differences against d2o with verdicts, the compression each policy reached) and
// <name>_scores.svg (a heatmap of the score per policy and task/length cell).
Status write_ruler_report(const RulerResult& r, const RulerParams& p, const RunMeta& meta,
                          const RulerReportText& text, const ReportFiles& files);

// With policies in storage types of their own (--bytes): every method's score pooled over the
// trials, paired differences to the best combination of eviction and quantization, verdicts
// against the single methods, and <name>_bytes.svg. Adds "bytes" to the JSON; "" when no policy
// has its own storage type.
Result<std::string> ruler_bytes_section(const RulerResult& r, const RulerParams& p,
                                        const ReportFiles& files, nlohmann::json& j);

}  // namespace d2o::eval
