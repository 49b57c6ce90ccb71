// Fuzz target: the HTTP server's request bodies (serve/api.h) and, for generation requests, the
// step after parsing (serve/prepare.h: the chat template, the tokenizer, the context limits).
//
// Input: byte 0 picks the endpoint (byte % 5: chat, completions, tokenize, detokenize, a session
// id) and, with byte / 5, the vocabulary (byte-level BPE or SentencePiece, see fuzz_vocabs.h) and
// the chat template (each named format, or none); byte 1 the context size (1 + byte); the rest is
// the body. Checked besides "no crash":
//   - valid_utf8 and valid_session_id agree with independent checks written here; the same
//     bytes as an X-Session-Id header are taken exactly when valid, and refused beside a body's
//     different session;
//   - every error is a 4xx with a message and a code, and its JSON body parses back;
//   - an accepted generation request holds what api.h documents: a known endpoint, at least one
//     message with a known role (chat) or a non-empty prompt, max_tokens >= 1, temperature in
//     [0, 2], top_p in (0, 1], sampler parameters the Sampler accepts, at most 16 non-empty stop
//     strings, a kv spec that parses, a valid session id, and every string valid UTF-8;
//   - a prepared job fits the context: a non-empty prompt of ids in range, 1 <= max_tokens <=
//     the room the prompt leaves, the request's stop strings and sampling carried over;
//   - accepted token ids are in range and decode.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_vocabs.h"
#include "gguf/gguf.h"
#include "kv/policy.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "serve/api.h"
#include "serve/format.h"
#include "serve/prepare.h"

namespace {

using d2o::serve::ApiError;
using d2o::serve::Endpoint;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_serve_request: %s\n", what);
  std::abort();
}
void check(bool ok, const char* what) {
  if (!ok) fail(what);
}

// RFC 3629's table of well-formed byte sequences, written out independently of the library's
// decoder: no overlong forms, no surrogates, nothing above U+10FFFF.
bool utf8_by_table(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  auto in = [](unsigned char c, unsigned lo, unsigned hi) { return c >= lo && c <= hi; };
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c < 0x80) {
      len = 1;
    } else if (in(c, 0xC2, 0xDF)) {
      len = 2;
    } else if (in(c, 0xE0, 0xEF)) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (in(c, 0xF0, 0xF4)) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i < len) return false;
    if (len > 1 && !in(p[i + 1], lo, hi)) return false;
    for (size_t k = 2; k < len; ++k) {
      if (!in(p[i + k], 0x80, 0xBF)) return false;
    }
    i += len;
  }
  return true;
}

bool session_id_by_rule(std::string_view id) {
  static const std::string_view kAllowed =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-";
  return !id.empty() && id.size() <= 128 && id.find_first_not_of(kAllowed) == std::string::npos;
}

struct Vocab {
  std::vector<uint8_t> bytes;
  std::unique_ptr<d2o::GgufFile> file;
  std::unique_ptr<d2o::Tokenizer> tok;
};

const std::vector<Vocab>& vocabs() {
  static const std::vector<Vocab> v = [] {
    std::vector<Vocab> out;
    // "smollm" splits like SmolLM2 and its vocabulary has the ChatML markers as control tokens.
    for (int k = 0; k < 2; ++k) {
      Vocab l;
      l.bytes = k == 0 ? d2o::fuzz::bpe_vocab_writer("smollm").to_bytes()
                       : d2o::fuzz::spm_vocab_writer().to_bytes();
      auto f = d2o::GgufFile::from_memory(l.bytes.data(), l.bytes.size(), "vocab");
      if (!f.ok()) fail(f.status().to_string().c_str());
      l.file = std::move(f).value();
      auto t = d2o::Tokenizer::from_gguf(*l.file);
      if (!t.ok()) fail(t.status().to_string().c_str());
      l.tok = std::move(t).value();
      out.push_back(std::move(l));
    }
    return out;
  }();
  return v;
}

const std::vector<d2o::ChatTemplate>& templates() {
  static const std::vector<d2o::ChatTemplate> t = [] {
    std::vector<d2o::ChatTemplate> out;
    for (const std::string& n : d2o::ChatTemplate::supported_names()) {
      out.push_back(*d2o::ChatTemplate::from_name(n));
    }
    return out;
  }();
  return t;
}

// Every error: a client error with a message and a code, whose JSON body parses back (user bytes
// in a message that are not valid UTF-8 come back replaced, never as a failed dump).
void check_error(const ApiError& e) {
  check(e.http_status >= 400 && e.http_status < 500, "an error is not a 4xx");
  check(!e.message.empty() && !e.code.empty() && !e.type.empty(), "an error lacks a field");
  const std::string body = d2o::serve::error_body(e);
  const auto j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  check(j.is_object() && j.contains("error") && j["error"]["message"].is_string(),
        "an error body does not parse back");
  if (utf8_by_table(e.message)) {
    check(j["error"]["message"].get<std::string>() == e.message, "an error message changed");
  }
}

