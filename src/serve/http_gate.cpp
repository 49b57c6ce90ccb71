#include "serve/http_gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

// A whole request header: the blank line after the headers.
bool whole_header(const std::string& b, size_t from) {
  return b.find("\r\n\r\n", from > 3 ? from - 3 : 0) != std::string::npos;
}

GateClock::time_point after(double seconds) {
  return GateClock::now() +
         std::chrono::duration_cast<GateClock::duration>(std::chrono::duration<double>(seconds));
}

void gate_close(int fd) {
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

// Writes a bodiless response (best effort, never blocking) and closes the connection. What
// the client sent is read first (as much as is there): closing a socket with unread bytes
// would reset the connection, and the client could lose the response.
void refuse_fd(int fd, int status) {
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  const char* reason = status == 408   ? "Request Timeout"
                       : status == 431 ? "Request Header Fields Too Large"
                                       : "Service Unavailable";
  char msg[160];
  const int n = std::snprintf(msg, sizeof msg,
                              "HTTP/1.1 %d %s\r\n%sConnection: close\r\nContent-Length: 0\r\n\r\n",
                              status, reason, status == 503 ? "Retry-After: 1\r\n" : "");
  (void)::send(fd, msg, static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
  gate_close(fd);
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
  void put_back(std::string b) {
    buf_ = std::move(b);
    pos_ = 0;
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

GatedServer::GatedServer(const GateOptions& opts)
    : opts_(opts), limits_(opts.max_conn, opts.max_conn_per_addr) {
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
    refuse_fd(sock, 503);
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

void GatedServer::give_up(Conn& c, ConnRefusal why) {
  limits_.refused(why);
  refuse_fd(c.fd, why == ConnRefusal::kHeaderTimeout    ? 408
                  : why == ConnRefusal::kHeaderTooLarge ? 431
                                                        : 503);
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
    auto oldest =
        std::min_element(waiting.begin(), waiting.end(),
                         [](const Conn& a, const Conn& b) { return a.since < b.since; });
    if (idle_conn(*oldest)) {
      close_conn(*oldest);  // an idle kept-alive connection: nothing to answer
    } else {
      give_up(*oldest, ConnRefusal::kWaitingFull);
    }
    waiting.erase(oldest);
  }
}

void GatedServer::gate_loop() {
  std::vector<Conn> waiting;
  std::vector<pollfd> fds;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      for (Conn& c : incoming_) waiting.push_back(std::move(c));
      incoming_.clear();
    }
    shed_idle(waiting, limits_.take_shed());
    trim_waiting(waiting);
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
          // The first byte of a kept-alive connection's next request: the header's time.
          c.deadline = now + std::chrono::duration_cast<GateClock::duration>(
                                 std::chrono::duration<double>(opts_.request_timeout_s));
        }
        const size_t from = c.buffered.size();
        c.buffered.append(chunk, static_cast<size_t>(n));
        if (whole_header(c.buffered, from)) {
          pool_->enqueue(
              [this, conn = std::move(c)]() mutable { serve_connection(std::move(conn)); });
          continue;
        }
        if (c.buffered.size() > opts_.max_header_bytes) {
          give_up(c, ConnRefusal::kHeaderTooLarge);
          continue;
        }
      }
    }
    if (now >= c.deadline) {
      if (idle_conn(c)) {
        close_conn(c);  // an idle kept-alive connection
      } else {
        give_up(c, ConnRefusal::kHeaderTimeout);
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
  while (true) {
    // The header is buffered; the body has the request timeout from now.
    strm.set_deadline(after(opts_.request_timeout_s));
    ++c.served;
    const bool last =
        static_cast<size_t>(c.served) >= keep_alive_max_count_ || svr_sock_ == INVALID_SOCKET;
    bool closed = false;
    const bool ok = process_request(strm, last, closed, nullptr);
    if (!ok || closed || last) break;
    std::string rest = strm.take_buffered();
    if (whole_header(rest, 0)) {  // pipelined: the next request is here already
      strm.put_back(std::move(rest));
      continue;
    }
    c.buffered = std::move(rest);
    c.since = GateClock::now();
    c.deadline = after(c.buffered.empty() ? static_cast<double>(opts_.keep_alive_timeout_s)
                                          : opts_.request_timeout_s);
    admit(std::move(c));
    return;
  }
  close_conn(c);
}

}  // namespace d2o::serve
