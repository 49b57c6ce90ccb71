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
                                    const ChatTemplate* tmpl, const PrepareOptions& o, Job& job,
                                    size_t index) {
  std::string text;
  EncodeOptions enc;
  const bool batch = g.prompts.size() > 1;
  const std::string where = batch ? "prompt[" + std::to_string(index) + "]" : "prompt";
  const CompletionPrompt* given =
      g.endpoint == Endpoint::kCompletion && index < g.prompts.size() ? &g.prompts[index] : nullptr;
  if (g.endpoint == Endpoint::kChat) {
    if (!tmpl) {
      return bad_field("messages", "this model has no chat template; use /v1/completions",
                       "no_chat_template");
    }
    text = tmpl->apply(g.messages, /*add_generation_prompt=*/true);
    enc.parse_special = true;  // the template's markers are special tokens
    for (const std::string& s : tmpl->stop_strings()) job.stops.push_back(s);
  } else if (given && !given->is_tokens) {
    text = given->text;
  } else if (!given) {
    text = g.prompt;
  }
  Result<std::vector<TokenId>> ids = std::vector<TokenId>();
  if (given && given->is_tokens) {
    for (TokenId t : given->tokens) {
      if (t < 0 || t >= tok.n_vocab()) {
        return bad_field(where, "token id " + std::to_string(t) + " in '" + where +
                                    "' is out of range (vocabulary size " +
                                    std::to_string(tok.n_vocab()) + ")");
      }
    }
    ids = given->tokens;
  } else {
    ids = tok.encode(text, enc);
  }
  if (!ids.ok())
    return bad_field(g.endpoint == Endpoint::kChat ? "messages" : where, ids.status().message());
  if (ids->empty()) return bad_field(where, "the prompt produced no tokens");
  const int64_t n_prompt = std::ssize(*ids);
  ApiError ctx;
  ctx.code = "context_length_exceeded";
  const bool score_only = g.max_tokens && *g.max_tokens == 0;  // echo: nothing generated
  if (score_only ? n_prompt > o.n_ctx : n_prompt >= o.n_ctx) {
    ctx.param = g.endpoint == Endpoint::kChat ? "messages" : where;
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
    job.max_tokens = *g.max_tokens;  // 0 only with echo (checked when parsed)
  } else {
    job.max_tokens = static_cast<int>(std::min<int64_t>(o.default_max_tokens, room));
  }
  if (!g.context_end.empty()) {
    const int64_t ce = g.context_end[std::min(index, g.context_end.size() - 1)];
    if (ce >= n_prompt) {
      const std::string f = g.context_end.size() > 1 && batch
                                ? "context_end[" + std::to_string(index) + "]"
                                : "context_end";
      return bad_field(f, "'" + f + "' is " + std::to_string(ce) + " but the prompt has " +
                              std::to_string(n_prompt) +
                              " tokens; the context must end before the prompt does");
    }
    job.context_end = ce;
  }
  job.logprobs = g.logprobs;
  job.prompt_logprobs = g.echo && g.logprobs >= 0;
  job.stream_logprobs = g.stream && g.logprobs >= 0;
  job.completion.logprobs = g.logprobs;
  job.completion.tok = &tok;
  if (g.echo) {
    job.completion.echo = true;
    if (given && given->is_tokens) {
      auto t = tok.decode(*ids, /*render_special=*/false);
      if (!t.ok()) return bad_field(where, t.status().message());
      job.completion.echo_text = *t;
    } else {
      job.completion.echo_text = text;
    }
    if (job.prompt_logprobs) job.completion.prompt_tokens = *ids;
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
