#include "serve/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <ctime>
#include <nlohmann/json.hpp>
#include <thread>

#include "serve/chat_page.h"  // generated from src/serve/chat.html
#include "serve/http_gate.h"

namespace d2o::serve {

using json = nlohmann::json;

namespace {

constexpr const char* kJson = "application/json";

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  if (e.http_status == 503) res.set_header("Retry-After", "1");
  res.set_content(error_body(e), kJson);
}

ApiError plain_error(int status, std::string message, std::string code) {
  ApiError e;
  e.http_status = status;
  e.message = std::move(message);
  e.code = std::move(code);
  if (status >= 500) e.type = "server_error";
  if (status == 401) e.type = "authentication_error";
  if (status == 403) e.type = "permission_error";
  return e;
}

// The address and port of a socket address (IPv4 or IPv6), as httplib writes them.
bool address_of(const sockaddr_storage& a, std::string& addr, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    port = ntohs(in.sin_port);
    return inet_ntop(AF_INET, &in.sin_addr, buf, sizeof buf) && (addr = buf, true);
  }
  if (a.ss_family == AF_INET6) {
    const auto& in = reinterpret_cast<const sockaddr_in6&>(a);
    port = ntohs(in.sin6_port);
    return inet_ntop(AF_INET6, &in.sin6_addr, buf, sizeof buf) && (addr = buf, true);
  }
  return false;
}

// The socket of the connection `req` came on, which cpp-httplib 0.11 does not hand to handlers:
// the descriptor whose local and peer addresses are the request's (a TCP connection is unique
// by them while it is open, and it is open while its handler runs). -1 when none matches.
int request_socket(const httplib::Request& req) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (const dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.empty() || name.size() > 9 ||
        name.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const int fd = std::stoi(name);
    sockaddr_storage peer{}, local{};
    socklen_t np = sizeof peer, nl = sizeof local;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &np) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &nl) != 0)
      continue;
    std::string peer_addr, local_addr;
    int peer_port = -1, local_port = -1;
    if (address_of(peer, peer_addr, peer_port) && address_of(local, local_addr, local_port) &&
        peer_port == req.remote_port && local_port == req.local_port &&
        peer_addr == req.remote_addr) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  return found;
}

// True when the peer of `fd` has closed the connection: readable, and at its end (or reset).
// A client that keeps the connection open, or sent its next request, is still there.
bool peer_gone(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR)) return true;
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

// Counts a generation request in flight for the drain on stop().
struct HttpServer::InFlight {
  std::atomic<int>& n;
  explicit InFlight(std::atomic<int>& c) : n(c) { ++n; }
  ~InFlight() { --n; }
};

HttpServer::HttpServer(Service& service, const Tokenizer& tok, const ChatTemplate* tmpl,
                       const HttpOptions& opts)
    : service_(service), tok_(tok), tmpl_(tmpl), opts_(opts) {
  GateOptions g;
  g.threads = std::max(4, opts_.http_threads);
  g.request_timeout_s = opts_.request_timeout_s;
  g.keep_alive_timeout_s = opts_.keep_alive_timeout_s;
  g.max_waiting = opts_.max_waiting;
  g.max_conn = opts_.max_conn;
  g.max_conn_per_addr = opts_.max_conn_per_addr;
  g.max_body = opts_.max_body;
  // What the waiting connections' buffers may hold: 16 whole bodies, at least 64 MiB.
  g.max_buffered = std::max(size_t{64} << 20, 16 * opts_.max_body);
  g.rate_per_addr = opts_.rate_per_addr;
  g.rate_burst = opts_.rate_burst;
  g.on_quiet = opts_.on_quiet;
  svr_ = std::make_unique<GatedServer>(g);
  svr_->set_payload_max_length(opts_.max_body);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which lets a second server bind a
  // port that is in use and silently take half of its connections. Called for the listening
  // socket only (the last one made is the one bound).
  svr_->set_socket_options([this](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listen_fd_ = sock;
  });
  routes();
}