void check_request(const d2o::serve::GenerationRequest& g, Endpoint ep) {
  check(g.endpoint == ep, "wrong endpoint");
  bool strings_ok = utf8_by_table(g.model) && utf8_by_table(g.prompt) && utf8_by_table(g.kv_spec) &&
                    utf8_by_table(g.session);
  if (ep == Endpoint::kChat) {
    check(!g.messages.empty() && g.messages.size() <= 100000, "message count out of bounds");
    check(g.prompt.empty(), "a chat request with a prompt");
    for (const d2o::ChatMessage& m : g.messages) {
      check(m.role == "system" || m.role == "user" || m.role == "assistant", "unknown role");
      strings_ok = strings_ok && utf8_by_table(m.content);
    }
  } else {
    check(g.messages.empty() && !g.prompts.empty() &&
              g.prompts.size() <= d2o::serve::kMaxBatchPrompts,
          "a completion request without a prompt, or too many");
    for (const d2o::serve::CompletionPrompt& p : g.prompts) {
      check(p.is_tokens ? !p.tokens.empty() && p.text.empty() : !p.text.empty() && p.tokens.empty(),
            "an empty prompt in a completion request");
      for (int32_t id : p.tokens) check(id >= 0, "a negative token id accepted");
      strings_ok = strings_ok && utf8_by_table(p.text);
    }
    check(g.prompts[0].is_tokens || g.prompt == g.prompts[0].text, "the first prompt's text lost");
    check(!g.stream || (g.prompts.size() == 1 && !g.echo), "a streamed batch or echo accepted");
  }
  check(!g.max_tokens || *g.max_tokens >= 1 || (*g.max_tokens == 0 && g.echo),
        "max_tokens below 1 (0 is for echo only)");
  check(g.logprobs >= -1 && g.logprobs <= d2o::kMaxTopLogprobs, "logprobs out of range");
  check(g.context_end.empty() || g.context_end.size() == std::max<size_t>(1, g.prompts.size()),
        "context_end not one per prompt");
  for (int64_t c : g.context_end) check(c >= 1, "a context end below 1");
  check(g.session.empty() || (!g.echo && g.context_end.empty()),
        "echo or context_end accepted with a session");
  const d2o::SamplerParams& s = g.sampling;
  check(s.temperature >= 0 && s.temperature <= 2, "temperature out of [0, 2]");
  check(s.top_p > 0 && s.top_p <= 1, "top_p out of (0, 1]");
  check(s.top_k == 0 && s.min_p == 0, "top_k / min_p are not OpenAI's");
  check(s.validate().ok(), "the sampler refuses an accepted request");
  check(g.stop.size() <= 16, "more than 16 stop strings");
  for (const std::string& x : g.stop) {
    check(!x.empty(), "an empty stop string");
    strings_ok = strings_ok && utf8_by_table(x);
  }
  check(strings_ok, "a string of an accepted request is not valid UTF-8");
  check(g.kv_spec.empty() || d2o::parse_kv_policy(g.kv_spec).ok(), "an accepted kv spec fails");
  check(g.session.empty() || session_id_by_rule(g.session), "an invalid session id accepted");
}

void check_job(const d2o::serve::GenerationRequest& g, const d2o::serve::Job& job,
               const d2o::Tokenizer& tok, int64_t n_ctx) {
  const int64_t n_prompt = std::ssize(job.prompt);
  const bool score_only = job.max_tokens == 0;
  check(score_only ? g.echo : job.max_tokens >= 1, "max_tokens 0 without echo");
  check(n_prompt >= 1 && (score_only ? n_prompt <= n_ctx : n_prompt < n_ctx),
        "the prompt does not fit the context");
  for (d2o::TokenId id : job.prompt)
    check(id >= 0 && id < tok.n_vocab(), "a prompt id out of range");
  check(job.max_tokens <= n_ctx - n_prompt, "max_tokens beyond the room");
  check(job.context_end >= 0 && job.context_end < n_prompt, "the context end outside the prompt");
  check(job.logprobs == g.logprobs && job.prompt_logprobs == (g.echo && g.logprobs >= 0),
        "log-probabilities lost");
  check(!g.max_tokens || *g.max_tokens == job.max_tokens, "max_tokens changed");
  check(job.stops.size() >= g.stop.size() &&
            std::equal(g.stop.begin(), g.stop.end(), job.stops.end() - std::ssize(g.stop)),
        "the request's stop strings are lost");
  check(
      job.sampling.temperature == g.sampling.temperature && job.sampling.top_p == g.sampling.top_p,
      "sampling changed");
  check(!g.seed_given || job.sampling.seed == g.sampling.seed, "the seed changed");
  auto pol = d2o::parse_kv_policy(job.kv_spec);
  check(pol.ok() && (*pol)->spec() == job.completion.kv_spec, "the job's policy is not canonical");
  check(job.session == g.session && job.completion.endpoint == g.endpoint, "fields lost");
}

