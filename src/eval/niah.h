// `d2o eval niah`: needle-in-a-haystack and passkey retrieval over a grid of context lengths and
// needle depths, as the paper's figure 8 (which follows Kamradt's LLMTest_NeedleInAHaystack).
//
// Tasks (both scored by exact match of a random key, so no judge model is needed):
//  - needle (RULER's single needle): "One of the special magic numbers for <word> is: <7 digits>."
//    hidden in a haystack of real prose (the Paul Graham essays; the KJV text when absent),
//    question "What is the special magic number for <word> mentioned in the provided text?";
//  - passkey (RULER/Landmark style): "The pass key is <5 digits>. Remember it. <key> is the pass
//    key." inside repeated filler ("The grass is green. The sky is blue. ..."), question "What is
//    the pass key?".
// The prompt is the model's chat template (when it has one) around one user message (instruction,
// context, question), followed by an answer prefix in the assistant's turn ("The pass key is")
// so a small model answers with the key. It is assembled from token ids so its length is exactly
// the grid's context length; the needle goes in at a sentence boundary near the asked depth
// (0% = the start of the context, 100% = the end; the depth actually used is recorded).
// Each policy then runs prompt-then-compress (the prompt in one pass, shared by all policies:
// src/eval/fork.h, exact) and answers greedily, a few tokens, one pass per token (evicting as it
// generates). Correct = the first run of digits in the answer equals the key.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "eval/harness.h"
#include "eval/progress.h"
#include "eval/turns.h"
#include "runtime/chat_template.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"

namespace d2o::eval {

// The text a chat template puts before and after one user message when it opens the assistant's
// turn (the tokenizer adds BOS itself), so a prompt can be written as prefix + message + suffix.
// Shared by the niah and ruler builders.
Status chat_turn_parts(const Tokenizer& tok, const ChatTemplate& chat, std::string* prefix,
                       std::string* suffix);

enum class NiahTask { kNeedle, kPasskey };
const char* niah_task_name(NiahTask t);

// Builds the prompts. Tokenizes the haystack once.
class NiahBuilder {
 public:
  // chat = nullptr: no template (plain text prompt). haystack: the needle task's prose.
  // shape (src/eval/turns.h): with K questions the needle task holds one needle per question
  // (the first at the cell's depth, the others at seeded random depths, each with its own
  // word); the passkey task has one key and asks once.
  // Errors: a shape check_question_shape refuses.
  static Result<NiahBuilder> create(const Tokenizer& tok, const ChatTemplate* chat,
                                    std::string_view haystack, QuestionShape shape = {});

  struct Trial {
    NiahTask task = NiahTask::kNeedle;
    int length = 0;         // prompt tokens
    double depth = 0;       // asked, in [0, 1]
    double depth_used = 0;  // where the needle starts, as a fraction of the context
    std::string key;        // the digits to retrieve
    std::string word;       // needle task: the key's name
    std::vector<TokenId> prompt;
    int64_t haystack_offset = 0;  // first haystack token used (needle task)
    // prompt[0, context_end) is the context turn, compressed on its own in the after setting;
    // prompt.size() in the before setting.
    int64_t context_end = 0;
    // Questions 2..K (QuestionShape::questions): each replaces the first question's turn after the
    // context.
    struct FollowUp {
      std::vector<TokenId> tokens;
      std::string key, word;
      double depth_used = 0;
    };
    std::vector<FollowUp> more;
  };
  // Errors: a length too short for the instruction, question and needle, or longer than the
  // haystack allows. The same (task, length, depth, seed) gives the same trial.
  Result<Trial> build(NiahTask task, int length, double depth, uint64_t seed) const;

  // The smallest prompt length the task can be built at.
  int min_length(NiahTask task) const;
  int64_t haystack_tokens() const { return static_cast<int64_t>(haystack_.size()); }
  bool uses_chat_template() const { return turns_.chat(); }

 private:
  NiahBuilder(const Tokenizer& tok) : tok_(&tok) {}
  Result<std::vector<TokenId>> encode(const std::string& text, bool add_special) const;
  // Moves a token index back to just after the nearest sentence end (. ! ? or a newline).
  int64_t sentence_start(std::span<const TokenId> ctx, int64_t at) const;

  const Tokenizer* tok_;
  QuestionShape shape_;
  TurnTexts turns_;  // the template around the messages
  std::vector<TokenId> haystack_;
  std::vector<TokenId> filler_unit_;  // one repetition of the passkey filler
};

// True when the first run of ASCII digits in `answer` equals `key`.
bool answer_matches(std::string_view answer, std::string_view key);

struct NiahParams {
  std::vector<NiahTask> tasks = {NiahTask::kNeedle, NiahTask::kPasskey};
  std::vector<int> lengths;               // prompt tokens, each <= the trained context
  std::vector<double> depths;             // in [0, 1]
  int trials = 1;                         // per (task, length, depth) cell
  std::vector<PolicyUnderTest> policies;  // already with their compression
  std::string compression;                // as applied ("ratio=0.2" or "budget=512"), recorded
  int chunk = 0;  // > 0: contexts fed in passes of this many tokens (AnswerRequest::chunk)
  uint64_t seed = 1;
  int n_ctx_train = 0;
  KvType kv_type = KvType::kF16;
  QuestionShape shape;  // the builder's, recorded
};

struct NiahOutcome {
  NiahTask task;
  int length;
  double depth, depth_used;
  int trial;
  std::string key, word;
  std::vector<std::string> answers;  // per policy (the question about the cell's needle)
  std::vector<uint8_t> correct;      // per policy
  // Questions 2..K (QuestionShape::questions): [question - 1][policy].
  std::vector<std::string> more_keys;
  std::vector<std::vector<std::string>> more_answers;
  std::vector<std::vector<uint8_t>> more_correct;
};

struct NiahResult {
  std::vector<NiahOutcome> outcomes;
  int n_prefills = 0;  // prompt passes per trial (policy groups)
  double seconds = 0;
};

// Errors: a grid longer than the trained context (or shorter than the task allows), depths
// outside [0, 1], no policies.
Result<NiahResult> run_niah(Engine& engine, const Tokenizer& tok, const NiahBuilder& builder,
                            const NiahParams& p, Progress* progress);

struct NiahReportText {
  std::string haystack;       // what the needle task's haystack was
  std::string haystack_note;  // e.g. why the fallback was used ("" = none)
  bool chat_template = false;
};

// Writes <name>.json (every trial: key, answers, correctness), <name>.md (accuracy with 95%
// Wilson intervals per policy and task, accuracy by length) and one heatmap per policy and task
// (<name>_<task>_<policy>.svg: depth x length, accuracy per cell).
Status write_niah_report(const NiahResult& r, const NiahParams& p, const RunMeta& meta,
                         const NiahReportText& text, const ReportFiles& files);

}  // namespace d2o::eval
