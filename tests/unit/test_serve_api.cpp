// The server's request parsing and validation (serve/api.h) and response formatting
// (serve/format.h): every rejection names its field, OpenAI's shapes hold.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kv/policy.h"
#include "serve/api.h"
#include "serve/format.h"
#include "serve/metrics.h"

namespace d2o::serve {
namespace {

using json = nlohmann::json;

std::optional<ApiError> chat(const std::string& body, GenerationRequest* out = nullptr) {
  GenerationRequest g;
  auto e = parse_generation_request(body, Endpoint::kChat, g);
  if (out) *out = g;
  return e;
}

constexpr const char* kMsg = R"("messages":[{"role":"user","content":"hi"}])";

std::string with(const std::string& extra) {
  return std::string("{") + kMsg + extra + "}";
}

TEST(ServeApi, ParsesAChatRequestWithOpenAiDefaults) {
  GenerationRequest g;
  ASSERT_FALSE(chat(with(R"(,"model":"x","unknown_field":{"a":1})"), &g));
  ASSERT_EQ(g.messages.size(), 1u);
  EXPECT_EQ(g.messages[0].role, "user");
  EXPECT_EQ(g.messages[0].content, "hi");
  EXPECT_FLOAT_EQ(g.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(g.sampling.top_p, 1.0f);
  EXPECT_EQ(g.sampling.top_k, 0);
  EXPECT_FALSE(g.max_tokens.has_value());
  EXPECT_FALSE(g.stream);
  EXPECT_FALSE(g.ignore_eos);
  EXPECT_FALSE(g.seed_given);
}

TEST(ServeApi, ParsesEveryField) {
  GenerationRequest g;
  ASSERT_FALSE(chat(
      std::string("{") + kMsg +
          R"(,"max_tokens":7,"temperature":0,"top_p":0.5,"seed":42,)"
          R"("stop":["a","bc"],"stream":true,"stream_options":{"include_usage":true},)"
          R"("kv":"d2o:ratio=0.2","session":"conv-1.a:b_c","n":1,"user":"u","ignore_eos":true})",
      &g));
  EXPECT_EQ(g.max_tokens.value_or(0), 7);
  EXPECT_FLOAT_EQ(g.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(g.sampling.top_p, 0.5f);
  EXPECT_EQ(g.sampling.seed, 42u);
  EXPECT_TRUE(g.seed_given);
  EXPECT_EQ(g.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(g.stream);
  EXPECT_TRUE(g.include_usage);
  EXPECT_EQ(g.kv_spec, "d2o:ratio=0.2");
  EXPECT_EQ(g.session, "conv-1.a:b_c");
  EXPECT_TRUE(g.ignore_eos);
}

TEST(ServeApi, ContentPartsAndRoles) {
  GenerationRequest g;
  ASSERT_FALSE(chat(R"({"messages":[{"role":"developer","content":[{"type":"text","text":"a"},)"
                    R"({"type":"text","text":"b"}]},{"role":"assistant","content":null}]})",
                    &g));
  ASSERT_EQ(g.messages.size(), 2u);
  EXPECT_EQ(g.messages[0].role, "system");
  EXPECT_EQ(g.messages[0].content, "ab");
  auto e = chat(R"({"messages":[{"role":"tool","content":"x"}]})");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages[0].role");
}

struct BadCase {
  const char* body;
  const char* param;  // expected field ("" = none)
  const char* code;
};

TEST(ServeApi, RejectsBadInputNamingTheField) {
  const BadCase cases[] = {
      {"", "", "empty_body"},
      {"{", "", "invalid_json"},
      {"[1,2]", "", "invalid_json"},
      {"{\"messages\": \"\xff\"}", "", "invalid_utf8"},
      {"{}", "messages", "missing_field"},
      {R"({"messages":5})", "messages", "invalid_type"},
      {R"({"messages":[]})", "messages", "invalid_value"},
      {R"({"messages":[{"content":"x"}]})", "messages[0].role", "missing_field"},
      {R"({"messages":[{"role":"user","content":5}]})", "messages[0].content", "invalid_type"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})",
       "messages[0].content[0].type", "unsupported_content"},
  };
  for (const BadCase& c : cases) {
    auto e = chat(c.body);
    ASSERT_TRUE(e) << c.body;
    EXPECT_EQ(e->http_status, 400) << c.body;
    EXPECT_EQ(e->param, c.param) << c.body;
    EXPECT_EQ(e->code, c.code) << c.body;
    EXPECT_FALSE(e->message.empty());
  }
  const BadCase fields[] = {
      {R"(,"max_tokens":"7")", "max_tokens", "invalid_type"},
      {R"(,"max_tokens":1.5)", "max_tokens", "invalid_type"},
      {R"(,"max_tokens":0)", "max_tokens", "invalid_value"},
      {R"(,"max_tokens":-3)", "max_tokens", "invalid_value"},
      {R"(,"max_completion_tokens":0)", "max_completion_tokens", "invalid_value"},
      {R"(,"temperature":"hot")", "temperature", "invalid_type"},
      {R"(,"temperature":2.5)", "temperature", "invalid_value"},
      {R"(,"top_p":0)", "top_p", "invalid_value"},
      {R"(,"seed":"1")", "seed", "invalid_type"},
      {R"(,"stop":5)", "stop", "invalid_type"},
      {R"(,"stop":[""])", "stop", "invalid_value"},
      {R"(,"stream":"yes")", "stream", "invalid_type"},
      {R"(,"stream_options":{"include_usage":1})", "stream_options.include_usage", "invalid_type"},
      {R"(,"n":2)", "n", "unsupported_value"},
      {R"(,"ignore_eos":"yes")", "ignore_eos", "invalid_type"},
      {R"(,"model":3)", "model", "invalid_type"},
      {R"(,"kv":5)", "kv", "invalid_type"},
      {R"(,"kv":"d2o:ratio=7")", "kv", "invalid_kv_spec"},
      {R"(,"kv":"nosuchpolicy")", "kv", "invalid_kv_spec"},
      {R"(,"session":"has space")", "session", "invalid_session_id"},
      {R"(,"session":"")", "session", "invalid_session_id"},
      {R"(,"session":7)", "session", "invalid_type"},
  };
  for (const BadCase& c : fields) {
    auto e = chat(with(c.body));
    ASSERT_TRUE(e) << c.body;
    EXPECT_EQ(e->http_status, 400) << c.body;
    EXPECT_EQ(e->param, c.param) << c.body;
    EXPECT_EQ(e->code, c.code) << c.body;
  }
  // A null is an absent field.
  EXPECT_FALSE(chat(with(R"(,"max_tokens":null,"stop":null,"kv":null)")));
}

TEST(ServeApi, KvErrorsAreTheParsersMessages) {
  auto e = chat(with(R"(,"kv":"d2o:ratio=7")"));
  ASSERT_TRUE(e);
  auto direct = parse_kv_policy("d2o:ratio=7");
  ASSERT_FALSE(direct.ok());
  EXPECT_EQ(e->message, "kv: " + direct.status().message());
}

TEST(ServeApi, CompletionPrompt) {
  GenerationRequest g;
  ASSERT_FALSE(parse_generation_request(R"({"prompt":["once"]})", Endpoint::kCompletion, g));
  EXPECT_EQ(g.prompt, "once");
  auto e = parse_generation_request(R"({"prompt":5})", Endpoint::kCompletion, g);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, "invalid_type");
}

// OpenAI's forms of "prompt": a list of strings, of token ids, of token-id lists.
TEST(ServeApi, CompletionPromptBatchesAndTokenIds) {
  GenerationRequest g;
  ASSERT_FALSE(parse_generation_request(R"({"prompt":["a","b"]})", Endpoint::kCompletion, g));
  ASSERT_EQ(g.prompts.size(), 2u);
  EXPECT_EQ(g.prompts[1].text, "b");
  EXPECT_EQ(g.prompt, "a");
  ASSERT_FALSE(parse_generation_request(R"({"prompt":[5,6,7]})", Endpoint::kCompletion, g));
  ASSERT_EQ(g.prompts.size(), 1u);
  EXPECT_TRUE(g.prompts[0].is_tokens);
  EXPECT_EQ(g.prompts[0].tokens, (std::vector<int32_t>{5, 6, 7}));
  ASSERT_FALSE(parse_generation_request(R"({"prompt":[[1,2],"x",[3]]})", Endpoint::kCompletion, g));
  ASSERT_EQ(g.prompts.size(), 3u);
  EXPECT_EQ(g.prompts[2].tokens, (std::vector<int32_t>{3}));
  EXPECT_FALSE(g.prompts[1].is_tokens);
  struct Bad {
    const char* body;
    const char* param;
  };
  for (const Bad& b :
       {Bad{R"({"prompt":[]})", "prompt"}, Bad{R"({"prompt":[[]]})", "prompt[0]"},
        Bad{R"({"prompt":[-1]})", "prompt"}, Bad{R"({"prompt":[["x"]]})", "prompt[0]"},
        Bad{R"({"prompt":[[1],2]})", "prompt[1]"}, Bad{R"({"prompt":[9999999999]})", "prompt"},
        Bad{R"({"prompt":[1.5]})", "prompt"}, Bad{R"({"prompt":["a",""]})", "prompt[1]"},
        Bad{R"({"prompt":["a","b"],"stream":true})", "stream"}}) {
    auto e = parse_generation_request(b.body, Endpoint::kCompletion, g);
    ASSERT_TRUE(e) << b.body;
    EXPECT_EQ(e->http_status, 400) << b.body;
    EXPECT_EQ(e->param, b.param) << b.body;
  }
  std::string many = R"({"prompt":[)";
  for (size_t i = 0; i <= kMaxBatchPrompts; ++i) many += std::string(i ? "," : "") + "\"x\"";
  many += "]}";
  auto e = parse_generation_request(many, Endpoint::kCompletion, g);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "prompt");
}

TEST(ServeApi, LogprobsEchoAndContextEnd) {
  GenerationRequest g;
  ASSERT_FALSE(parse_generation_request(R"({"prompt":"x"})", Endpoint::kCompletion, g));
  EXPECT_EQ(g.logprobs, -1);
  EXPECT_FALSE(g.echo);
  EXPECT_TRUE(g.context_end.empty());
  ASSERT_FALSE(parse_generation_request(R"({"prompt":"x","logprobs":3,"echo":true,"max_tokens":0})",
                                        Endpoint::kCompletion, g));
  EXPECT_EQ(g.logprobs, 3);
  EXPECT_TRUE(g.echo);
  EXPECT_EQ(g.max_tokens, 0);
  ASSERT_FALSE(parse_generation_request(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":20})",
      Endpoint::kChat, g));
  EXPECT_EQ(g.logprobs, 20);
  ASSERT_FALSE(parse_generation_request(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})", Endpoint::kChat, g));
  EXPECT_EQ(g.logprobs, 0);
  ASSERT_FALSE(parse_generation_request(R"({"prompt":["a","b"],"context_end":4})",
                                        Endpoint::kCompletion, g));
  EXPECT_EQ(g.context_end, (std::vector<int64_t>{4, 4}));
  ASSERT_FALSE(parse_generation_request(R"({"prompt":["a","b"],"context_end":[2,3]})",
                                        Endpoint::kCompletion, g));
  EXPECT_EQ(g.context_end, (std::vector<int64_t>{2, 3}));
  struct Bad {
    const char* body;
    const char* param;
  };
  const Endpoint C = Endpoint::kCompletion, K = Endpoint::kChat;
  const std::string m = R"("messages":[{"role":"user","content":"x"}])";
  const std::vector<std::pair<Endpoint, Bad>> bad = {
      {C, {R"({"prompt":"x","logprobs":21})", "logprobs"}},
      {C, {R"({"prompt":"x","logprobs":-1})", "logprobs"}},
      {C, {R"({"prompt":"x","logprobs":true})", "logprobs"}},
      {C, {R"({"prompt":"x","echo":1})", "echo"}},
      {C, {R"({"prompt":"x","max_tokens":0})", "max_tokens"}},
      {C, {R"({"prompt":"x","echo":true,"stream":true})", "echo"}},
      {C, {R"({"prompt":"x","echo":true,"session":"s"})", "echo"}},
      {C, {R"({"prompt":"x","context_end":0})", "context_end"}},
      {C, {R"({"prompt":"x","context_end":"3"})", "context_end"}},
      {C, {R"({"prompt":"x","context_end":[1,2]})", "context_end"}},
      {C, {R"({"prompt":["x","y"],"context_end":[1,-2]})", "context_end[1]"}},
      {C, {R"({"prompt":"x","context_end":2,"session":"s"})", "context_end"}},
      {C, {R"({"prompt":["x","y"],"session":"s"})", "prompt"}},
  };
  for (const auto& [ep, b] : bad) {
    auto e = parse_generation_request(b.body, ep, g);
    ASSERT_TRUE(e) << b.body;
    EXPECT_EQ(e->http_status, 400) << b.body;
    EXPECT_EQ(e->param, b.param) << b.body;
  }
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {"{" + m + R"(,"logprobs":2})", "logprobs"},
           {"{" + m + R"(,"top_logprobs":2})", "top_logprobs"},
           {"{" + m + R"(,"logprobs":true,"top_logprobs":21})", "top_logprobs"},
           {"{" + m + R"(,"logprobs":false,"top_logprobs":1})", "top_logprobs"}}) {
    auto e = parse_generation_request(body, K, g);
    ASSERT_TRUE(e) << body;
    EXPECT_EQ(e->param, param) << body;
  }
}

