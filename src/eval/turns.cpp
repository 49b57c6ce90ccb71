#include "eval/turns.h"

#include "eval/niah.h"

namespace d2o::eval {

namespace {

constexpr const char* kFirstTurnMarker = "@@D2O_FIRST_USER_MESSAGE@@";
constexpr const char* kSecondTurnMarker = "@@D2O_SECOND_USER_MESSAGE@@";

}  // namespace

const char* question_setting_name(QuestionSetting s) {
  return s == QuestionSetting::kBefore ? "before" : "after";
}

Result<QuestionSetting> parse_question_setting(std::string_view s) {
  if (s == "before") return QuestionSetting::kBefore;
  if (s == "after") return QuestionSetting::kAfter;
  return invalid_argument("--question: unknown setting '" + std::string(s) +
                          "' (use before: the question is compressed with the context, or "
                          "after: the context is compressed first and the question comes as "
                          "the next turn)");
}

Status check_question_shape(const QuestionShape& shape) {
  if (shape.questions < 1 || shape.questions > kMaxQuestions) {
    return invalid_argument("--questions must be in [1, " + std::to_string(kMaxQuestions) + "]");
  }
  if (shape.questions > 1 && shape.setting != QuestionSetting::kAfter) {
    return invalid_argument(
        "--questions K asks K questions of one compressed context: it needs --question after");
  }
  return {};
}

Result<QuestionShape> parse_question_shape(std::string_view setting, int questions) {
  QuestionShape shape;
  D2O_ASSIGN_OR_RETURN(shape.setting, parse_question_setting(setting));
  shape.questions = questions;
  D2O_RETURN_IF_ERROR(check_question_shape(shape));
  return shape;
}

Result<TurnTexts> TurnTexts::create(const Tokenizer& tok, const ChatTemplate* chat,
                                    QuestionSetting setting) {
  TurnTexts t;
  t.setting_ = setting;
  t.chat_ = chat != nullptr;
  if (!chat) return t;
  D2O_RETURN_IF_ERROR(chat_turn_parts(tok, *chat, &t.prefix_, &t.suffix_));
  if (setting == QuestionSetting::kBefore) return t;
  // The whole exchange rendered once, then cut at the messages: templates differ in what closes
  // a turn and opens the next (ChatML's "<|im_end|>\n<|im_start|>assistant\n", Llama 3's
  // headers, Gemma's "<end_of_turn>\n<start_of_turn>model\n", ...).
  ChatApplyOptions opts;
  opts.add_generation_prompt = true;
  opts.skip_bos = tok.add_bos();
  const std::string r = chat->apply(
      {{"user", kFirstTurnMarker}, {"assistant", kAcknowledgement}, {"user", kSecondTurnMarker}},
      opts);
  const size_t a = r.find(kFirstTurnMarker);
  const size_t b = a == std::string::npos ? a : r.find(kAcknowledgement, a);
  const size_t c = b == std::string::npos ? b : r.find(kSecondTurnMarker, b);
  if (c == std::string::npos)
    return internal_error("the chat template dropped a message of a two-turn conversation");
  const size_t a_end = a + std::string(kFirstTurnMarker).size();
  const size_t b_end = b + std::string(kAcknowledgement).size();
  if (r.substr(0, a) != t.prefix_ ||
      r.substr(c + std::string(kSecondTurnMarker).size()) != t.suffix_)
    return internal_error("the chat template renders a first turn differently in a conversation");
  t.reply_open_ = r.substr(a_end, b - a_end);
  t.reply_close_ = r.substr(b_end, c - b_end);
  return t;
}

std::pair<std::string, std::string> TurnTexts::tail(const std::string& sep,
                                                    const std::string& question,
                                                    const std::string& answer_prefix) const {
  if (!chat_) return {"", sep + question + " " + answer_prefix};
  if (setting_ == QuestionSetting::kBefore) return {"", sep + question + suffix_ + answer_prefix};
  return {reply_open_, kAcknowledgement + reply_close_ + question + suffix_ + answer_prefix};
}

}  // namespace d2o::eval
