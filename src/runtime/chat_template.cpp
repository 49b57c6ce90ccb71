#include "runtime/chat_template.h"

#include <array>

#include "runtime/unicode.h"

namespace d2o {
namespace {

struct FormatInfo {
  ChatFormat format;
  const char* name;
  const char* bos;  // the format's usual BOS / EOS texts
  const char* eos;
  std::vector<std::string> stops;
};

const std::vector<FormatInfo>& formats() {
  static const std::vector<FormatInfo> kFormats = {
      {ChatFormat::kChatML, "chatml", "", "<|im_end|>", {"<|im_end|>"}},
      {ChatFormat::kLlama3, "llama3", "<|begin_of_text|>", "<|eot_id|>", {"<|eot_id|>"}},
      {ChatFormat::kLlama31,
       "llama3.1",
       "<|begin_of_text|>",
       "<|eot_id|>",
       {"<|eot_id|>", "<|eom_id|>"}},
      {ChatFormat::kLlama2, "llama2", "<s>", "</s>", {"</s>"}},
      {ChatFormat::kMistral, "mistral", "<s>", "</s>", {"</s>"}},
      {ChatFormat::kGemma, "gemma", "<bos>", "<eos>", {"<end_of_turn>"}},
      {ChatFormat::kPhi3, "phi3", "<s>", "<|endoftext|>", {"<|end|>", "<|endoftext|>"}},
  };
  return kFormats;
}

const FormatInfo& info(ChatFormat f) {
  for (const FormatInfo& i : formats()) {
    if (i.format == f) return i;
  }
  return formats().front();
}

std::string names_list() {
  std::string s;
  for (const std::string& n : ChatTemplate::supported_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::string force_hint() {
  return "supported formats: " + names_list() +
         "; choose one by name (e.g. --chat-template chatml) to use it anyway";
}

bool contains(std::string_view s, std::string_view needle) {
  return s.find(needle) != std::string_view::npos;
}

// The system prompt a ChatML template writes when the conversation has none, e.g.
//   {% if loop.first and messages[0]['role'] != 'system' %}
//   {{ '<|im_start|>system\nYou are ...<|im_end|>\n' }}{% endif %}
// The literal may hold a real newline or the escape "\n"; other escapes are undone too.
std::string find_default_system(std::string_view t) {
  if (!contains(t, "!= 'system'") && !contains(t, "!= \"system\"")) return "";
  for (std::string_view head : {"<|im_start|>system\n", "<|im_start|>system\\n"}) {
    const size_t at = t.find(head);
    if (at == std::string_view::npos) continue;
    const size_t begin = at + head.size();
    const size_t end = t.find("<|im_end|>", begin);
    if (end == std::string_view::npos) return "";
    const std::string_view raw = t.substr(begin, end - begin);
    if (contains(raw, "{{") || contains(raw, "{%") || contains(raw, "'") || contains(raw, "\"")) {
      return "";  // not a plain literal (an expression, or quotes closing the literal)
    }
    std::string out;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\\' && i + 1 < raw.size()) {
        const char c = raw[++i];
        out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
      } else {
        out.push_back(raw[i]);
      }
    }
    return out;
  }
  return "";
}

bool py_space(uint32_t cp) {
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  return cp >= 0x80 && unicode::is_whitespace(cp);  // the White_Space set beyond ASCII
}

}  // namespace

std::string jinja_trim(std::string_view s) {
  std::vector<uint32_t> cps;
  unicode::decode_utf8_lenient(s, cps);
  // Byte offsets of the code points (valid UTF-8 in, so widths follow the lead bytes).
  size_t begin = 0, end = s.size();
  size_t i = 0;
  while (i < cps.size() && py_space(cps[i])) {
    begin += unicode::utf8_len_from_lead(static_cast<uint8_t>(s[begin]));
    ++i;
  }
  if (i == cps.size()) return "";
  size_t j = cps.size();
  while (j > i && py_space(cps[j - 1])) {
    // step back over one UTF-8 character
    do {
      --end;
    } while (end > begin && (static_cast<uint8_t>(s[end]) & 0xC0) == 0x80);
    --j;
  }
  return std::string(s.substr(begin, end - begin));
}

std::vector<std::string> ChatTemplate::supported_names() {
  std::vector<std::string> names;
  for (const FormatInfo& i : formats()) names.emplace_back(i.name);
  return names;
}

const char* ChatTemplate::name() const {
  return info(format_).name;
}

ChatTemplate ChatTemplate::make(ChatFormat format, std::string_view bos, std::string_view eos) {
  ChatTemplate t;
  t.format_ = format;
  const FormatInfo& i = info(format);
  t.bos_ = bos.empty() ? i.bos : std::string(bos);
  t.eos_ = eos.empty() ? i.eos : std::string(eos);
  t.stops_ = i.stops;
  t.phi3_system_ = true;
  return t;
}

Result<ChatTemplate> ChatTemplate::from_name(std::string_view name) {
  for (const FormatInfo& i : formats()) {
    if (name == i.name) return make(i.format, "", "");
  }
  return invalid_argument("unknown chat template '" + std::string(name) + "'; " + force_hint());
}

Result<ChatTemplate> ChatTemplate::from_template(std::string_view t, std::string_view bos,
                                                 std::string_view eos) {
  ChatTemplate out;
  if (contains(t, "<|im_start|>") && !contains(t, "<|im_sep|>") &&
      !contains(t, "<end_of_utterance>")) {
    out = make(ChatFormat::kChatML, bos, eos);
    out.default_system_ = find_default_system(t);
  } else if (contains(t, "<|start_header_id|>") && contains(t, "<|end_header_id|>")) {
    out = make(contains(t, "Cutting Knowledge Date") ? ChatFormat::kLlama31 : ChatFormat::kLlama3,
               bos, eos);
  } else if (contains(t, "[INST]")) {
    if (contains(t, "<<SYS>>")) {
      out = make(ChatFormat::kLlama2, bos, eos);
    } else if (contains(t, "[SYSTEM_PROMPT]") || contains(t, "[AVAILABLE_TOOLS]") ||
               contains(t, "' [INST] '")) {
      return unsupported(
          "this Mistral chat template ([INST] with tools or a system prompt "
          "block) is not supported; " +
          force_hint());
    } else {
      out = make(ChatFormat::kMistral, bos, eos);
      out.mistral_space_after_eos_ = contains(t, "eos_token + ' '");
    }
  } else if (contains(t, "<start_of_turn>")) {
    out = make(ChatFormat::kGemma, bos, eos);
  } else if (contains(t, "<|user|>") && contains(t, "<|assistant|>") && contains(t, "<|end|>")) {
    out = make(ChatFormat::kPhi3, bos, eos);
    out.phi3_system_ = contains(t, "<|system|>");
  } else {
    return unsupported("unknown chat template (tokenizer.chat_template); " + force_hint());
  }
  return out;
}

Result<ChatTemplate> ChatTemplate::from_gguf(const GgufFile& file) {
  if (!file.find("tokenizer.chat_template")) {
    return not_found(file.path() + " has no chat template (tokenizer.chat_template); " +
                     force_hint());
  }
  D2O_ASSIGN_OR_RETURN(std::string t, file.get_string("tokenizer.chat_template"));
  // BOS / EOS texts from the vocabulary, as the template's bos_token / eos_token.
  std::string bos, eos;
  if (const GgufValue* tokens = file.find("tokenizer.ggml.tokens");
      tokens && tokens->type == GgufType::kArray && tokens->array_type == GgufType::kString) {
    auto text_of = [&](const char* key) -> std::string {
      const GgufValue* v = file.find(key);
      if (!v || !v->is_integer() || v->i < 0 ||
          static_cast<uint64_t>(v->i) >= tokens->strings.size()) {
        return "";
      }
      return tokens->strings[static_cast<size_t>(v->i)];
    };
    bos = text_of("tokenizer.ggml.bos_token_id");
    eos = text_of("tokenizer.ggml.eos_token_id");
  }
  auto r = from_template(t, bos, eos);
  if (!r.ok()) return r.status().with_context(file.path());
  return r;
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) const {
  ChatApplyOptions o;
  o.add_generation_prompt = add_generation_prompt;
  return apply(messages, o);
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages,
                                const ChatApplyOptions& opts) const {
  std::string out;
  const std::string bos = opts.skip_bos ? std::string() : bos_;
  // Templates that take a leading system message out of the loop.
  const bool has_system = !messages.empty() && messages[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  switch (format_) {
    case ChatFormat::kChatML:
      for (size_t i = 0; i < messages.size(); ++i) {
        if (i == 0 && !has_system && !default_system_.empty()) {
          out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
        }
        out += "<|im_start|>" + messages[i].role + "\n" + messages[i].content + "<|im_end|>\n";
      }
      if (opts.add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case ChatFormat::kLlama3:
    case ChatFormat::kLlama31: {
      size_t start = 0;
      if (format_ == ChatFormat::kLlama31) {
        out += bos;
        out += "<|start_header_id|>system<|end_header_id|>\n\n";
        out += "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
        if (has_system) out += jinja_trim(messages[0].content);
        out += "<|eot_id|>";
        start = first;
      } else if (!messages.empty()) {
        out += bos;
      }
      for (size_t i = start; i < messages.size(); ++i) {
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               jinja_trim(messages[i].content) + "<|eot_id|>";
      }
      if (opts.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case ChatFormat::kLlama2:
      // System text goes into the first turn; every user turn starts with BOS; no generation
      // prompt (the open [/INST] is the prompt).
      for (size_t i = first; i < messages.size(); ++i) {
        std::string content = messages[i].content;
        if (i == first && has_system) {
          content = "<<SYS>>\n" + messages[0].content + "\n<</SYS>>\n\n" + content;
        }
        if (messages[i].role == "user") {
          out += bos + "[INST] " + jinja_trim(content) + " [/INST]";
        } else if (messages[i].role == "system") {
          out += "<<SYS>>\n" + jinja_trim(content) + "\n<</SYS>>\n\n";
        } else if (messages[i].role == "assistant") {
          out += " " + jinja_trim(content) + " " + eos_;
        }
      }
      break;
    case ChatFormat::kMistral:
      // The template has no system role; a system message is put before the first user
      // message, separated by a blank line.
      out += bos;
      for (size_t i = first; i < messages.size(); ++i) {
        if (messages[i].role == "user") {
          std::string content = messages[i].content;
          if (i == first && has_system) content = messages[0].content + "\n\n" + content;
          out += "[INST] " + content + " [/INST]";
        } else if (messages[i].role == "assistant") {
          out += messages[i].content + eos_ + (mistral_space_after_eos_ ? " " : "");
        }
      }
      break;
    case ChatFormat::kGemma:
      // Gemma 3: a system message becomes a prefix of the first turn (Gemma 2 rejects it).
      out += bos;
      for (size_t i = first; i < messages.size(); ++i) {
        const std::string role = messages[i].role == "assistant" ? "model" : messages[i].role;
        out += "<start_of_turn>" + role + "\n";
        if (i == first && has_system) out += messages[0].content + "\n\n";
        out += jinja_trim(messages[i].content) + "<end_of_turn>\n";
      }
      if (opts.add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    case ChatFormat::kPhi3:
      if (!phi3_system_) {
        // Phi-3 mini's first template: system messages are dropped and every user turn is
        // followed by the assistant header, whatever add_generation_prompt says.
        out += bos;
        for (const ChatMessage& m : messages) {
          if (m.role == "user") {
            out += "<|user|>\n" + m.content + "<|end|>\n<|assistant|>\n";
          } else if (m.role == "assistant") {
            out += m.content + "<|end|>\n";
          }
        }
        break;
      }
      // Phi-3.5: every role has its header; an empty system message is left out; without a
      // generation prompt the text ends with EOS.
      for (const ChatMessage& m : messages) {
        if (m.role == "system" && m.content.empty()) continue;
        if (m.role == "system" || m.role == "user" || m.role == "assistant") {
          out += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
        }
      }
      out += opts.add_generation_prompt ? std::string("<|assistant|>\n") : eos_;
      break;
  }
  return out;
}

}  // namespace d2o
