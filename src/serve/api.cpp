#include "serve/api.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "kv/policy.h"
#include "runtime/unicode.h"

namespace d2o::serve {

using json = nlohmann::json;

namespace {

constexpr size_t kMaxStops = 16;
constexpr size_t kMaxMessages = 100000;

ApiError wrong_type(std::string_view field, const char* want) {
  return bad_field(field, "'" + std::string(field) + "' must be " + want, "invalid_type");
}

// Parses the body into an object. Errors: empty body, invalid UTF-8, malformed JSON, not an object.
std::optional<ApiError> parse_object(std::string_view body, json& out) {
  if (body.empty()) {
    return ApiError{400, "the request body is empty; send a JSON object", "invalid_request_error",
                    "empty_body", ""};
  }
  if (!valid_utf8(body)) {
    return ApiError{400, "the request body is not valid UTF-8", "invalid_request_error",
                    "invalid_utf8", ""};
  }
  try {
    out = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {  // the parser's message says where the JSON breaks
    return ApiError{400, std::string("the request body is not valid JSON: ") + e.what(),
                    "invalid_request_error", "invalid_json", ""};
  }
  if (!out.is_object()) {
    return ApiError{400, "the request body must be a JSON object", "invalid_request_error",
                    "invalid_json", ""};
  }
  return std::nullopt;
}

// The field's value when present and not null.
const json* field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> get_string(const json& obj, const char* name, std::string& out) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) return wrong_type(name, "a string");
  out = v->get<std::string>();
  return std::nullopt;
}

std::optional<ApiError> get_bool(const json& obj, const char* name, bool& out) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(name, "a boolean");
  out = v->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> get_number(const json& obj, const char* name, std::optional<double>& out) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) return wrong_type(name, "a number");
  out = v->get<double>();
  return std::nullopt;
}

std::optional<ApiError> get_int(const json& obj, const char* name, std::optional<int64_t>& out) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    out = u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
    return std::nullopt;
  }
  if (!v->is_number_integer()) return wrong_type(name, "an integer");
  out = v->get<int64_t>();
  return std::nullopt;
}

// Message content: a string, or OpenAI's array of parts of which only {"type": "text"} is taken.
std::optional<ApiError> message_content(const json& c, const std::string& where, std::string& out) {
  if (c.is_string()) {
    out = c.get<std::string>();
    return std::nullopt;
  }
  if (!c.is_array()) return wrong_type(where, "a string or an array of text parts");
  for (size_t i = 0; i < c.size(); ++i) {
    const std::string part = where + "[" + std::to_string(i) + "]";
    const json& p = c[i];
    if (!p.is_object()) return wrong_type(part, "an object");
    std::string type, text;
    if (auto e = get_string(p, "type", type)) return bad_field(part + ".type", e->message, e->code);
    if (type != "text") {
      return bad_field(part + ".type", "only text content parts are supported (got '" + type + "')",
                       "unsupported_content");
    }
    if (auto e = get_string(p, "text", text)) return bad_field(part + ".text", e->message, e->code);
    out += text;
  }
  return std::nullopt;
}

