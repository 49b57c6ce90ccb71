#include "serve/http_gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace d2o::serve {

namespace {

using GateClock = std::chrono::steady_clock;

// Runs each task at once on the caller's thread: httplib's accept loop then only admits
// connections into the gate (quick), and the gate hands them to its own threads.
class InlineTaskQueue final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

// Milliseconds from now to t, at least 0.
int ms_until(GateClock::time_point t, GateClock::time_point now) {
  if (t <= now) return 0;
  return static_cast<int>(
      std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(t - now).count(), 1 << 30));
}

GateClock::time_point after(double seconds) {
  return GateClock::now() +
         std::chrono::duration_cast<GateClock::duration>(std::chrono::duration<double>(seconds));
}

void gate_close(int fd) {
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

// What a refusal answers: its status, reason phrase, message and error code (OpenAI's error
// shape, as the handlers write it).
struct Refusal {
  int status;
  const char* phrase;
  const char* message;
  const char* code;
};

Refusal refusal_of(ConnRefusal why) {
  switch (why) {
    case ConnRefusal::kHeaderTimeout:
    case ConnRefusal::kBodyTimeout:
      return {408, "Request Timeout", "the request did not arrive within --request-timeout",
              "request_timeout"};
    case ConnRefusal::kHeaderTooLarge:
      return {431, "Request Header Fields Too Large", "the request header is larger than 16 KiB",
              "header_too_large"};
    case ConnRefusal::kBodyTooLarge:
      return {413, "Payload Too Large", "the request body is larger than the limit (--max-body)",
              "body_too_large"};
    case ConnRefusal::kLengthRequired:
      return {411, "Length Required",
              "a request body needs a Content-Length (Transfer-Encoding bodies are not taken)",
              "length_required"};
    case ConnRefusal::kBadRequest:
      return {400, "Bad Request", "the Content-Length is not a number", "bad_request"};
    case ConnRefusal::kRateLimited:
      return {429, "Too Many Requests",
              "too many requests from this address (--rate-per-addr); retry later", "rate_limited"};
    default:
      return {503, "Service Unavailable", "too many connections; retry later", "overloaded"};
  }
}

// Writes an error response (best effort, never blocking) and closes the connection. What the
// client sent is read first (as much as is there): closing a socket with unread bytes would
// reset the connection, and the client could lose the response. 503 and 429 carry Retry-After
// (retry_after_s rounded up, at least 1).
void refuse_fd(int fd, ConnRefusal why, double retry_after_s = 0) {
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  const Refusal r = refusal_of(why);
  char body[256];
  const int nb = std::snprintf(
      body, sizeof body, R"({"error":{"message":"%s","type":"%s","param":null,"code":"%s"}})",
      r.message, r.status >= 500 ? "server_error" : "invalid_request_error", r.code);
  char retry[48] = "";
  if (r.status == 503 || r.status == 429) {
    const long secs = std::max(1L, static_cast<long>(std::ceil(retry_after_s)));
    std::snprintf(retry, sizeof retry, "Retry-After: %ld\r\n", secs);
  }
  char msg[512];
  const int n = std::snprintf(msg, sizeof msg,
                              "HTTP/1.1 %d %s\r\n%sConnection: close\r\nContent-Type: "
                              "application/json\r\nContent-Length: %d\r\n\r\n%s",
                              r.status, r.phrase, retry, nb, body);
  (void)::send(fd, msg, static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
  gate_close(fd);
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

bool gate_address(const sockaddr_storage& a, std::string& ip, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    port = ntohs(in.sin_port);
    if (!inet_ntop(AF_INET, &in.sin_addr, buf, sizeof buf)) return false;
  } else if (a.ss_family == AF_INET6) {
    const auto& in = reinterpret_cast<const sockaddr_in6&>(a);
    port = ntohs(in.sin6_port);
    if (!inet_ntop(AF_INET6, &in.sin6_addr, buf, sizeof buf)) return false;
  } else {
    return false;
  }
  ip = buf;
  return true;
}

// A handler's stream over a connection: first the bytes the gate (or the previous request)
// read, then the socket. Reads wait at most the read timeout each and never past the
// deadline of the request; writes wait at most the write timeout.
class GateStream final : public httplib::Stream {
 public:
  GateStream(int fd, std::string buffered, int read_ms, int write_ms)
      : fd_(fd), buf_(std::move(buffered)), read_ms_(read_ms), write_ms_(write_ms) {}

  void set_deadline(GateClock::time_point t) { deadline_ = t; }
  // What was read past the last request (the start of the next one, if any).
  std::string take_buffered() {
    std::string rest = buf_.substr(pos_);
    buf_.clear();
    pos_ = 0;
    return rest;
  }

  bool is_readable() const override { return pos_ < buf_.size() || wait(POLLIN, read_wait()); }
  bool is_writable() const override { return wait(POLLOUT, write_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ < buf_.size()) {
      const size_t n = std::min(size, buf_.size() - pos_);
      std::memcpy(ptr, buf_.data() + pos_, n);
      pos_ += n;
      if (pos_ == buf_.size()) {
        buf_.clear();
        pos_ = 0;
      }
      return static_cast<ssize_t>(n);
    }
    if (!wait(POLLIN, read_wait())) return -1;
    if (size >= kChunk) return recv_some(ptr, size);
    buf_.resize(kChunk);
    const ssize_t got = recv_some(buf_.data(), kChunk);
    buf_.resize(got > 0 ? static_cast<size_t>(got) : 0);
    if (got <= 0) return got;
    return read(ptr, size);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) gate_address(a, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) gate_address(a, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  static constexpr size_t kChunk = 4096;

  int read_wait() const { return std::min(read_ms_, ms_until(deadline_, GateClock::now())); }
  bool wait(short events, int ms) const {
    if (ms <= 0) return false;
    pollfd p{fd_, events, 0};
    int r;
    do {
      r = ::poll(&p, 1, ms);
    } while (r < 0 && errno == EINTR);
    return r > 0;
  }
  ssize_t recv_some(char* p, size_t n) {
    ssize_t r;
    do {
      r = ::recv(fd_, p, n, 0);
    } while (r < 0 && errno == EINTR);
    return r;
  }

  int fd_;
  std::string buf_;
  size_t pos_ = 0;
  int read_ms_;
  int write_ms_;
  GateClock::time_point deadline_ = GateClock::time_point::max();
};

}  // namespace

RequestFrame frame_request(std::string_view b, size_t max_body) {
  RequestFrame f;
  const size_t end = b.find("\r\n\r\n");
  if (end == std::string_view::npos) return f;
  f.header_bytes = end + 4;
  std::string_view head = b.substr(0, end);
  size_t pos = head.find("\r\n");  // past the request line
  bool has_length = false, encoded = false;
  uint64_t length = 0;
  while (pos != std::string_view::npos) {
    pos += 2;
    const size_t next = head.find("\r\n", pos);
    const std::string_view line =
        head.substr(pos, next == std::string_view::npos ? std::string_view::npos : next - pos);
    const size_t at = pos;
    pos = next;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;  // httplib judges the rest
    const std::string_view name = trim(line.substr(0, colon));
    const std::string_view value = trim(line.substr(colon + 1));
    if (iequals(name, "Expect") && iequals(value, "100-continue")) {
      f.expect_at = at;
      f.expect_len = line.size() + 2;
    } else if (iequals(name, "Transfer-Encoding")) {
      encoded = true;
    } else if (iequals(name, "Content-Length")) {
      if (value.empty() || value.size() > 18 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        f.kind = RequestFrame::kBad;
        return f;
      }
      uint64_t v = 0;
      for (char c : value) v = v * 10 + static_cast<uint64_t>(c - '0');
      if (has_length && v != length) {
        f.kind = RequestFrame::kBad;
        return f;
      }
      has_length = true;
      length = v;
    }
  }
  if (encoded) {
    f.kind = RequestFrame::kLengthRequired;
  } else if (has_length && length > max_body) {
    f.kind = RequestFrame::kTooLarge;
  } else {
    f.kind = RequestFrame::kWhole;
    f.no_length = !has_length;
    f.total = f.header_bytes + static_cast<size_t>(length);
  }
  return f;
}

GatedServer::GatedServer(const GateOptions& opts)
    : opts_(opts),
      limits_(opts.max_conn, opts.max_conn_per_addr),
      rate_(opts.rate_per_addr, opts.rate_burst > 0 ? opts.rate_burst : 2 * opts.rate_per_addr) {
  new_task_queue = [] { return new InlineTaskQueue; };
  set_keep_alive_timeout(opts_.keep_alive_timeout_s);  // what responses announce
}

GatedServer::~GatedServer() {
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

bool GatedServer::serve() {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return false;
  pool_ = std::make_unique<httplib::ThreadPool>(static_cast<size_t>(std::max(1, opts_.threads)));
  gate_ = std::thread([this] { gate_loop(); });
  const bool ok = listen_after_bind();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  gate_.join();
  pool_->shutdown();  // the requests being answered finish; their connections then close
  return ok;
}

bool GatedServer::process_and_close_socket(socket_t sock) {
  Conn c;
  c.fd = sock;
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  int port = 0;
  if (getpeername(sock, reinterpret_cast<sockaddr*>(&a), &len) != 0 ||
      !gate_address(a, c.addr, port)) {
    c.addr = "?";
  }
  // Over a bound: answered at once on this (the accept) thread, never blocking, and closed.
  const ConnLimits::Admit verdict = limits_.admit(c.addr);
  if (verdict == ConnLimits::Admit::kPerAddress || verdict == ConnLimits::Admit::kMaxConn) {
    refuse_fd(sock, verdict == ConnLimits::Admit::kPerAddress ? ConnRefusal::kPerAddress
                                                              : ConnRefusal::kMaxConn);
    return true;
  }
  c.since = GateClock::now();
  c.deadline = after(opts_.request_timeout_s);
  admit(std::move(c));
  return true;
}

void GatedServer::admit(Conn c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      incoming_.push_back(std::move(c));
      c.fd = -1;
    }
  }
  if (c.fd >= 0) {
    close_conn(c);
    return;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

void GatedServer::close_conn(Conn& c) {
  gate_close(c.fd);
  c.fd = -1;
  limits_.release(c.addr);
}

void GatedServer::give_up(Conn& c, ConnRefusal why, double retry_after_s) {
  limits_.refused(why);
  refuse_fd(c.fd, why, retry_after_s);
  c.fd = -1;
  limits_.release(c.addr);
}

void GatedServer::shed_idle(std::vector<Conn>& waiting, size_t n) {
  for (; n > 0; --n) {
    auto oldest = waiting.end();
    for (auto it = waiting.begin(); it != waiting.end(); ++it) {
      if (idle_conn(*it) && (oldest == waiting.end() || it->since < oldest->since)) oldest = it;
    }
    if (oldest == waiting.end()) return;  // they were woken meanwhile: over by a few, briefly
    close_conn(*oldest);
    limits_.shed();
    waiting.erase(oldest);
  }
}

void GatedServer::trim_waiting(std::vector<Conn>& waiting) {
  // Too many waiting: the ones that have waited longest go.
  while (waiting.size() > opts_.max_waiting) {
    auto oldest = std::min_element(waiting.begin(), waiting.end(),
                                   [](const Conn& a, const Conn& b) { return a.since < b.since; });
    if (idle_conn(*oldest)) {
      close_conn(*oldest);  // an idle kept-alive connection: nothing to answer
    } else {
      give_up(*oldest, ConnRefusal::kWaitingFull);
    }
    waiting.erase(oldest);
  }
  // Their buffers hold too much: the ones that have waited longest with something buffered go.
  size_t held = 0;
  for (const Conn& c : waiting) held += c.buffered.size();
  while (held > opts_.max_buffered) {
    auto oldest = waiting.end();
    for (auto it = waiting.begin(); it != waiting.end(); ++it) {
      if (!it->buffered.empty() && (oldest == waiting.end() || it->since < oldest->since)) {
        oldest = it;
      }
    }
    if (oldest == waiting.end()) break;
    held -= oldest->buffered.size();
    give_up(*oldest, ConnRefusal::kWaitingFull);
    waiting.erase(oldest);
  }
}

bool GatedServer::advance(Conn& c) {
  if (c.need == 0) {
    const RequestFrame f = frame_request(c.buffered, opts_.max_body);
    if (f.kind == RequestFrame::kPartial || f.header_bytes > opts_.max_header_bytes) {
      if (f.header_bytes > opts_.max_header_bytes || c.buffered.size() > opts_.max_header_bytes) {
        give_up(c, ConnRefusal::kHeaderTooLarge);
        return true;
      }
      return false;
    }
    switch (f.kind) {
      case RequestFrame::kTooLarge:
        give_up(c, ConnRefusal::kBodyTooLarge);
        return true;
      case RequestFrame::kLengthRequired:
        give_up(c, ConnRefusal::kLengthRequired);
        return true;
      case RequestFrame::kBad:
        give_up(c, ConnRefusal::kBadRequest);
        return true;
      default:
        break;
    }
    c.need = f.total;
    if (f.no_length) {
      // No body (RFC 9112 6.3): said explicitly, or httplib would read one until the client
      // closes.
      static constexpr std::string_view kZero = "Content-Length: 0\r\n";
      c.buffered.insert(f.header_bytes - 2, kZero);
      c.need += kZero.size();
    }
    if (f.expect_len > 0) {
      // The client may wait for a 100 before it sends the body: it gets one now, from here
      // (and the line goes, or httplib would send a second one once the body is here).
      c.buffered.erase(f.expect_at, f.expect_len);
      c.need -= f.expect_len;
      if (c.buffered.size() < c.need) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        (void)::send(c.fd, kContinue.data(), kContinue.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      }
    }
  }
  if (c.buffered.size() < c.need) return false;
  // Each request takes a token of its address's bucket. It is taken once the request is
  // whole, so that the client has sent it and reads the 429 (refused at accept, a client still
  // sending would see its connection reset instead).
  if (const double wait = rate_.take(c.addr); wait > 0) {
    give_up(c, ConnRefusal::kRateLimited, wait);
    return true;
  }
  c.need = 0;
  pool_->enqueue([this, conn = std::move(c)]() mutable { serve_connection(std::move(conn)); });
  return true;
}

void GatedServer::gate_loop() {
  std::vector<Conn> waiting;
  std::vector<pollfd> fds;
  std::vector<Conn> arrived;
  int64_t busiest = 0;  // connections open at most since the last on_quiet
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      arrived.swap(incoming_);
    }
    // A connection back from a handler may hold its next request already (pipelined).
    for (Conn& c : arrived) {
      if (c.buffered.empty() || !advance(c)) waiting.push_back(std::move(c));
    }
    arrived.clear();
    shed_idle(waiting, limits_.take_shed());
    trim_waiting(waiting);
    // Counted before the wait too: a connection back from a handler is idle from now, not from
    // the end of the next pass (up to a second later).
    limits_.set_idle(static_cast<size_t>(std::count_if(waiting.begin(), waiting.end(), idle_conn)));
    GateClock::time_point next = GateClock::now() + std::chrono::seconds(1);
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    for (const Conn& c : waiting) {
      fds.push_back(pollfd{c.fd, POLLIN, 0});
      next = std::min(next, c.deadline);
    }
    const int r = ::poll(fds.data(), fds.size(), ms_until(next, GateClock::now()));
    if (r < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof v);
    }
    gate_pass(waiting, fds);
    limits_.set_idle(static_cast<size_t>(std::count_if(waiting.begin(), waiting.end(), idle_conn)));
    const int64_t open = limits_.stats().open;
    busiest = std::max(busiest, open);
    if (busiest >= 64 && open <= 4) {
      busiest = open;
      if (opts_.on_quiet) opts_.on_quiet();
    }
  }
  for (Conn& c : waiting) close_conn(c);
  std::lock_guard<std::mutex> lock(mu_);
  for (Conn& c : incoming_) close_conn(c);
  incoming_.clear();
}

