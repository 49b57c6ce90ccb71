// The HTTP front (serve/http_server.h) with several clients at once on a tiny random-weight
// model: every client's streamed answer joins to its plain answer, the quick endpoints answer
// meanwhile, a client that goes away mid-stream gets its job cancelled, and stop() ends the
// listener. Part of the ThreadSanitizer build (scripts/test.sh --tsan): handler threads, the
// engine thread and the stream providers share the jobs.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chat_template.h"
#include "serve/http_server.h"
#include "serve_fixture.h"

namespace d2o::serve {
namespace {

using json = nlohmann::json;

// The text of a Server-Sent Events answer: the deltas joined; `done` tells whether it ended
// with "data: [DONE]".
std::string streamed_text(const std::string& body, bool& done) {
  std::string text;
  done = false;
  for (size_t p = 0; (p = body.find("data: ", p)) != std::string::npos;) {
    const size_t end = body.find("\n\n", p);
    const std::string data = body.substr(p + 6, end - p - 6);
    p = end;
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    const json j = json::parse(data);
    if (!j["choices"].empty() && j["choices"][0].contains("text")) {
      text += j["choices"][0]["text"].get<std::string>();
    }
  }
  return text;
}

// Options of the servers below: any free port, the random model's name, an 8192-token context.
HttpOptions test_options(int http_threads) {
  HttpOptions ho;
  ho.port = 0;
  ho.http_threads = http_threads;
  ho.model_name = "random";
  ho.n_ctx = 8192;
  return ho;
}

TEST(ServeHttp, ConcurrentClientsStreamsAndADisconnect) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http", size_t{8} << 20, 4, 64));
  auto tmpl = ChatTemplate::from_name("chatml");
  ASSERT_TRUE(tmpl.ok());
  HttpOptions ho = test_options(8);
  HttpServer http(*st.service, *st.tok, &*tmpl, ho);
  ASSERT_TRUE(http.bind().ok());
  std::thread server([&] { http.run(); });
  const int port = http.port();

  constexpr int kClients = 4;
  std::vector<std::string> plain(kClients), streamed(kClients), failures(kClients);
  std::vector<int> done(kClients, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      httplib::Client cli("127.0.0.1", port);
      // Prompts of different lengths, of the random vocabulary's pieces "t<id>" (spelled so
      // that the tokenizer finds them: "t3".."t9" and their extensions "t30".."t99").
      std::string prompt = "t42t7t55t6";
      for (int k = 0; k < 2 * i; ++k) prompt += "t" + std::to_string(33 + 11 * k);
      json req{{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}, {"seed", 3}};
      auto r = cli.Post("/v1/completions", req.dump(), "application/json");
      if (!r || r->status != 200) {
        failures[i] = "completion: " + (r ? r->body : httplib::to_string(r.error()));
        return;
      }
      plain[i] = json::parse(r->body)["choices"][0]["text"].get<std::string>();
      req["stream"] = true;
      r = cli.Post("/v1/completions", req.dump(), "application/json");
      if (!r || r->status != 200) {
        failures[i] = "stream: " + (r ? r->body : httplib::to_string(r.error()));
        return;
      }
      bool ended = false;
      streamed[i] = streamed_text(r->body, ended);
      done[i] = ended;
      // The quick endpoints, while other clients' jobs run.
      auto t = cli.Post("/tokenize", R"({"content": "t5t6"})", "application/json");
      auto m = cli.Get("/metrics");
      auto d = cli.Post("/detokenize", R"({"tokens": [5, 6]})", "application/json");
      if (!t || t->status != 200 || !m || m->status != 200 || !d || d->status != 200 ||
          json::parse(d->body)["content"] != "t5t6") {
        failures[i] = "quick endpoints";
      }
    });
  }
  // A client that reads the first event of a long stream and goes away.
  std::thread leaver([&] {
    httplib::Client cli("127.0.0.1", port);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.set_header("Content-Type", "application/json");
    req.body = json{{"prompt", "t9t9"}, {"max_tokens", 6000}, {"stream", true}}.dump();
    req.content_receiver = [](const char*, size_t, uint64_t, uint64_t) { return false; };
    (void)cli.send(req);
  });
  for (std::thread& t : clients) t.join();
  leaver.join();

  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE("client " + std::to_string(i));
    EXPECT_EQ(failures[i], "");
    EXPECT_FALSE(plain[i].empty());
    EXPECT_EQ(streamed[i], plain[i]);
    EXPECT_TRUE(done[i]) << "the stream did not end with data: [DONE]";
  }
  // The engine notices the vanished client at its next step (the stream's next write fails, or
  // the response ends): the job ends as cancelled, long before its 6000 tokens.
  // (Metrics are published after each step: they may lag the answers a little.)
  Metrics m;
  while ((m = st.service->metrics()).requests["cancelled"] < 1 || m.requests["ok"] < 2 * kClients) {
    ASSERT_LE(m.requests["ok"], 2 * kClients) << "the abandoned stream ran to its end";
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  http.stop(1.0);
  server.join();
  EXPECT_EQ(st.service->metrics().requests["ok"], 2 * kClients);
}

