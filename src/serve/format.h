// The HTTP API's responses in OpenAI's wire format: chat.completion and text_completion objects,
// their streamed chunks (Server-Sent Events, "data: {...}\n\n", the last one "data: [DONE]"),
// errors and the model list. d2o's additions ride along as extra fields that OpenAI clients
// ignore: `session` (the kept conversation: whether it was rebuilt or cut back to the prefix the
// messages share with it, its KV bytes against a full cache) and
// `usage.prompt_tokens_details.cached_tokens` (prompt tokens that were already in a kept cache,
// not prefilled again).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer.h"
#include "serve/api.h"

namespace d2o::serve {

struct Usage {
  int prompt_tokens = 0;      // the whole rendered prompt
  int cached_tokens = 0;      // of those, already in the session's cache (not prefilled)
  int completion_tokens = 0;  // generated
};

// What a kept conversation looks like after a request.
struct SessionInfo {
  std::string id;
  bool rebuilt = false;      // built again from the messages: nothing kept was used
  int64_t n_past = 0;        // tokens the conversation has seen
  size_t kv_bytes = 0;       // its cache's KV bytes now
  size_t full_kv_bytes = 0;  // what a full cache of n_past tokens would take
  // The messages left the kept tokens after a common prefix, and the kept cache was cut back to
  // that prefix (usage.cached_tokens of it) instead of being rebuilt.
  bool truncated = false;
  int64_t dropped_tokens = 0;  // kept tokens let go: past the prefix, or all of them (rebuilt)
};

// Everything a response is made of.
struct Completion {
  Endpoint endpoint = Endpoint::kChat;
  std::string id;  // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;
  std::string model;
  std::string kv_spec;  // canonical spec of the policy that ran
  std::string text;
  std::string finish_reason;  // "stop" or "length"
  Usage usage;
  std::optional<SessionInfo> session;
  // Log-probabilities (logprobs >= 0: asked for, with that many alternatives per token): of the
  // generated tokens, and with echo (completions) the prompt's, whose first token has none.
  // Tokens are shown as their pieces (tok).
  int logprobs = -1;
  bool echo = false;
  std::string echo_text;  // the prompt as text, before `text` in the answer
  std::vector<TokenId> prompt_tokens;
  std::vector<TokenLogprob> prompt_lps;  // [i]: prompt_tokens[i + 1]'s
  std::vector<TokenLogprob> lps;         // generated tokens'
  const Tokenizer* tok = nullptr;
};

// {"error": {...}} (dumped).
std::string error_body(const ApiError& e);
// The whole response of a non-streamed request.
std::string completion_body(const Completion& c);
// Several prompts' answers (completions with a batch of prompts): one choice each, `index` its
// prompt's place; the id, model and policy of the first; usage summed.
std::string batch_completion_body(std::span<const Completion> cs);
// One SSE event "data: {chunk}\n\n": a text delta (role on the first chat chunk), or the final
// chunk carrying finish_reason (and usage when asked for; the session extension always).
std::string chunk_event(const Completion& c, std::string_view delta, bool first);
// The same carrying the log-probabilities of the tokens generated since the last chunk (`lps`);
// `offset`: where the chunk's text begins in the answer (completions' text_offset), advanced.
std::string chunk_event(const Completion& c, std::string_view delta, bool first,
                        std::span<const TokenLogprob> lps, size_t& offset);
std::string final_chunk_event(const Completion& c, bool include_usage);
// A usage-only chunk (stream_options.include_usage) and the end marker.
std::string usage_chunk_event(const Completion& c);
std::string done_event();
// An error inside a stream (after the 200 was sent): "data: {"error": ...}\n\n".
std::string error_event(const ApiError& e);
// GET /v1/models.
std::string models_body(const std::string& model, int64_t created);

}  // namespace d2o::serve