HttpServer::~HttpServer() = default;

Status HttpServer::bind() {
  if (opts_.port == 0) {
    port_ = svr_->bind_to_any_port(opts_.host);
    if (port_ < 0) return io_error("cannot bind to " + opts_.host + " (any port)");
  } else if (!svr_->bind_to_port(opts_.host, opts_.port)) {
    return io_error("cannot bind to " + opts_.host + ":" + std::to_string(opts_.port) +
                    " (in use, or not an address of this machine)");
  } else {
    port_ = opts_.port;
  }
  // cpp-httplib 0.11 listens with a backlog of 5 connections: a burst of clients overflows it,
  // the kernel answers the overflow with SYN cookies, and some of those connections end reset
  // (seen with 64 clients connecting at once). Listening again on the bound socket raises the
  // backlog (the kernel caps it at net.core.somaxconn).
  int listening = 0;
  socklen_t len = sizeof listening;
  if (listen_fd_ < 0 || getsockopt(listen_fd_, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
      !listening || ::listen(listen_fd_, SOMAXCONN) != 0) {
    return io_error("cannot raise the listen backlog of " + opts_.host + ":" +
                    std::to_string(port_));
  }
  return {};
}

void HttpServer::run() {
  svr_->serve();
}

void HttpServer::stop(double grace_s) {
  draining_ = true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  svr_->stop();
}

std::optional<ApiError> HttpServer::prepare(const GenerationRequest& g, Job& job,
                                            size_t index) const {
  PrepareOptions po;
  po.n_ctx = opts_.n_ctx;
  po.default_max_tokens = opts_.default_max_tokens;
  po.default_kv = opts_.default_kv;
  po.model_name = opts_.model_name;
  return prepare_job(g, tok_, tmpl_, po, job, index);
}

std::optional<std::string> HttpServer::key_name(const httplib::Request& req) const {
  if (opts_.api_keys.empty()) return std::string();
  constexpr std::string_view kBearer = "Bearer ";
  const std::string auth = req.get_header_value("Authorization");
  if (auth.compare(0, kBearer.size(), kBearer) != 0) return std::nullopt;
  const ApiKey* k = match_api_key(opts_.api_keys, std::string_view(auth).substr(kBearer.size()));
  if (!k) return std::nullopt;
  return k->name;
}

bool HttpServer::may_read_metrics(const httplib::Request& req) const {
  if (opts_.api_keys.size() <= 1) return true;  // the key was checked before routing
  const auto name = key_name(req);
  return name && !opts_.admin_key_name.empty() && *name == opts_.admin_key_name;
}

void HttpServer::answer(Job& job, const httplib::Request& req, httplib::Response& res) {
  std::string text, piece;
  // A client that goes away while it waits: its job is cancelled (checked between waits).
  const int fd = request_socket(req);
  while (!Service::wait_events(job, piece, 200)) {
    text += piece;
    if (fd >= 0 && !job.cancel.load() && peer_gone(fd)) job.cancel = true;
  }
  text += piece;
  std::lock_guard<std::mutex> lock(job.mu);
  if (job.error) return send_error(res, *job.error);
  job.completion.text = std::move(text);
  res.set_content(completion_body(job.completion), kJson);
}

void HttpServer::answer_batch(const std::vector<std::shared_ptr<Job>>& jobs,
                              const httplib::Request& req, httplib::Response& res) {
  const int fd = request_socket(req);
  auto cancel_all = [&] {
    for (const auto& j : jobs) j->cancel = true;
  };
  std::vector<Completion> done;
  done.reserve(jobs.size());
  for (const auto& job : jobs) {
    std::string text, piece;
    while (!Service::wait_events(*job, piece, 200)) {
      text += piece;
      if (fd >= 0 && !job->cancel.load() && peer_gone(fd)) cancel_all();
    }
    text += piece;
    std::lock_guard<std::mutex> lock(job->mu);
    if (job->error) {
      cancel_all();
      return send_error(res, *job->error);
    }
    job->completion.text = std::move(text);
    done.push_back(job->completion);
  }
  res.set_content(batch_completion_body(done), kJson);
}

void HttpServer::stream(const std::shared_ptr<Job>& job, bool include_usage,
                        std::shared_ptr<InFlight> in_flight, httplib::Response& res) {
  auto first = std::make_shared<bool>(true);
  auto offset = std::make_shared<size_t>(0);  // text_offset of the next chunk's text
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [job, first, offset, include_usage](size_t, httplib::DataSink& sink) {
        std::string piece;
        std::vector<TokenLogprob> lps;
        const bool done = job->stream_logprobs ? Service::wait_events(*job, piece, lps, 100)
                                               : Service::wait_events(*job, piece, 100);
        std::string out;
        if (job->stream_logprobs && (!piece.empty() || !lps.empty())) {
          out = chunk_event(job->completion, piece, *first, lps, *offset);
          *first = false;
        } else if (!piece.empty()) {
          out = chunk_event(job->completion, piece, *first);
          *first = false;
        }
        if (done) {
          std::lock_guard<std::mutex> lock(job->mu);
          if (job->error) {
            out += error_event(*job->error);
          } else {
            out += final_chunk_event(job->completion, false);
            if (include_usage) out += usage_chunk_event(job->completion);
          }
          out += done_event();
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          job->cancel = true;  // the client is gone: the engine frees its sequence
          return false;
        }
        if (done) sink.done();
        return true;
      },
      [job, in_flight](bool) {
        // The response ended (written, failed or the server stopping): nobody reads further.
        std::lock_guard<std::mutex> lock(job->mu);
        if (!job->done) job->cancel = true;
      });
}

