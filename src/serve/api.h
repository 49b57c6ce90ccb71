// The HTTP API's requests: JSON bodies of the OpenAI-compatible endpoints parsed and validated
// into plain structs, every problem an ApiError that names the field (OpenAI's error shape:
// {"error": {"message", "type", "code", "param"}}).
//
// Rules (as OpenAI's servers apply them): unknown fields are ignored; a known field of the wrong
// type is a 400 naming it; null counts as absent. Sampling defaults are OpenAI's (temperature 1,
// top_p 1, no top-k or min-p); temperature 0 is greedy. Extension fields: `kv` (a KV policy spec,
// parsed by parse_kv_policy, so the grammar and the messages are those of --kv) and `session`
// (a conversation whose compressed cache the server keeps between requests).
// Nothing here needs the model: sizes that depend on it (context, tokens) are checked later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/chat_template.h"
#include "runtime/sampler.h"

namespace d2o::serve {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string code;   // machine-readable ("invalid_type", "context_length_exceeded", ...)
  std::string param;  // the field at fault, "" when none
};

ApiError bad_field(std::string_view field, std::string message, std::string code = "invalid_value");

enum class Endpoint { kChat, kCompletion };

// One prompt of a completions request: text, or token ids (range-checked against the model's
// vocabulary when the job is prepared).
struct CompletionPrompt {
  std::string text;
  std::vector<int32_t> tokens;
  bool is_tokens = false;
};

// The most prompts one completions request may carry (a batch: "prompt" as a list).
inline constexpr size_t kMaxBatchPrompts = 64;

// A generation request (POST /v1/chat/completions or /v1/completions).
struct GenerationRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;                  // as given (informational)
  std::vector<ChatMessage> messages;  // chat
  std::string prompt;                 // completions: the first prompt when it is text
  // Completions: every prompt ("prompt" as a string, a list of strings, a list of token ids or
  // a list of such lists); one choice each, in this order.
  std::vector<CompletionPrompt> prompts;
  std::optional<int> max_tokens;      // absent: the server's default, bounded by the context
  SamplerParams sampling;
  bool seed_given = false;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::string kv_spec;         // "" = the server's --kv
  std::string session;         // "" = none
  bool ignore_eos = false;     // generate max_tokens even past an end-of-generation token
  // Log-probabilities: -1 none; else the alternatives per token (completions: `logprobs`;
  // chat: `top_logprobs`, with `logprobs: true`).
  int logprobs = -1;
  bool echo = false;  // completions: the prompt comes back before the answer (and its logprobs)
  // Extension `context_end`: the prompt's first N tokens are fed (and compressed) as a turn of
  // their own before the rest; one value for every prompt, or one per prompt. Empty: none.
  std::vector<int64_t> context_end;
};

// Parses a request body (the raw bytes: invalid UTF-8 and malformed JSON are reported as such).
// On success `out` is filled and nothing is returned.
std::optional<ApiError> parse_generation_request(std::string_view body, Endpoint endpoint,
                                                 GenerationRequest& out);

// POST /tokenize: {"content": "...", "add_special": false, "parse_special": false}; or vLLM's
// shape {"prompt": "...", "add_special_tokens": true} (special tokens written in the text are
// always those tokens, as a Hugging Face tokenizer reads them), answered in vLLM's shape.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool parse_special = false;
  bool vllm = false;  // the request came in vLLM's shape ("prompt")
};
std::optional<ApiError> parse_tokenize_request(std::string_view body, TokenizeRequest& out);

// POST /detokenize: {"tokens": [ids]}; ids are range-checked against n_vocab here.
std::optional<ApiError> parse_detokenize_request(std::string_view body, int n_vocab,
                                                 std::vector<int32_t>& out);

// Session ids: 1-128 characters of [A-Za-z0-9._:-].
bool valid_session_id(std::string_view id);

// The session id may also come as the header `X-Session-Id` (what a load balancer in front of
// several servers can hash on; see docs/SERVING.md). Given `header` (nullptr: no such header):
// a valid id becomes the request's session when the body names none; an invalid one, or one
// that differs from the body's, is a 400 naming the header.
std::optional<ApiError> apply_session_header(const std::string* header, GenerationRequest& g);

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or values above U+10FFFF).
bool valid_utf8(std::string_view s);

}  // namespace d2o::serve