std::optional<ApiError> parse_messages(const json& obj, std::vector<ChatMessage>& out) {
  const json* m = field(obj, "messages");
  if (!m) return bad_field("messages", "'messages' is required", "missing_field");
  if (!m->is_array()) return wrong_type("messages", "an array of messages");
  if (m->empty()) return bad_field("messages", "'messages' must hold at least one message");
  if (m->size() > kMaxMessages) return bad_field("messages", "too many messages");
  for (size_t i = 0; i < m->size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const json& msg = (*m)[i];
    if (!msg.is_object()) return wrong_type(where, "an object");
    ChatMessage cm;
    const json* role = field(msg, "role");
    if (!role)
      return bad_field(where + ".role", "'" + where + ".role' is required", "missing_field");
    if (!role->is_string()) return wrong_type(where + ".role", "a string");
    cm.role = role->get<std::string>();
    if (cm.role == "developer") cm.role = "system";  // OpenAI's newer name for it
    if (cm.role != "system" && cm.role != "user" && cm.role != "assistant") {
      return bad_field(where + ".role",
                       "role '" + cm.role + "' is not supported (system, user, assistant)");
    }
    if (const json* c = field(msg, "content")) {
      if (auto e = message_content(*c, where + ".content", cm.content)) return e;
    } else if (cm.role != "assistant") {
      return bad_field(where + ".content", "'" + where + ".content' is required", "missing_field");
    }
    out.push_back(std::move(cm));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json& obj, std::vector<std::string>& out) {
  const json* s = field(obj, "stop");
  if (!s) return std::nullopt;
  if (s->is_string()) {
    out.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    for (const json& x : *s) {
      if (!x.is_string()) return wrong_type("stop", "a string or an array of strings");
      out.push_back(x.get<std::string>());
    }
  } else {
    return wrong_type("stop", "a string or an array of strings");
  }
  if (out.size() > kMaxStops) {
    return bad_field("stop", "at most " + std::to_string(kMaxStops) + " stop strings are allowed");
  }
  for (const std::string& x : out) {
    if (x.empty()) return bad_field("stop", "stop strings must not be empty");
  }
  return std::nullopt;
}

// A list of token ids (`where` names it in errors); ids are range-checked later.
std::optional<ApiError> token_list(const json& a, const std::string& where,
                                   std::vector<int32_t>& out) {
  if (a.empty()) return bad_field(where, "'" + where + "' must not be empty");
  out.reserve(a.size());
  for (const json& x : a) {
    if (!x.is_number_integer()) return wrong_type(where, "a list of token ids");
    const int64_t id = x.is_number_unsigned() && x.get<uint64_t>() > INT32_MAX
                           ? int64_t{INT32_MAX} + 1
                           : x.get<int64_t>();
    if (id < 0 || id > INT32_MAX) {
      return bad_field(where, "token id " + x.dump() + " in '" + where + "' is out of range");
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

// "prompt": a string, a list of strings, a list of token ids, or a list of token-id lists.
std::optional<ApiError> parse_prompts(const json& obj, std::vector<CompletionPrompt>& out) {
  const json* p = field(obj, "prompt");
  if (!p) return bad_field("prompt", "'prompt' is required", "missing_field");
  const char* want = "a string, a list of strings, a list of token ids or a list of such lists";
  if (p->is_string()) {
    out.push_back({p->get<std::string>(), {}, false});
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    CompletionPrompt c;
    c.is_tokens = true;
    if (auto e = token_list(*p, "prompt", c.tokens)) return e;
    out.push_back(std::move(c));
  } else if (p->is_array() && !p->empty()) {
    if (p->size() > kMaxBatchPrompts) {
      return bad_field("prompt", "at most " + std::to_string(kMaxBatchPrompts) +
                                     " prompts per request (got " + std::to_string(p->size()) +
                                     ")");
    }
    for (size_t i = 0; i < p->size(); ++i) {
      const json& x = (*p)[i];
      const std::string where = "prompt[" + std::to_string(i) + "]";
      CompletionPrompt c;
      if (x.is_string()) {
        c.text = x.get<std::string>();
      } else if (x.is_array()) {
        c.is_tokens = true;
        if (auto e = token_list(x, where, c.tokens)) return e;
      } else {
        return wrong_type(where, "a string or a list of token ids");
      }
      out.push_back(std::move(c));
    }
  } else {
    return wrong_type("prompt", want);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].is_tokens && out[i].text.empty()) {
      const std::string where = out.size() > 1 ? "prompt[" + std::to_string(i) + "]" : "prompt";
      return bad_field(where, "'" + where + "' must not be empty");
    }
  }
  return std::nullopt;
}

// logprobs / top_logprobs (OpenAI's: an integer on completions; a boolean plus top_logprobs on
// chat) and echo.
std::optional<ApiError> parse_logprobs(const json& obj, Endpoint endpoint, GenerationRequest& out) {
  auto bounded = [](const char* name, int64_t v) -> std::optional<ApiError> {
    if (v < 0 || v > kMaxTopLogprobs) {
      return bad_field(name, "'" + std::string(name) + "' must be between 0 and " +
                                 std::to_string(kMaxTopLogprobs) + " (got " + std::to_string(v) +
                                 ")");
    }
    return std::nullopt;
  };
  if (endpoint == Endpoint::kCompletion) {
    std::optional<int64_t> n;
    if (auto e = get_int(obj, "logprobs", n)) return e;
    if (n) {
      if (auto e = bounded("logprobs", *n)) return e;
      out.logprobs = static_cast<int>(*n);
    }
    return get_bool(obj, "echo", out.echo);
  }
  bool on = false;
  if (auto e = get_bool(obj, "logprobs", on)) return e;
  std::optional<int64_t> top;
  if (auto e = get_int(obj, "top_logprobs", top)) return e;
  if (top) {
    if (auto e = bounded("top_logprobs", *top)) return e;
    if (!on) {
      return bad_field("top_logprobs", "'logprobs' must be true when 'top_logprobs' is given");
    }
  }
  if (on) out.logprobs = top ? static_cast<int>(*top) : 0;
  return std::nullopt;
}

// Extension "context_end": an integer for every prompt, or a list with one per prompt.
std::optional<ApiError> parse_context_end(const json& obj, GenerationRequest& out) {
  const json* c = field(obj, "context_end");
  if (!c) return std::nullopt;
  const size_t n_prompts = std::max<size_t>(1, out.prompts.size());
  auto one = [&](const json& x, const std::string& where) -> std::optional<ApiError> {
    if (!x.is_number_integer()) return wrong_type(where, "a positive integer (tokens)");
    const bool huge = x.is_number_unsigned() && x.get<uint64_t>() > INT32_MAX;
    if (huge || x.get<int64_t>() < 1 || x.get<int64_t>() > INT32_MAX) {
      return bad_field(where, "'" + where + "' must be at least 1 (tokens) (got " + x.dump() + ")");
    }
    out.context_end.push_back(x.get<int64_t>());
    return std::nullopt;
  };
  if (c->is_array()) {
    if (c->size() != n_prompts) {
      return bad_field("context_end", "'context_end' lists " + std::to_string(c->size()) +
                                          " values for " + std::to_string(n_prompts) + " prompts");
    }
    for (size_t i = 0; i < c->size(); ++i) {
      if (auto e = one((*c)[i], "context_end[" + std::to_string(i) + "]")) return e;
    }
    return std::nullopt;
  }
  if (auto e = one(*c, "context_end")) return e;
  out.context_end.assign(n_prompts, out.context_end[0]);
  return std::nullopt;
}

}  // namespace

ApiError bad_field(std::string_view field, std::string message, std::string code) {
  ApiError e;
  e.message = std::move(message);
  e.code = std::move(code);
  e.param = std::string(field);
  return e;
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {  // ASCII fast path
      ++i;
      continue;
    }
    const unicode::Utf8Step st = unicode::utf8_scan(s.substr(i));
    if (!st.valid || st.length == 0) return false;
    i += st.length;
  }
  return true;
}

