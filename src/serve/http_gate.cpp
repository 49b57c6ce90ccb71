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

GatedServer::GatedServer(const GateOptions& opts) : opts_(opts) {
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
    gate_close(c.fd);
    return;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

void GatedServer::refuse(int fd, int status, const char* reason) {
  char msg[160];
  const int n = std::snprintf(msg, sizeof msg,
                              "HTTP/1.1 %d %s\r\n%sConnection: close\r\nContent-Length: 0\r\n\r\n",
                              status, reason, status == 503 ? "Retry-After: 1\r\n" : "");
  (void)::send(fd, msg, static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
  gate_close(fd);
}

void GatedServer::gate_loop() {
  std::vector<Conn> waiting;
  std::vector<pollfd> fds;
  char chunk[4096];
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      for (Conn& c : incoming_) waiting.push_back(std::move(c));
      incoming_.clear();
    }
    // Too many waiting: the ones that have waited longest go.
    while (waiting.size() > opts_.max_waiting) {
      auto oldest =
          std::min_element(waiting.begin(), waiting.end(),
                           [](const Conn& a, const Conn& b) { return a.since < b.since; });
      if (oldest->buffered.empty() && oldest->served > 0) {
        gate_close(oldest->fd);  // an idle kept-alive connection: nothing to answer
      } else {
        refuse(oldest->fd, 503, "Service Unavailable");
      }
      waiting.erase(oldest);
    }
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
    const auto now = GateClock::now();
    std::vector<Conn> kept;
    kept.reserve(waiting.size());
    for (size_t i = 0; i < waiting.size(); ++i) {
      Conn& c = waiting[i];
      if (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t n = ::recv(c.fd, chunk, sizeof chunk, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          gate_close(c.fd);  // the client closed it (or it broke)
          continue;
        }
        if (n > 0) {
          if (c.buffered.empty() && c.served > 0) {
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
            refuse(c.fd, 431, "Request Header Fields Too Large");
            continue;
          }
        }
      }
      if (now >= c.deadline) {
        if (c.buffered.empty() && c.served > 0) {
          gate_close(c.fd);  // an idle kept-alive connection
        } else {
          refuse(c.fd, 408, "Request Timeout");
        }
        continue;
      }
      kept.push_back(std::move(c));
    }
    waiting.swap(kept);
  }
  for (Conn& c : waiting) gate_close(c.fd);
  std::lock_guard<std::mutex> lock(mu_);
  for (Conn& c : incoming_) gate_close(c.fd);
  incoming_.clear();
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
  gate_close(c.fd);
}

}  // namespace d2o::serve