// GET / is the chat page, compiled in from src/serve/chat.html: self-contained (no external
// script, style or font), talking to the server's own streaming endpoint; open without the API
// key (the page holds no data; it sends the key the user types), while the API stays closed.
TEST(ServeHttp, ChatPageIsServedWithoutTheKey) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http_page", size_t{8} << 20, 2, 8));
  HttpOptions ho = test_options(4);
  ho.api_keys = {{"default", "secret"}};
  HttpServer http(*st.service, *st.tok, nullptr, ho);
  ASSERT_TRUE(http.bind().ok());
  std::thread server([&] { http.run(); });
  httplib::Client cli("127.0.0.1", http.port());
  auto page = cli.Get("/");
  auto models = cli.Get("/v1/models");
  http.stop(1.0);
  server.join();
  ASSERT_TRUE(page && models);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  const std::string& html = page->body;
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos) << "the page is cut";
  EXPECT_NE(html.find("fetch(\"/v1/chat/completions\""), std::string::npos);
  EXPECT_NE(html.find("stream: true"), std::string::npos);
  for (const char* external : {"http://", "https://", "src=", "<link", "@import"}) {
    EXPECT_EQ(html.find(external), std::string::npos) << "external asset: " << external;
  }
  EXPECT_EQ(models->status, 401);
}

// The session id as a header (X-Session-Id, what a load balancer hashes on): the second turn
// names the session the first one opened (one session is kept, under that id); an id that
// differs from the body's is a 400.
TEST(ServeHttp, SessionFromTheHeader) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http_sid", size_t{8} << 20, 2, 8));
  HttpOptions ho = test_options(4);
  HttpServer http(*st.service, *st.tok, nullptr, ho);
  ASSERT_TRUE(http.bind().ok());
  std::thread server([&] { http.run(); });
  httplib::Client cli("127.0.0.1", http.port());
  const httplib::Headers sid{{"X-Session-Id", "conv-h"}};
  json req{{"prompt", "t42t7t55t6"}, {"max_tokens", 4}, {"temperature", 0}};
  auto first = cli.Post("/v1/completions", sid, req.dump(), "application/json");
  req["prompt"] = "t42t7t55t6t9";
  auto second = cli.Post("/v1/completions", sid, req.dump(), "application/json");
  req["session"] = "conv-other";
  auto differs = cli.Post("/v1/completions", sid, req.dump(), "application/json");
  http.stop(1.0);
  server.join();
  ASSERT_TRUE(first && second && differs);
  ASSERT_EQ(first->status, 200) << first->body;
  ASSERT_EQ(second->status, 200) << second->body;
  const json a = json::parse(first->body), b = json::parse(second->body);
  EXPECT_EQ(a["session"]["id"], "conv-h");
  EXPECT_EQ(b["session"]["id"], "conv-h");
  EXPECT_EQ(st.service->metrics().sessions, 1);
  EXPECT_EQ(differs->status, 400);
  EXPECT_EQ(json::parse(differs->body)["error"]["param"], "X-Session-Id");
}