std::optional<ApiError> apply_session_header(const std::string* header, GenerationRequest& g) {
  if (header == nullptr) return std::nullopt;
  if (!valid_session_id(*header)) {
    return bad_field("X-Session-Id",
                     "header 'X-Session-Id' must be 1-128 characters of letters, digits, '.', "
                     "'_', ':' or '-'",
                     "invalid_session_id");
  }
  if (g.session.empty()) {
    g.session = *header;
  } else if (g.session != *header) {
    return bad_field("X-Session-Id",
                     "header 'X-Session-Id' ('" + *header + "') differs from the body's 'session' ('" +
                         g.session + "')",
                     "invalid_session_id");
  }
  return std::nullopt;
}

bool valid_session_id(std::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::optional<ApiError> parse_generation_request(std::string_view body, Endpoint endpoint,
                                                 GenerationRequest& out) {
  json obj;
  if (auto e = parse_object(body, obj)) return e;
  out = GenerationRequest{};
  out.endpoint = endpoint;
  // OpenAI's sampling: temperature 1, nucleus off, no top-k or min-p.
  out.sampling.temperature = 1.0f;
  out.sampling.top_p = 1.0f;
  out.sampling.top_k = 0;
  out.sampling.min_p = 0.0f;
  if (auto e = get_string(obj, "model", out.model)) return e;
  if (endpoint == Endpoint::kChat) {
    if (auto e = parse_messages(obj, out.messages)) return e;
  } else {
    if (auto e = parse_prompts(obj, out.prompts)) return e;
    if (!out.prompts[0].is_tokens) out.prompt = out.prompts[0].text;
  }
  // max_tokens, or its newer name.
  std::optional<int64_t> max_tokens;
  if (auto e = get_int(obj, "max_tokens", max_tokens)) return e;
  const char* max_name = "max_tokens";
  if (!max_tokens) {
    if (auto e = get_int(obj, "max_completion_tokens", max_tokens)) return e;
    max_name = "max_completion_tokens";
  }
  if (max_tokens) {
    // 0 with echo: the prompt scored, nothing generated.
    const bool zero_ok = endpoint == Endpoint::kCompletion && *max_tokens == 0 &&
                         field(obj, "echo") && (*field(obj, "echo")).is_boolean() &&
                         (*field(obj, "echo")).get<bool>();
    if (*max_tokens < 0 || (*max_tokens == 0 && !zero_ok)) {
      return bad_field(max_name, "'" + std::string(max_name) + "' must be at least 1 (got " +
                                     std::to_string(*max_tokens) + ")");
    }
    out.max_tokens = static_cast<int>(std::min<int64_t>(*max_tokens, INT32_MAX));
  }
  std::optional<double> temperature, top_p;
  if (auto e = get_number(obj, "temperature", temperature)) return e;
  if (temperature) {
    if (!(*temperature >= 0 && *temperature <= 2)) {
      return bad_field("temperature", "'temperature' must be between 0 and 2");
    }
    out.sampling.temperature = static_cast<float>(*temperature);
  }
  if (auto e = get_number(obj, "top_p", top_p)) return e;
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) return bad_field("top_p", "'top_p' must be in (0, 1]");
    // A positive value too small for a float (1e-300) would round to 0, which the sampler
    // refuses; the smallest float keeps its meaning (only the most likely token).
    out.sampling.top_p = std::max(static_cast<float>(*top_p), std::numeric_limits<float>::min());
  }
  std::optional<int64_t> seed, n;
  if (auto e = get_int(obj, "seed", seed)) return e;
  if (seed) {
    out.sampling.seed = static_cast<uint64_t>(*seed);
    out.seed_given = true;
  }
  if (auto e = get_int(obj, "n", n)) return e;
  if (n && *n != 1) return bad_field("n", "only n = 1 is supported", "unsupported_value");
  if (auto e = parse_stop(obj, out.stop)) return e;
  if (auto e = get_bool(obj, "stream", out.stream)) return e;
  if (const json* so = field(obj, "stream_options")) {
    if (!so->is_object()) return wrong_type("stream_options", "an object");
    if (auto e = get_bool(*so, "include_usage", out.include_usage)) {
      return bad_field("stream_options.include_usage", e->message, e->code);
    }
  }
  if (auto e = get_bool(obj, "ignore_eos", out.ignore_eos)) return e;
  if (auto e = parse_logprobs(obj, endpoint, out)) return e;
  if (auto e = parse_context_end(obj, out)) return e;
  if (out.stream && out.prompts.size() > 1) {
    return bad_field("stream", "a stream carries one prompt; send the batch's prompts one by one",
                     "unsupported_value");
  }
  if (out.stream && out.echo) {
    return bad_field("echo", "'echo' is not supported with 'stream'", "unsupported_value");
  }
  if (auto e = get_string(obj, "kv", out.kv_spec)) return e;
  if (!out.kv_spec.empty()) {
    auto pol = parse_kv_policy(out.kv_spec);
    if (!pol.ok()) return bad_field("kv", "kv: " + pol.status().message(), "invalid_kv_spec");
  }
  if (auto e = get_string(obj, "session", out.session)) return e;
  if (field(obj, "session") && !valid_session_id(out.session)) {
    return bad_field("session",
                     "'session' must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
                     "invalid_session_id");
  }
  if (!out.session.empty() && out.prompts.size() > 1) {
    return bad_field("prompt", "a batch of prompts cannot continue a 'session'",
                     "unsupported_value");
  }
  if (!out.session.empty() && out.echo) {
    return bad_field("echo", "'echo' is not supported with 'session'", "unsupported_value");
  }
  if (!out.session.empty() && !out.context_end.empty()) {
    return bad_field("context_end",
                     "'context_end' is not supported with 'session' (a session's turns end "
                     "where its requests do)",
                     "unsupported_value");
  }
  return std::nullopt;
}