TEST(ServeApi, TokenizeInVllmShape) {
  TokenizeRequest t;
  ASSERT_FALSE(parse_tokenize_request(R"({"prompt":"a<b>"})", t));
  EXPECT_TRUE(t.vllm);
  EXPECT_TRUE(t.add_special);
  EXPECT_TRUE(t.parse_special);
  EXPECT_EQ(t.content, "a<b>");
  ASSERT_FALSE(
      parse_tokenize_request(R"({"model":"m","prompt":"a","add_special_tokens":false})", t));
  EXPECT_FALSE(t.add_special);
  ASSERT_FALSE(parse_tokenize_request(R"({"content":"a"})", t));
  EXPECT_FALSE(t.vllm);
  EXPECT_FALSE(t.add_special);
  auto e = parse_tokenize_request(R"({"prompt":3})", t);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "prompt");
}

// Found by fuzz_serve_request: a top_p in range as a double but below the smallest float was
// accepted, rounded to 0 and then refused by the scheduler ("top-p must be in (0, 1]").
TEST(ServeApi, AcceptedSamplingParametersAreOnesTheSamplerAccepts) {
  GenerationRequest g;
  ASSERT_FALSE(parse_generation_request(
      R"({"max_tokens":18446744073709551615,"prompt":"x","seed":9223372036854775807,)"
      R"("top_p":1e-300})",
      Endpoint::kCompletion, g));
  EXPECT_GT(g.sampling.top_p, 0.0f);
  EXPECT_TRUE(g.sampling.validate().ok()) << g.sampling.validate().to_string();
  EXPECT_EQ(g.max_tokens, INT32_MAX);
  ASSERT_FALSE(parse_generation_request(R"({"prompt":"x","temperature":1e-300,"top_p":1})",
                                        Endpoint::kCompletion, g));
  EXPECT_TRUE(g.sampling.validate().ok()) << g.sampling.validate().to_string();
}

