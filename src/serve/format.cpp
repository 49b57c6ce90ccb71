#include "serve/format.h"

#include <cmath>
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

std::string piece(const Completion& c, TokenId id) {
  if (!c.tok) return std::string();
  auto p = c.tok->token_to_piece(id, /*render_special=*/true);
  return p.ok() ? *p : std::string();
}

// JSON has no infinities: a token the model rules out entirely gets -9999.
double finite(float lp) {
  return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0;
}

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
  return b;
}

// Completions' legacy shape: {tokens, token_logprobs, top_logprobs, text_offset}. With `first`
// (echo), the prompt's first token leads, its log-probability and alternatives null.
json legacy_logprobs(const Completion& c, const TokenId* first, std::span<const TokenLogprob> lps,
                     size_t& offset) {
  json tokens = json::array(), values = json::array(), tops = json::array(),
       offsets = json::array();
  auto add = [&](const std::string& p, const json& v, const json& top) {
    tokens.push_back(p);
    values.push_back(v);
    tops.push_back(top);
    offsets.push_back(offset);
    offset += p.size();
  };
  if (first) add(piece(c, *first), nullptr, nullptr);
  for (const TokenLogprob& t : lps) {
    json top = json::object();
    for (const auto& [id, lp] : t.top) top[piece(c, id)] = finite(lp);
    top[piece(c, t.token)] = finite(t.logprob);  // the token itself is always there (OpenAI)
    add(piece(c, t.token), finite(t.logprob), top);
  }
  return json{{"tokens", tokens},
              {"token_logprobs", values},
              {"top_logprobs", tops},
              {"text_offset", offsets}};
}

// Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
json chat_logprobs(const Completion& c, std::span<const TokenLogprob> lps) {
  json content = json::array();
  for (const TokenLogprob& t : lps) {
    const std::string p = piece(c, t.token);
    json top = json::array();
    for (const auto& [id, lp] : t.top) {
      const std::string q = piece(c, id);
      top.push_back(json{{"token", q}, {"logprob", finite(lp)}, {"bytes", bytes_of(q)}});
    }
    content.push_back(json{{"token", p},
                           {"logprob", finite(t.logprob)},
                           {"bytes", bytes_of(p)},
                           {"top_logprobs", top}});
  }
  return json{{"content", content}, {"refusal", nullptr}};
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

// The choice of a whole (not streamed) answer.
json full_choice(const Completion& c) {
  json ch = choice(c, false, c.echo ? c.echo_text + c.text : c.text, c.finish_reason);
  if (c.logprobs < 0) return ch;
  size_t offset = 0;
  if (c.echo) {
    const TokenId* first = c.prompt_tokens.empty() ? nullptr : &c.prompt_tokens[0];
    std::vector<TokenLogprob> all = c.prompt_lps;
    all.insert(all.end(), c.lps.begin(), c.lps.end());
    ch["logprobs"] = legacy_logprobs(c, first, all, offset);
  } else {
    ch["logprobs"] = c.endpoint == Endpoint::kChat ? chat_logprobs(c, c.lps)
                                                   : legacy_logprobs(c, nullptr, c.lps, offset);
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
  j["choices"] = json::array({full_choice(c)});
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

std::string batch_completion_body(std::span<const Completion> cs) {
  json j = base(cs[0], false);
  json choices = json::array();
  Usage u;
  for (size_t i = 0; i < cs.size(); ++i) {
    json ch = full_choice(cs[i]);
    ch["index"] = i;
    choices.push_back(std::move(ch));
    u.prompt_tokens += cs[i].usage.prompt_tokens;
    u.cached_tokens += cs[i].usage.cached_tokens;
    u.completion_tokens += cs[i].usage.completion_tokens;
  }
  j["choices"] = std::move(choices);
  j["usage"] = usage_json(u);
  return dump(j);
}

std::string chunk_event(const Completion& c, std::string_view delta, bool first,
                        std::span<const TokenLogprob> lps, size_t& offset) {
  json j = base(c, true);
  json ch = choice(c, true, delta, nullptr);
  if (first && c.endpoint == Endpoint::kChat) ch["delta"]["role"] = "assistant";
  if (c.logprobs >= 0) {
    if (c.endpoint == Endpoint::kChat) {
      ch["logprobs"] = chat_logprobs(c, lps);
    } else {
      // text_offset: the chunk's tokens laid end to end from where its text begins.
      size_t at = offset;
      ch["logprobs"] = legacy_logprobs(c, nullptr, lps, at);
    }
  }
  offset += delta.size();
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
