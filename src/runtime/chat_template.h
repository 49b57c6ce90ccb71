// Chat templates: turning a conversation into the prompt text a chat model was trained on.
//
// A GGUF carries its template as Jinja text (tokenizer.chat_template). d2o does not run Jinja: it
// recognises the template's family by its markers and renders that family in C++, giving the
// same text the real template gives (tests compare with templates rendered by the jinja2
// package, as transformers renders them). Families:
//   chatml    <|im_start|>role\n...<|im_end|>\n              SmolLM2, Qwen2, Hermes, ...
//             (a default system prompt written in the template, e.g. SmolLM2's, is kept)
//   llama3    <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>   Llama 3
//   llama3.1  llama3 plus the system header with "Cutting Knowledge Date"   Llama 3.1-3.3
//   llama2    <s>[INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ... </s>     Llama 2 chat
//   mistral   <s>[INST] ... [/INST]...</s>                                 Mistral 7B v0.1/v0.2
//   gemma     <start_of_turn>user\n...<end_of_turn>\n (assistant = "model")  Gemma 1-3
//   phi3      <|user|>\n...<|end|>\n<|assistant|>\n                          Phi-3 mini
// The text includes the BOS token's text where the template writes it (llama2/3, mistral,
// gemma, phi3); when the tokenizer adds a BOS itself, render with skip_bos (as llama.cpp strips
// it) and encode with parse_special so the markers become their special tokens.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"

namespace d2o {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

enum class ChatFormat { kChatML, kLlama2, kLlama3, kLlama31, kMistral, kGemma, kPhi3 };

struct ChatApplyOptions {
  bool add_generation_prompt = true;  // open the assistant's turn at the end
  bool skip_bos = false;              // leave out the BOS text (the tokenizer adds the token)
};

class ChatTemplate {
 public:
  // Recognises tokenizer.chat_template. Errors: kNotFound when the GGUF has no template,
  // kUnsupported when it is not one of the families above (both messages name the formats and
  // how to force one). BOS/EOS texts come from the GGUF's vocabulary when it has them.
  static Result<ChatTemplate> from_gguf(const GgufFile& file);
  // Same recognition on template text; bos/eos are the texts of those tokens ("" = the format's
  // usual ones).
  static Result<ChatTemplate> from_template(std::string_view jinja, std::string_view bos,
                                            std::string_view eos);
  // "chatml", "llama3", "llama3.1", "llama2", "mistral", "gemma", "phi3".
  static Result<ChatTemplate> from_name(std::string_view name);
  static std::vector<std::string> supported_names();

  ChatFormat format() const { return format_; }
  const char* name() const;

  // Formats the conversation; with add_generation_prompt the assistant turn is opened.
  // Messages are rendered in order as given; role alternation is not checked (templates that
  // would raise an error on it render the messages anyway).
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  std::string apply(const std::vector<ChatMessage>& messages, const ChatApplyOptions& opts) const;

  // System prompt the template injects when the conversation has none (SmolLM2's ChatML template:
  // "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); "" when none.
  const std::string& default_system_prompt() const { return default_system_; }
  // Texts that end the assistant's turn ("<|im_end|>", "<|eot_id|>", "</s>", ...).
  const std::vector<std::string>& stop_strings() const { return stops_; }
  const std::string& bos_text() const { return bos_; }
  const std::string& eos_text() const { return eos_; }

 private:
  ChatTemplate() = default;
  static ChatTemplate make(ChatFormat format, std::string_view bos, std::string_view eos);

  ChatFormat format_ = ChatFormat::kChatML;
  std::string default_system_;
  std::string bos_;
  std::string eos_;
  std::vector<std::string> stops_;
  bool mistral_space_after_eos_ = false;  // Mistral v0.1: "</s> " after each answer
  bool phi3_system_ = false;              // Phi-3 templates that render system messages
};

// Python's str.strip() (Jinja's trim filter): removes leading and trailing characters for which
// str.isspace() is true (ASCII whitespace, U+001C-U+001F, U+0085, U+00A0, U+1680, U+2000-U+200A,
// U+2028, U+2029, U+202F, U+205F, U+3000).
std::string jinja_trim(std::string_view s);

}  // namespace d2o