void GatedServer::gate_pass(std::vector<Conn>& waiting, const std::vector<pollfd>& fds) {
  char chunk[4096];
  const auto now = GateClock::now();
  std::vector<Conn> kept;
  kept.reserve(waiting.size());
  for (size_t i = 0; i < waiting.size(); ++i) {
    Conn& c = waiting[i];
    if (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(c.fd, chunk, sizeof chunk, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_conn(c);  // the client closed it (or it broke)
        continue;
      }
      if (n > 0) {
        if (idle_conn(c)) {
          // The first byte of a kept-alive connection's next request: the request's time.
          c.deadline = now + std::chrono::duration_cast<GateClock::duration>(
                                 std::chrono::duration<double>(opts_.request_timeout_s));
        }
        c.buffered.append(chunk, static_cast<size_t>(n));
        // A body arriving quickly: take what is there now (up to 64 KiB a pass).
        for (int more = 0; more < 15 && n == static_cast<ssize_t>(sizeof chunk); ++more) {
          const ssize_t m = ::recv(c.fd, chunk, sizeof chunk, MSG_DONTWAIT);
          if (m <= 0) break;
          c.buffered.append(chunk, static_cast<size_t>(m));
        }
        if (advance(c)) continue;
      }
    }
    if (now >= c.deadline) {
      if (idle_conn(c)) {
        close_conn(c);  // an idle kept-alive connection
      } else {
        give_up(c, c.need > 0 ? ConnRefusal::kBodyTimeout : ConnRefusal::kHeaderTimeout);
      }
      continue;
    }
    kept.push_back(std::move(c));
  }
  waiting.swap(kept);
}

void GatedServer::serve_connection(Conn c) {
  GateStream strm(c.fd, std::move(c.buffered), static_cast<int>(read_timeout_sec_ * 1000),
                  static_cast<int>(write_timeout_sec_ * 1000));
  // The request is buffered whole; reads past it wait at most the request timeout.
  strm.set_deadline(after(opts_.request_timeout_s));
  ++c.served;
  const bool last =
      static_cast<size_t>(c.served) >= keep_alive_max_count_ || svr_sock_ == INVALID_SOCKET;
  bool closed = false;
  const bool ok = process_request(strm, last, closed, nullptr);
  if (!ok || closed || last) {
    close_conn(c);
    return;
  }
  // Back to the gate: for the next request, or with it when it was sent already.
  c.buffered = strm.take_buffered();
  c.since = GateClock::now();
  c.deadline = after(c.buffered.empty() ? static_cast<double>(opts_.keep_alive_timeout_s)
                                        : opts_.request_timeout_s);
  admit(std::move(c));
}

}  // namespace d2o::serve
