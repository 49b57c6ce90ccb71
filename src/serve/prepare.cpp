#include "serve/prepare.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>

#include "kv/policy.h"

namespace d2o::serve {

namespace {

std::string next_id(Endpoint ep) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = ++counter;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%llx%06llx", ep == Endpoint::kChat ? "chatcmpl" : "cmpl",
                static_cast<unsigned long long>(std::time(nullptr)),
                static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace

std::optional<ApiError> prepare_job(const GenerationRequest& g, const Tokenizer& tok,
                                    const ChatTemplate* tmpl, const PrepareOptions& o, Job& job) {
  std::string text;
  EncodeOptions enc;
  if (g.endpoint == Endpoint::kChat) {
    if (!tmpl) {
      return bad_field("messages", "this model has no chat template; use /v1/completions",
                       "no_chat_template");
    }
    text = tmpl->apply(g.messages, /*add_generation_prompt=*/true);
    enc.parse_special = true;  // the template's markers are special tokens
    for (const std::string& s : tmpl->stop_strings()) job.stops.push_back(s);
  } else {
    text = g.prompt;
  }
  auto ids = tok.encode(text, enc);
  if (!ids.ok())
    return bad_field(g.endpoint == Endpoint::kChat ? "messages" : "prompt", ids.status().message());
  if (ids->empty()) return bad_field("prompt", "the prompt produced no tokens");
  const int64_t n_prompt = std::ssize(*ids);
  ApiError ctx;
  ctx.code = "context_length_exceeded";
  if (n_prompt >= o.n_ctx) {
    ctx.param = g.endpoint == Endpoint::kChat ? "messages" : "prompt";
    ctx.message = "the prompt has " + std::to_string(n_prompt) + " tokens; the context holds " +
                  std::to_string(o.n_ctx) + " tokens and at least one must be left to generate";
    return ctx;
  }
  const int64_t room = o.n_ctx - n_prompt;
  if (g.max_tokens) {
    if (*g.max_tokens > room) {
      ctx.param = "max_tokens";
      ctx.message = "max_tokens is " + std::to_string(*g.max_tokens) + " but the context of " +
                    std::to_string(o.n_ctx) + " tokens leaves " + std::to_string(room) +
                    " after the prompt's " + std::to_string(n_prompt);
      return ctx;
    }
    job.max_tokens = *g.max_tokens;
  } else {
    job.max_tokens = static_cast<int>(std::min<int64_t>(o.default_max_tokens, room));
  }
  job.prompt = std::move(*ids);
  job.sampling = g.sampling;
  if (!g.seed_given) {  // OpenAI: no seed, a different draw each time
    static std::atomic<uint64_t> seeds{0x5eed};
    job.sampling.seed = (static_cast<uint64_t>(std::time(nullptr)) << 20) ^ ++seeds;
  }
  for (const std::string& s : g.stop) job.stops.push_back(s);
  job.kv_spec = g.kv_spec.empty() ? o.default_kv : g.kv_spec;
  auto policy = parse_kv_policy(job.kv_spec);
  if (!policy.ok()) return bad_field("kv", "kv: " + policy.status().message(), "invalid_kv_spec");
  job.completion.kv_spec = (*policy)->spec();
  job.session = g.session;
  job.ignore_eos = g.ignore_eos;
  job.completion.endpoint = g.endpoint;
  job.completion.id = next_id(g.endpoint);
  job.completion.created = static_cast<int64_t>(std::time(nullptr));
  job.completion.model = o.model_name;
  return std::nullopt;
}

}  // namespace d2o::serve