std::optional<ApiError> parse_tokenize_request(std::string_view body, TokenizeRequest& out) {
  json obj;
  if (auto e = parse_object(body, obj)) return e;
  out = TokenizeRequest{};
  const json* c = field(obj, "content");
  if (!c && field(obj, "prompt")) {  // vLLM's shape
    out.vllm = true;
    out.add_special = true;
    out.parse_special = true;
    if (auto e = get_string(obj, "prompt", out.content)) return e;
    return get_bool(obj, "add_special_tokens", out.add_special);
  }
  if (!c) return bad_field("content", "'content' is required", "missing_field");
  if (auto e = get_string(obj, "content", out.content)) return e;
  if (auto e = get_bool(obj, "add_special", out.add_special)) return e;
  if (auto e = get_bool(obj, "parse_special", out.parse_special)) return e;
  return std::nullopt;
}

std::optional<ApiError> parse_detokenize_request(std::string_view body, int n_vocab,
                                                 std::vector<int32_t>& out) {
  json obj;
  if (auto e = parse_object(body, obj)) return e;
  out.clear();
  const json* t = field(obj, "tokens");
  if (!t) return bad_field("tokens", "'tokens' is required", "missing_field");
  if (!t->is_array()) return wrong_type("tokens", "an array of token ids");
  for (const json& x : *t) {
    if (!x.is_number_integer()) return wrong_type("tokens", "an array of token ids");
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id >= n_vocab) {
      return bad_field("tokens", "token id " + std::to_string(id) +
                                     " is out of range (vocabulary size " +
                                     std::to_string(n_vocab) + ")");
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

}  // namespace d2o::serve
