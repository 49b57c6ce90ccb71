// The HTTP front of `d2o serve` (Debian's cpp-httplib): routes, the API key, body limits, and
// the conversion of requests into Jobs for the Service and of Jobs into responses (JSON, or
// Server-Sent Events when streaming).
//
// Endpoints: GET / (the chat page, src/serve/chat.html), POST /v1/chat/completions,
// POST /v1/completions, GET /v1/models, GET /health, GET /metrics, POST /tokenize,
// POST /detokenize. Every error is OpenAI's JSON error shape with a 4xx/5xx status; 503s carry
// Retry-After. With API keys set (serve/api_keys.h), every endpoint but /health and the page
// needs "Authorization: Bearer KEY" with one of them (401 otherwise); the key's name is the
// namespace of the request's session and its label in /metrics. With several keys, /metrics
// answers only the admin key (403 otherwise; no one when there is none). Connections get a
// handler thread only once their request's header has arrived (serve/http_gate.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "serve/api_keys.h"
#include "serve/prepare.h"
#include "serve/service.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace d2o::serve {

class GatedServer;  // serve/http_gate.h

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                    // 0: any free port (port() tells which)
  std::vector<ApiKey> api_keys;       // none: an open server
  std::string admin_key_name;         // several keys: the one that may read /metrics ("": none)
  size_t max_body = size_t{4} << 20;  // bytes; larger bodies get 413
  int http_threads = 16;              // handler threads (each waiting request holds one)
  // A request's header and body must arrive within this of its connection opening (or of its
  // first byte, on a kept-alive connection; 408 otherwise); connections waiting for their
  // request hold no handler thread (serve/http_gate.h).
  double request_timeout_s = 30;
  int keep_alive_timeout_s = 5;     // an idle kept-alive connection is closed after this
  size_t max_waiting = 512;         // connections waiting for a header; the longest waiting go
  size_t max_conn = 0;              // open connections at most (0: no bound; serve/conn_limits.h)
  size_t max_conn_per_addr = 64;    // open connections from one client address (0: no bound)
  double rate_per_addr = 100;       // requests a second from one client address (0: no bound)
  double rate_burst = 200;          // requests one address may send at once
  std::string model_name;           // what /v1/models lists and responses carry
  int default_max_tokens = 512;     // when a request gives no max_tokens
  int64_t n_ctx = 0;                // the context: prompt + max_tokens may not exceed it
  std::string default_kv = "full";  // the policy of requests that name none
  std::function<void()> on_quiet;   // the connections fell to a few after many (GateOptions)
};

class HttpServer {
 public:
  // tmpl may be null (the model has no chat template: chat requests get a 400).
  HttpServer(Service& service, const Tokenizer& tok, const ChatTemplate* tmpl,
             const HttpOptions& opts);
  ~HttpServer();

  // Binds the socket. Errors: the address cannot be bound (in use, no such host).
  Status bind();
  int port() const { return port_; }
  // Serves until stop(); returns when every handler has finished.
  void run();
  // Graceful end: new requests get 503 while jobs in flight finish (at most `grace_s` seconds),
  // then the listener closes. Safe from another thread.
  void stop(double grace_s);

 private:
  void routes();
  std::optional<ApiError> prepare(const GenerationRequest& g, Job& job, size_t index) const;
  // The name of the key `req` carries: "" on an open server, nullopt when it carries none of
  // the keys.
  std::optional<std::string> key_name(const httplib::Request& req) const;
  // Whether `req` may read /metrics.
  bool may_read_metrics(const httplib::Request& req) const;
  // Waits for the job and writes the whole response; cancels the job when the client closes
  // its connection meanwhile.
  void answer(Job& job, const httplib::Request& req, httplib::Response& res);
  // The same for the jobs of a batch of prompts (one choice each); the first error answers for
  // all and cancels the others.
  void answer_batch(const std::vector<std::shared_ptr<Job>>& jobs, const httplib::Request& req,
                    httplib::Response& res);
  // Streams the job as Server-Sent Events; a failed write cancels it. `in_flight` is kept until
  // the stream ends.
  struct InFlight;
  void stream(const std::shared_ptr<Job>& job, bool include_usage,
              std::shared_ptr<InFlight> in_flight, httplib::Response& res);

  Service& service_;
  const Tokenizer& tok_;
  const ChatTemplate* tmpl_;
  HttpOptions opts_;
  std::unique_ptr<GatedServer> svr_;
  int port_ = 0;
  int listen_fd_ = -1;  // the listening socket (httplib keeps it private)
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};  // generation requests being answered
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace d2o::serve