void HttpServer::routes() {
  httplib::Server& s = *svr_;
  // The API key, before any route (so also unknown paths); /health stays open for probes, and
  // the chat page, which holds no data (it asks for the key and sends it with its requests).
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (opts_.api_keys.empty() || req.path == "/health" || (req.path == "/" && req.method == "GET"))
      return httplib::Server::HandlerResponse::Unhandled;
    if (key_name(req)) return httplib::Server::HandlerResponse::Unhandled;
    const bool given = req.has_header("Authorization");
    send_error(res, plain_error(401,
                                given ? "the API key is wrong"
                                      : "an API key is required: send "
                                        "'Authorization: Bearer KEY'",
                                given ? "invalid_api_key" : "missing_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });
  // Errors httplib answers itself (404, 413 over --max-body, 400 on a bad request line) get
  // OpenAI's JSON shape too; our own error responses already have a body.
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) {
      send_error(res, plain_error(413,
                                  "the request body is larger than the limit of " +
                                      std::to_string(opts_.max_body) + " bytes (--max-body)",
                                  "body_too_large"));
    } else if (res.status == 404) {
      send_error(res, plain_error(404, "no endpoint " + req.method + " " + req.path, "not_found"));
    } else {
      send_error(res, plain_error(res.status, "bad request", "bad_request"));
    }
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_) {
      send_error(res, plain_error(503, "the server is shutting down", "shutting_down"));
      return;
    }
    res.set_content(R"({"status":"ok"})", kJson);
  });
  s.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_content(kChatPageHtml, sizeof kChatPageHtml - 1, "text/html; charset=utf-8");
  });
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(models_body(opts_.model_name, 0), kJson);
  });
  s.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (!may_read_metrics(req)) {
      return send_error(res, plain_error(403, "GET /metrics needs the admin key (--admin-key-name)",
                                         "admin_key_required"));
    }
    Metrics m = service_.metrics();
    m.connections = svr_->conn_stats();
    res.set_content(prometheus_text(m), "text/plain; version=0.0.4");
  });
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    TokenizeRequest t;
    if (auto e = parse_tokenize_request(req.body, t)) return send_error(res, *e);
    EncodeOptions enc;
    enc.add_special = t.add_special;
    enc.parse_special = t.parse_special;
    auto ids = tok_.encode(t.content, enc);
    if (!ids.ok())
      return send_error(res, bad_field(t.vllm ? "prompt" : "content", ids.status().message()));
    if (t.vllm) {  // vLLM's answer
      res.set_content(json{{"tokens", *ids},
                           {"count", ids->size()},
                           {"max_model_len", opts_.n_ctx},
                           {"token_strs", nullptr}}
                          .dump(),
                      kJson);
      return;
    }
    res.set_content(json{{"tokens", *ids}}.dump(), kJson);
  });
  // vLLM's description of the tokenizer (what a remote-tokenizer client reads first).
  s.Get("/tokenizer_info", [this](const httplib::Request&, httplib::Response& res) {
    auto special = [&](TokenId id) { return id >= 0 ? json(tok_.token_text(id)) : json(nullptr); };
    json info{{"tokenizer_class", "d2o"},         {"model", opts_.model_name},
              {"vocab_size", tok_.n_vocab()},     {"bos_token", special(tok_.bos())},
              {"eos_token", special(tok_.eos())}, {"pad_token", nullptr},
              {"add_bos_token", tok_.add_bos()},  {"add_eos_token", tok_.add_eos()},
              {"model_max_length", opts_.n_ctx}};
    res.set_content(info.dump(-1, ' ', false, json::error_handler_t::replace), kJson);
  });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    std::vector<int32_t> ids;
    if (auto e = parse_detokenize_request(req.body, tok_.n_vocab(), ids))
      return send_error(res, *e);
    auto text = tok_.decode(ids, /*render_special=*/false);
    if (!text.ok()) return send_error(res, bad_field("tokens", text.status().message()));
    // "prompt": the same text under vLLM's name.
    res.set_content(json{{"content", *text}, {"prompt", *text}}.dump(
                        -1, ' ', false, json::error_handler_t::replace),
                    kJson);
  });
  auto generation = [this](Endpoint ep) {
    return [this, ep](const httplib::Request& req, httplib::Response& res) {
      // Held until the response is written (for a stream: until its last event).
      auto guard = std::make_shared<InFlight>(in_flight_);
      // Who asks (the key was checked before routing): the namespace of the session.
      const std::string who = key_name(req).value_or("");
      GenerationRequest g;
      if (auto e = parse_generation_request(req.body, ep, g)) {
        service_.count_outcome("invalid", who);
        return send_error(res, *e);
      }
      const bool has_sid = req.has_header("X-Session-Id");
      const std::string sid = has_sid ? req.get_header_value("X-Session-Id") : std::string();
      if (auto e = apply_session_header(has_sid ? &sid : nullptr, g)) {
        service_.count_outcome("invalid", who);
        return send_error(res, *e);
      }
      // One job per prompt (completions may carry a batch).
      const size_t n_jobs = ep == Endpoint::kCompletion ? std::max<size_t>(1, g.prompts.size()) : 1;
      std::vector<std::shared_ptr<Job>> jobs;
      for (size_t i = 0; i < n_jobs; ++i) {
        auto job = std::make_shared<Job>();
        job->key_name = who;
        if (auto e = prepare(g, *job, i)) {
          service_.count_outcome(e->http_status == 503 ? "rejected" : "invalid", who);
          return send_error(res, *e);
        }
        jobs.push_back(std::move(job));
      }
      if (draining_) {
        service_.count_outcome("rejected", who);
        return send_error(res, plain_error(503, "the server is shutting down", "shutting_down"));
      }
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (auto e = service_.submit(jobs[i])) {
          for (size_t j = 0; j < i; ++j) jobs[j]->cancel = true;
          service_.count_outcome("rejected", who);
          return send_error(res, *e);
        }
      }
      if (jobs.size() > 1) return answer_batch(jobs, req, res);
      if (!g.stream) return answer(*jobs[0], req, res);
      stream(jobs[0], g.include_usage, guard, res);
    };
  };
  s.Post("/v1/chat/completions", generation(Endpoint::kChat));
  s.Post("/v1/completions", generation(Endpoint::kCompletion));
}

}  // namespace d2o::serve
