// The HTTP front (serve/http_server.h) with several clients at once on a tiny random-weight
// model: every client's streamed answer joins to its plain answer, the quick endpoints answer
// meanwhile, a client that goes away mid-stream gets its job cancelled, and stop() ends the
// listener. Part of the ThreadSanitizer build (scripts/test.sh --tsan): handler threads, the
// engine thread and the stream providers share the jobs.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
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

// A raw connection to the server (for what httplib's client does not do: slow headers,
// pipelining); -1 when it cannot connect.
int connect_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

// Reads what arrives on fd until it holds `want` occurrences of `needle`, the peer closes, or
// `ms` pass.
std::string read_raw(int fd, int ms, const std::string& needle = "", int want = 1) {
  std::string got;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    int n_found = 0;
    for (size_t p = 0; !needle.empty() && (p = got.find(needle, p)) != std::string::npos;
         p += needle.size())
      ++n_found;
    if (!needle.empty() && n_found >= want) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

bool peer_closed(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, ms) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) == 0;
}

// Clients that send their header a line at a time hold no handler thread (serve/http_gate.h):
// with 64 of them trickling against 4 threads and room for 16 waiting connections, /health
// answers at once throughout; each slow connection is answered 408 at the request timeout, or
// 503 when newer connections pushed it out of the waiting room, and closed. Kept-alive
// connections serve pipelined requests in order and close when idle past their timeout.
TEST(ServeHttp, SlowHeadersHoldNoThreadAndTimeOut) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http_gate", size_t{8} << 20, 2, 8));
  HttpOptions ho = test_options(4);
  ho.request_timeout_s = 1.0;
  ho.keep_alive_timeout_s = 1;
  ho.max_waiting = 16;
  ho.max_conn_per_addr = 0;  // every client here is 127.0.0.1 (test_serve_gate.cpp bounds it)
  HttpServer http(*st.service, *st.tok, nullptr, ho);
  ASSERT_TRUE(http.bind().ok());
  std::thread server([&] { http.run(); });
  const int port = http.port();

  constexpr int kSlow = 64;
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = connect_raw(port);
    ASSERT_GE(fd, 0);
    const std::string start = "GET /health HTTP/1.1\r\nHost: x\r\n";
    ASSERT_EQ(::send(fd, start.data(), start.size(), MSG_NOSIGNAL), std::ssize(start));
    slow.push_back(fd);
  }
  // A header line every 50 ms to each, until the server answers it and closes.
  std::vector<std::string> replies(kSlow);
  std::vector<bool> ended(kSlow, false);
  std::thread trickle([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until &&
           std::count(ended.begin(), ended.end(), false) > 0) {
      for (int i = 0; i < kSlow; ++i) {
        if (ended[i]) continue;
        pollfd p{slow[i], POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) {  // answered: read it, send no more
          char buf[512];
          const ssize_t n = ::recv(slow[i], buf, sizeof buf, MSG_DONTWAIT);
          if (n > 0) replies[i].append(buf, static_cast<size_t>(n));
          if (n == 0 || (n < 0 && errno != EAGAIN)) ended[i] = true;
          continue;
        }
        (void)::send(slow[i], "X-Slow: 1\r\n", 11, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(3, 0);
  cli.set_read_timeout(3, 0);
  for (int k = 0; k < 8; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = cli.Get("/health");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(r) << "no answer while slow clients wait";
    EXPECT_EQ(r->status, 200);
    EXPECT_LT(s, 1.0) << "request " << k;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  trickle.join();
  int timed_out = 0, pushed_out = 0;
  for (int i = 0; i < kSlow; ++i) {
    SCOPED_TRACE("slow connection " + std::to_string(i));
    EXPECT_TRUE(ended[i]) << "still open";
    timed_out += replies[i].rfind("HTTP/1.1 408 ", 0) == 0;
    pushed_out += replies[i].rfind("HTTP/1.1 503 ", 0) == 0;
    ::close(slow[i]);
  }
  EXPECT_EQ(timed_out + pushed_out, kSlow);
  EXPECT_GE(timed_out, 1);
  EXPECT_GE(pushed_out, 1);

  // Two requests in one write: two answers, in order, on one connection; idle past the
  // keep-alive timeout, it is closed.
  const int fd = connect_raw(port);
  ASSERT_GE(fd, 0);
  const std::string two =
      "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, two.data(), two.size(), MSG_NOSIGNAL), std::ssize(two));
  const std::string both = read_raw(fd, 3000, "\"random\"");  // the second body
  const size_t health = both.find("{\"status\":\"ok\"}"), models = both.find("\"random\"");
  EXPECT_NE(health, std::string::npos) << both;
  EXPECT_NE(models, std::string::npos) << both;
  EXPECT_LT(health, models);
  const std::string third = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, third.data(), third.size(), MSG_NOSIGNAL), std::ssize(third));
  EXPECT_EQ(read_raw(fd, 3000, "{\"status\":\"ok\"}").rfind("HTTP/1.1 200 ", 0), 0u);
  EXPECT_TRUE(peer_closed(fd, 3000)) << "an idle kept-alive connection stays open";
  ::close(fd);
  http.stop(1.0);
  server.join();
}

// Log-probabilities, echo, token-id prompts and batches, and vLLM's tokenizer endpoints.
TEST(ServeHttp, LogprobsEchoBatchesAndTokenizerEndpoints) {
  test::ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_http_lp", size_t{8} << 20, 4, 64));
  auto tmpl = ChatTemplate::from_name("chatml");
  ASSERT_TRUE(tmpl.ok());
  HttpServer http(*st.service, *st.tok, &*tmpl, test_options(4));
  ASSERT_TRUE(http.bind().ok());
  std::thread server([&] { http.run(); });
  httplib::Client cli("127.0.0.1", http.port());
  auto post = [&](const std::string& path, const json& body) {
    auto r = cli.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r);
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string());
  };

  // vLLM's /tokenize and /tokenizer_info; /detokenize answers under both names.
  auto [ts, tb] = post("/tokenize", json{{"prompt", "t42t7t55t6"}});
  ASSERT_EQ(ts, 200) << tb;
  const json tj = json::parse(tb);
  const std::vector<int> ids = tj["tokens"].get<std::vector<int>>();
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(tj["count"], ids.size());
  EXPECT_EQ(tj["max_model_len"], 8192);
  auto [ds, db] = post("/detokenize", json{{"tokens", ids}});
  ASSERT_EQ(ds, 200);
  EXPECT_EQ(json::parse(db)["prompt"], "t42t7t55t6");
  EXPECT_EQ(json::parse(db)["content"], "t42t7t55t6");
  auto info = cli.Get("/tokenizer_info");
  ASSERT_TRUE(info);
  ASSERT_EQ(info->status, 200);
  EXPECT_EQ(json::parse(info->body)["model_max_length"], 8192);

  // The same prompt as text and as ids, echoed and scored: the first token has no value, the
  // others one each, then the generated token.
  const json text_req{{"prompt", "t42t7t55t6"},
                      {"max_tokens", 1},
                      {"temperature", 0},
                      {"logprobs", 2},
                      {"echo", true}};
  auto [s1, b1] = post("/v1/completions", text_req);
  ASSERT_EQ(s1, 200) << b1;
  json id_req = text_req;
  id_req["prompt"] = ids;
  auto [s2, b2] = post("/v1/completions", id_req);
  ASSERT_EQ(s2, 200) << b2;
  const json c1 = json::parse(b1)["choices"][0], c2 = json::parse(b2)["choices"][0];
  EXPECT_EQ(c1["logprobs"], c2["logprobs"]);
  EXPECT_EQ(c1["text"], c2["text"]);
  const json& lp = c1["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 1);
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size() + 1);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t k = 1; k < lp["token_logprobs"].size(); ++k) {
    const double v = lp["token_logprobs"][k].get<double>();
    EXPECT_LE(v, 0.0);
    // The token itself and its 2 alternatives (fewer when it is one of them).
    const json& top = lp["top_logprobs"][k];
    EXPECT_GE(top.size(), 2u);
    EXPECT_LE(top.size(), 3u);
    EXPECT_EQ(top[lp["tokens"][k].get<std::string>()], v);
  }
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(c1["text"].get<std::string>().rfind("t42t7t55t6", 0), 0u);

  // Scored only (max_tokens 0), and a batch: one choice per prompt, in order, each what it is
  // alone.
  json zero = id_req;
  zero["max_tokens"] = 0;
  auto [s3, b3] = post("/v1/completions", zero);
  ASSERT_EQ(s3, 200) << b3;
  const json z = json::parse(b3);
  EXPECT_EQ(z["choices"][0]["text"], "t42t7t55t6");
  EXPECT_EQ(z["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(z["usage"]["completion_tokens"], 0);
  EXPECT_EQ(z["choices"][0]["logprobs"]["token_logprobs"].size(), ids.size());
  json batch = id_req;
  batch["prompt"] = json::array({ids, "t9t8", json::array({5, 6, 7})});
  auto [s4, b4] = post("/v1/completions", batch);
  ASSERT_EQ(s4, 200) << b4;
  const json bj = json::parse(b4);
  ASSERT_EQ(bj["choices"].size(), 3u);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bj["choices"][k]["index"], k);
  EXPECT_EQ(bj["choices"][0]["logprobs"], c1["logprobs"]);
  EXPECT_EQ(bj["choices"][2]["logprobs"]["tokens"].size(), 4u);

  // Generated tokens' values, plain and streamed, on both endpoints.
  const json gen{{"prompt", "t42t7"},
                 {"max_tokens", 5},
                 {"temperature", 0},
                 {"logprobs", 3},
                 {"ignore_eos", true}};
  auto [s5, b5] = post("/v1/completions", gen);
  ASSERT_EQ(s5, 200) << b5;
  const json plain_lp = json::parse(b5)["choices"][0]["logprobs"];
  EXPECT_EQ(plain_lp["tokens"].size(), 5u);
  json sgen = gen;
  sgen["stream"] = true;
  auto [s6, b6] = post("/v1/completions", sgen);
  ASSERT_EQ(s6, 200);
  std::vector<double> streamed;
  for (size_t q = 0; (q = b6.find("data: ", q)) != std::string::npos;) {
    const size_t end = b6.find("\n\n", q);
    const std::string data = b6.substr(q + 6, end - q - 6);
    q = end;
    if (data == "[DONE]") continue;
    const json j = json::parse(data);
    if (j["choices"].empty() || j["choices"][0]["logprobs"].is_null()) continue;
    for (const json& v : j["choices"][0]["logprobs"]["token_logprobs"]) streamed.push_back(v);
  }
  EXPECT_EQ(json(streamed), plain_lp["token_logprobs"]);
  const json chat_req{{"messages", json::array({{{"role", "user"}, {"content", "t42t7"}}})},
                      {"max_tokens", 4},
                      {"temperature", 0},
                      {"logprobs", true},
                      {"top_logprobs", 2},
                      {"ignore_eos", true}};
  auto [s7, b7] = post("/v1/chat/completions", chat_req);
  ASSERT_EQ(s7, 200) << b7;
  const json content = json::parse(b7)["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (const json& t : content) {
    EXPECT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_GE(t["top_logprobs"][0]["logprob"], t["top_logprobs"][1]["logprob"]);
    EXPECT_EQ(t["top_logprobs"][0]["logprob"], t["logprob"]);  // greedy
    EXPECT_TRUE(t["bytes"].is_array());
  }

  // Out-of-range ids, a context end past the prompt: 400 naming the field.
  json bad = id_req;
  bad["prompt"] = json::array({5, 1000000});
  auto [s8, b8] = post("/v1/completions", bad);
  EXPECT_EQ(s8, 400);
  EXPECT_EQ(json::parse(b8)["error"]["param"], "prompt");
  bad["prompt"] = json::array({json::array({5}), json::array({-3})});
  auto [s9, b9] = post("/v1/completions", bad);
  EXPECT_EQ(s9, 400);
  EXPECT_EQ(json::parse(b9)["error"]["param"], "prompt[1]");
  bad = id_req;
  bad["context_end"] = ids.size();
  auto [s10, b10] = post("/v1/completions", bad);
  EXPECT_EQ(s10, 400);
  EXPECT_EQ(json::parse(b10)["error"]["param"], "context_end");
  bad["context_end"] = 2;
  auto [s11, b11] = post("/v1/completions", bad);
  EXPECT_EQ(s11, 200) << b11;

  http.stop(1.0);
  server.join();
}

}  // namespace
}  // namespace d2o::serve