TEST(ServeApi, TokenizeAndDetokenizeRequests) {
  TokenizeRequest t;
  ASSERT_FALSE(parse_tokenize_request(R"({"content":"x","add_special":true})", t));
  EXPECT_EQ(t.content, "x");
  EXPECT_TRUE(t.add_special);
  EXPECT_TRUE(parse_tokenize_request(R"({"content":1})", t));
  std::vector<int32_t> ids;
  ASSERT_FALSE(parse_detokenize_request(R"({"tokens":[1,2,3]})", 10, ids));
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 3}));
  auto e = parse_detokenize_request(R"({"tokens":[1,10]})", 10, ids);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "tokens");
}

TEST(ServeApi, Utf8AndSessionIds) {
  EXPECT_TRUE(valid_utf8("plain ascii"));
  EXPECT_TRUE(valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"));
  EXPECT_FALSE(valid_utf8("\xc3"));              // truncated
  EXPECT_FALSE(valid_utf8("\xc0\xaf"));          // overlong
  EXPECT_FALSE(valid_utf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_TRUE(valid_session_id("a"));
  EXPECT_TRUE(valid_session_id(std::string(128, 'x')));
  EXPECT_FALSE(valid_session_id(std::string(129, 'x')));
  EXPECT_FALSE(valid_session_id("a/b"));
}

TEST(ServeApi, SessionFromTheXSessionIdHeader) {
  GenerationRequest g;
  EXPECT_FALSE(apply_session_header(nullptr, g));
  EXPECT_EQ(g.session, "");
  const std::string id = "conv-7", other = "conv-8", bad = "a b";
  EXPECT_FALSE(apply_session_header(&id, g));
  EXPECT_EQ(g.session, "conv-7");
  EXPECT_FALSE(apply_session_header(&id, g)) << "the same id in body and header";
  auto differs = apply_session_header(&other, g);
  ASSERT_TRUE(differs);
  EXPECT_EQ(differs->http_status, 400);
  EXPECT_EQ(differs->param, "X-Session-Id");
  EXPECT_NE(differs->message.find("differs"), std::string::npos) << differs->message;
  GenerationRequest h;
  auto invalid = apply_session_header(&bad, h);
  ASSERT_TRUE(invalid);
  EXPECT_EQ(invalid->code, "invalid_session_id");
  EXPECT_EQ(h.session, "");
}

Completion sample(Endpoint ep) {
  Completion c;
  c.endpoint = ep;
  c.id = "chatcmpl-1";
  c.created = 123;
  c.model = "m";
  c.kv_spec = "full";
  c.text = "Hello \xc3\xa9";
  c.finish_reason = "stop";
  c.usage = {10, 4, 3};
  return c;
}

TEST(ServeFormat, ChatCompletionShape) {
  Completion c = sample(Endpoint::kChat);
  const json j = json::parse(completion_body(c));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello \xc3\xa9");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 10);
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
  EXPECT_EQ(j["usage"]["total_tokens"], 13);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
  EXPECT_FALSE(j.contains("session"));
  c.session = SessionInfo{"s", true, 20, 100, 400};
  const json k = json::parse(completion_body(c));
  EXPECT_EQ(k["session_rebuilt"], true);
  EXPECT_EQ(k["session"]["kv_bytes"], 100);
  EXPECT_EQ(k["session"]["full_kv_bytes"], 400);
  EXPECT_EQ(k["session"]["truncated"], false);
  EXPECT_EQ(k["session"]["dropped_tokens"], 0);
  c.session = SessionInfo{"s", false, 20, 100, 400, true, 7};
  const json t = json::parse(completion_body(c));
  EXPECT_EQ(t["session_rebuilt"], false);
  EXPECT_EQ(t["session"]["truncated"], true);
  EXPECT_EQ(t["session"]["dropped_tokens"], 7);
}

TEST(ServeFormat, CompletionAndStreamEvents) {
  Completion c = sample(Endpoint::kCompletion);
  EXPECT_EQ(json::parse(completion_body(c))["choices"][0]["text"], "Hello \xc3\xa9");
  EXPECT_EQ(json::parse(completion_body(c))["object"], "text_completion");
  Completion chat = sample(Endpoint::kChat);
  const std::string ev = chunk_event(chat, "Hi", true);
  ASSERT_EQ(ev.rfind("data: ", 0), 0u);
  ASSERT_EQ(ev.substr(ev.size() - 2), "\n\n");
  const json j = json::parse(ev.substr(6));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  EXPECT_EQ(j["choices"][0]["delta"]["content"], "Hi");
  EXPECT_EQ(j["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(
      json::parse(chunk_event(chat, "x", false).substr(6))["choices"][0]["delta"].contains("role"));
  const json f = json::parse(final_chunk_event(chat, true).substr(6));
  EXPECT_EQ(f["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(f["usage"]["total_tokens"], 13);
  const json u = json::parse(usage_chunk_event(chat).substr(6));
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(done_event(), "data: [DONE]\n\n");
}

TEST(ServeFormat, ErrorShape) {
  ApiError e = bad_field("max_tokens", "too big", "context_length_exceeded");
  const json j = json::parse(error_body(e));
  EXPECT_EQ(j["error"]["message"], "too big");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(j["error"]["param"], "max_tokens");
  ApiError plain;
  plain.message = "m";
  EXPECT_TRUE(json::parse(error_body(plain))["error"]["param"].is_null());
}

TEST(ServeMetrics, PrometheusText) {
  Metrics m;
  m.requests["ok"] = 3;
  m.by_policy["d2o:ratio=0.2"] = 2;
  m.kv_cap = 1024;
  m.kv_allocated = 100;
  m.session_bytes = 50;
  m.full_equivalent = 400;
  const std::string t = prometheus_text(m);
  EXPECT_NE(t.find("d2o_requests_total{outcome=\"ok\"} 3\n"), std::string::npos);
  EXPECT_NE(t.find("d2o_requests_total{outcome=\"error\"} 0\n"), std::string::npos);
  EXPECT_NE(t.find("d2o_policy_requests_total{policy=\"d2o:ratio=0.2\"} 2\n"), std::string::npos);
  EXPECT_NE(t.find("d2o_kv_cap_bytes 1024\n"), std::string::npos);
  EXPECT_NE(t.find("d2o_kv_allocated_bytes 150\n"), std::string::npos);
  EXPECT_NE(t.find("d2o_kv_saved_bytes 250\n"), std::string::npos);
  EXPECT_NE(t.find("# TYPE d2o_sequences_running gauge\n"), std::string::npos);
  EXPECT_EQ(t.find("d2o_key_"), std::string::npos);  // no keys: no per-key series

  m.by_key["alice"].requests["ok"] = 2;
  m.by_key["alice"].prompt_tokens = 30;
  m.by_key["alice"].prefilled_tokens = 10;
  m.by_key["alice"].generated_tokens = 7;
  m.by_key["bob"];
  const std::string k = prometheus_text(m);
  EXPECT_NE(k.find("# TYPE d2o_key_requests_total counter\n"), std::string::npos);
  EXPECT_NE(k.find("d2o_key_requests_total{key=\"alice\",outcome=\"ok\"} 2\n"), std::string::npos);
  EXPECT_NE(k.find("d2o_key_requests_total{key=\"bob\",outcome=\"rejected\"} 0\n"),
            std::string::npos);
  EXPECT_NE(k.find("d2o_key_prompt_tokens_total{key=\"alice\"} 30\n"), std::string::npos);
  EXPECT_NE(k.find("d2o_key_prefilled_tokens_total{key=\"alice\"} 10\n"), std::string::npos);
  EXPECT_NE(k.find("d2o_key_generated_tokens_total{key=\"alice\"} 7\n"), std::string::npos);
  EXPECT_NE(k.find("d2o_key_generated_tokens_total{key=\"bob\"} 0\n"), std::string::npos);
}

}  // namespace
}  // namespace d2o::serve