// Several API keys (serve/api_keys.h): no key or a wrong one is a 401; a key's session id is
// its own (Bob naming Alice's session gets the very response of an id never used, but for the
// id and time fields); with several keys only the admin key reads /metrics (403 for the others,
// for all when no admin is named), and /metrics counts requests and tokens per key name. A
// single key reads /metrics as before.
TEST(ServeHttp, KeysNamespaceSessionsAndGuardMetrics) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http_keys", size_t{8} << 20, 2, 8));
  const std::string alice = "alice-key-0123456789", bob = "bob-key-0123456789abc",
                    ops = "ops-key-0123456789abcd";
  auto serve = [&](std::vector<ApiKey> keys, std::string admin, auto&& client) {
    HttpOptions ho = test_options(4);
    ho.api_keys = std::move(keys);
    ho.admin_key_name = std::move(admin);
    HttpServer http(*st.service, *st.tok, nullptr, ho);
    ASSERT_TRUE(http.bind().ok());
    std::thread server([&] { http.run(); });
    httplib::Client cli("127.0.0.1", http.port());
    client(cli);
    http.stop(1.0);
    server.join();
  };
  auto as = [](const std::string& key) {
    return httplib::Headers{{"Authorization", "Bearer " + key}};
  };
  auto post = [&](httplib::Client& cli, const std::string& key, const json& body) {
    auto r = cli.Post("/v1/completions", as(key), body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
    return r ? json::parse(r->body) : json();
  };
  // The response of a request but its id, creation time and the session's own id.
  auto shape = [](json j) {
    j.erase("id");
    j.erase("created");
    j["session"].erase("id");
    return j;
  };
  serve({{"alice", alice}, {"bob", bob}, {"ops", ops}}, "ops", [&](httplib::Client& cli) {
    auto none = cli.Get("/v1/models");
    auto wrong = cli.Get("/v1/models", as(alice + "x"));
    auto bare = cli.Get("/v1/models", httplib::Headers{{"Authorization", alice}});
    ASSERT_TRUE(none && wrong && bare);
    EXPECT_EQ(none->status, 401);
    EXPECT_EQ(json::parse(none->body)["error"]["code"], "missing_api_key");
    EXPECT_EQ(wrong->status, 401);
    EXPECT_EQ(json::parse(wrong->body)["error"]["code"], "invalid_api_key");
    EXPECT_EQ(bare->status, 401);
    auto health = cli.Get("/health");
    ASSERT_TRUE(health);
    EXPECT_EQ(health->status, 200);

    json turn{{"prompt", "t42t7t55t6"}, {"max_tokens", 4}, {"temperature", 0}, {"session", "conv"}};
    const json a1 = post(cli, alice, turn);
    // (Without namespaces Bob's request would continue Alice's session, or rebuild it.)
    turn["prompt"] = "t42t7t55t6" + a1["choices"][0]["text"].get<std::string>() + "t9t8";
    const json b = post(cli, bob, turn);
    turn["session"] = "never-used";
    const json fresh = post(cli, bob, turn);
    EXPECT_EQ(b["session"]["id"], "conv");
    EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    EXPECT_EQ(shape(b), shape(fresh));

    auto forbidden = cli.Get("/metrics", as(alice));
    auto allowed = cli.Get("/metrics", as(ops));
    ASSERT_TRUE(forbidden && allowed);
    EXPECT_EQ(forbidden->status, 403);
    const json e = json::parse(forbidden->body)["error"];
    EXPECT_EQ(e["code"], "admin_key_required");
    EXPECT_EQ(e["type"], "permission_error");
    EXPECT_EQ(forbidden->body.find("d2o_"), std::string::npos);
    EXPECT_EQ(allowed->status, 200);
    const std::string& text = allowed->body;
    EXPECT_NE(text.find("d2o_key_requests_total{key=\"alice\",outcome=\"ok\"} 1\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("d2o_key_requests_total{key=\"bob\",outcome=\"ok\"} 2\n"),
              std::string::npos);
    EXPECT_NE(text.find("d2o_key_generated_tokens_total{key=\"bob\"} 8\n"), std::string::npos);
  });
  // Several keys and no admin: /metrics is closed to all of them.
  serve({{"alice", alice}, {"bob", bob}}, "", [&](httplib::Client& cli) {
    for (const std::string& key : {alice, bob}) {
      auto m = cli.Get("/metrics", as(key));
      ASSERT_TRUE(m);
      EXPECT_EQ(m->status, 403);
    }
  });
  // One key: it reads /metrics as before.
  serve({{"default", alice}}, "", [&](httplib::Client& cli) {
    auto m = cli.Get("/metrics", as(alice));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->status, 200);
  });
}

}  // namespace
}  // namespace d2o::serve
