#include "serve/format.h"

#include <nlohmann/json.hpp>

namespace d2o::serve {

using json = nlohmann::json;

namespace {

// Generated text is valid UTF-8 by construction (StreamDecoder); user-supplied strings were
// validated. Replacing instead of throwing keeps a response from ever failing on a stray byte.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

const char* object_name(const Completion& c, bool chunk) {
  if (c.endpoint == Endpoint::kChat) return chunk ? "chat.completion.chunk" : "chat.completion";
  return "text_completion";
}

json usage_json(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json session_json(const SessionInfo& s) {
  return json{{"id", s.id},
              {"rebuilt", s.rebuilt},
              {"truncated", s.truncated},
              {"dropped_tokens", s.dropped_tokens},
              {"n_past", s.n_past},
              {"kv_bytes", s.kv_bytes},
              {"full_kv_bytes", s.full_kv_bytes}};
}

json base(const Completion& c, bool chunk) {
  json j{{"id", c.id},
         {"object", object_name(c, chunk)},
         {"created", c.created},
         {"model", c.model},
         {"system_fingerprint", "d2o-" + c.kv_spec}};
  return j;
}

std::string event(const json& j) {
  return "data: " + dump(j) + "\n\n";
}

json choice(const Completion& c, bool chunk, std::string_view text, const json& finish) {
  json ch{{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
  if (c.endpoint == Endpoint::kChat) {
    if (chunk) {
      ch["delta"] = json::object();
      if (!text.empty()) ch["delta"]["content"] = std::string(text);
    } else {
      ch["message"] = {{"role", "assistant"}, {"content", std::string(text)}};
    }
  } else {
    ch["text"] = std::string(text);
  }
  return ch;
}

}  // namespace

std::string error_body(const ApiError& e) {
  json err{{"message", e.message}, {"type", e.type}};
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  return dump(json{{"error", err}});
}

std::string completion_body(const Completion& c) {
  json j = base(c, false);
  j["choices"] = json::array({choice(c, false, c.text, c.finish_reason)});
  j["usage"] = usage_json(c.usage);
  if (c.session) {
    j["session"] = session_json(*c.session);
    j["session_rebuilt"] = c.session->rebuilt;
  }
  return dump(j);
}

std::string chunk_event(const Completion& c, std::string_view delta, bool first) {
  json j = base(c, true);
  json ch = choice(c, true, delta, nullptr);
  if (first && c.endpoint == Endpoint::kChat) ch["delta"]["role"] = "assistant";
  j["choices"] = json::array({ch});
  return event(j);
}

std::string final_chunk_event(const Completion& c, bool include_usage) {
  json j = base(c, true);
  j["choices"] = json::array({choice(c, true, "", c.finish_reason)});
  if (include_usage) j["usage"] = usage_json(c.usage);
  if (c.session) {
    j["session"] = session_json(*c.session);
    j["session_rebuilt"] = c.session->rebuilt;
  }
  return event(j);
}

std::string usage_chunk_event(const Completion& c) {
  json j = base(c, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(c.usage);
  return event(j);
}

std::string done_event() {
  return "data: [DONE]\n\n";
}

std::string error_event(const ApiError& e) {
  return "data: " + error_body(e) + "\n\n";
}

std::string models_body(const std::string& model, int64_t created) {
  json m{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "d2o"}};
  return dump(json{{"object", "list"}, {"data", json::array({m})}});
}

}  // namespace d2o::serve