void generation(Endpoint ep, std::string_view body, size_t variant, int64_t n_ctx) {
  d2o::serve::GenerationRequest g;
  if (auto e = d2o::serve::parse_generation_request(body, ep, g)) return check_error(*e);
  check_request(g, ep);
  const Vocab& v = vocabs()[variant % vocabs().size()];
  const size_t t = variant / vocabs().size() % (templates().size() + 1);
  const d2o::ChatTemplate* tmpl = t < templates().size() ? &templates()[t] : nullptr;
  d2o::serve::PrepareOptions po;
  po.n_ctx = n_ctx;
  po.default_max_tokens = 64;
  po.default_kv = "full";
  po.model_name = "fuzz";
  // One job per prompt of a completions batch.
  const size_t n_jobs = ep == Endpoint::kCompletion ? g.prompts.size() : 1;
  for (size_t i = 0; i < n_jobs; ++i) {
    d2o::serve::Job job;
    if (auto e = d2o::serve::prepare_job(g, *v.tok, tmpl, po, job, i)) {
      check(!e->param.empty(), "a prepare error names no field");
      return check_error(*e);
    }
    check_job(g, job, *v.tok, n_ctx);
  }
}

}  // namespace

// Builds the vocabularies once, before any input (and outside the per-input time limit).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  vocabs();
  templates();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int mode = data[0] % 5;
  const size_t variant = data[0] / 5;
  const int64_t n_ctx = 1 + data[1];
  const std::string_view body(reinterpret_cast<const char*>(data + 2), size - 2);
  check(d2o::serve::valid_utf8(body) == utf8_by_table(body), "valid_utf8 disagrees with RFC 3629");

  switch (mode) {
    case 0:
      generation(Endpoint::kChat, body, variant, n_ctx);
      break;
    case 1:
      generation(Endpoint::kCompletion, body, variant, n_ctx);
      break;
    case 2: {
      d2o::serve::TokenizeRequest t;
      if (auto e = d2o::serve::parse_tokenize_request(body, t)) return check_error(*e), 0;
      check(utf8_by_table(t.content), "tokenize content is not valid UTF-8");
      const d2o::Tokenizer& tok = *vocabs()[variant % vocabs().size()].tok;
      auto ids = tok.encode(t.content, d2o::EncodeOptions{t.add_special, t.parse_special});
      check(ids.ok(), "valid UTF-8 content does not encode");
      for (d2o::TokenId id : *ids) check(id >= 0 && id < tok.n_vocab(), "an id out of range");
      break;
    }
    case 3: {
      const d2o::Tokenizer& tok = *vocabs()[variant % vocabs().size()].tok;
      std::vector<int32_t> ids;
      if (auto e = d2o::serve::parse_detokenize_request(body, tok.n_vocab(), ids)) {
        return check_error(*e), 0;
      }
      for (int32_t id : ids) check(id >= 0 && id < tok.n_vocab(), "an accepted id out of range");
      check(tok.decode(ids, false).ok(), "accepted ids do not decode");
      break;
    }
    default: {
      check(d2o::serve::valid_session_id(body) == session_id_by_rule(body),
            "valid_session_id disagrees with its rule");
      // The same bytes as an X-Session-Id header, alone and beside a body's session: taken only
      // when valid, and a 400 naming the header otherwise or when the two differ.
      d2o::serve::GenerationRequest g;
      const std::string header(body);
      if (auto e = d2o::serve::apply_session_header(&header, g)) {
        check_error(*e);
        check(!session_id_by_rule(body) && e->param == "X-Session-Id" && g.session.empty(),
              "a valid header refused, or an error not naming the header");
      } else {
        check(session_id_by_rule(body) && g.session == header, "an invalid header accepted");
      }
      d2o::serve::GenerationRequest h;
      h.session = "body-session";
      auto e2 = d2o::serve::apply_session_header(&header, h);
      check(static_cast<bool>(e2) != (header == "body-session"), "header against body: wrong");
      break;
    }
  }
  return 0;
}
