// The two question settings of the retrieval protocols (`eval ruler`, `eval niah`): where the
// question stands relative to the compression of the context.
//
//  - before: the question is part of the prompt that gets compressed (RULER's and LongBench's
//    protocol): one user message holds the context and the question, and the policy compacts
//    the whole prompt, so a policy that ranks slots by the prompt's last queries (SnapKV's
//    observation window, d2o's prompt_ranking=window) ranks them by the question's attention.
//  - after: the context is a turn of its own and is compressed at its end, before the question
//    is known; the question comes as the next turn of the same sequence. This is what a server
//    session does: its first request holds the document and ends with the assistant's turn open
//    (the compaction point), the assistant answers, and the next request brings the question.
//    With a chat template the prompt is
//        [user: instruction + context] [assistant: kAcknowledgement] [user: question] [assistant:
//        answer prefix ...
//    where the acknowledgement stands for the model's reply to the first turn: a fixed text, fed
//    with the question turn, so that every policy sees the same tokens (a generated reply would
//    differ from policy to policy and cost decode steps). Without a chat template (base models)
//    the tokens are those of the before setting; only the compaction point moves, to the end of
//    the context: a session whose prompt is extended by the question.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "d2o/status.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"

namespace d2o::eval {

enum class QuestionSetting { kBefore, kAfter };

const char* question_setting_name(QuestionSetting s);  // "before", "after"
// Errors: anything but "before" or "after" (the message names the option).
Result<QuestionSetting> parse_question_setting(std::string_view s);

// Where the question stands, and how many questions are asked of one context (SCBench's
// shared-context protocol, its multi-request mode): each is asked of a copy of the context's
// compressed cache, so more than one needs the after setting. What a protocol holds per question
// is its own (src/eval/ruler.h, src/eval/niah.h); one question builds its single-question trial.
struct QuestionShape {
  QuestionSetting setting = QuestionSetting::kBefore;
  int questions = 1;  // 1..kMaxQuestions
};
inline constexpr int kMaxQuestions = 8;

// Errors: questions outside [1, kMaxQuestions], or more than one without the after setting.
Status check_question_shape(const QuestionShape& shape);
// --question and --questions as given, parsed and checked.
Result<QuestionShape> parse_question_shape(std::string_view setting, int questions);

// The assistant's reply to the context turn in the after setting (chat templates only).
inline constexpr const char* kAcknowledgement = "I have read the text. What is your question?";

// The texts a retrieval prompt is assembled from around its context:
//   prefix + instruction + context + tail.first | tail.second
// where `|` is the compaction point of the after setting (the end of the prompt in the before
// setting, where tail.first is empty).
class TurnTexts {
 public:
  // chat = nullptr: plain text. Errors: a chat template that drops a message.
  static Result<TurnTexts> create(const Tokenizer& tok, const ChatTemplate* chat,
                                  QuestionSetting setting);

  QuestionSetting setting() const { return setting_; }
  bool chat() const { return chat_; }
  // The chat template's opening of the first user turn ("" without a template).
  const std::string& prefix() const { return prefix_; }
  // The chat template's text after a user message that opens the assistant's turn.
  const std::string& suffix() const { return suffix_; }

  // {the end of the context turn, the question turn}: `sep` separates the context from the
  // question where both share one message (before, or plain text), then the question, the
  // assistant's turn opened (or a space in plain text), and the answer prefix.
  std::pair<std::string, std::string> tail(const std::string& sep, const std::string& question,
                                           const std::string& answer_prefix) const;
  // After, with a chat template: the text that ends the context's user turn and opens the
  // assistant's (the compaction point follows it), and the acknowledgement with what closes the
  // assistant's turn and opens the next user turn (what precedes the next user message).
  const std::string& reply_open() const { return reply_open_; }
  std::string next_user_turn() const { return kAcknowledgement + reply_close_; }

 private:
  QuestionSetting setting_ = QuestionSetting::kBefore;
  bool chat_ = false;
  std::string prefix_, suffix_;
  // After, with a chat template: the text between the first user message and the
  // acknowledgement (the user's turn closed, the assistant's opened), and between the
  // acknowledgement and the next user message.
  std::string reply_open_, reply_close_;
};

}  // namespace d2o::eval
