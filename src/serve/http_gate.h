// The connection gate of `d2o serve`'s HTTP front: a connection gets a handler thread only once
// its whole request (header and body) has arrived, so that clients sending slowly (a byte or a
// line every few seconds, from hundreds of connections) hold no thread and cannot make the
// server unreachable.
//
// cpp-httplib 0.11 (Debian 12) hands every accepted connection to a thread of its task queue,
// which then reads the header and the body, each read with a 5 s timeout but with no deadline
// for the whole request: a few hundred connections trickling header lines held every handler
// thread, and /health stopped answering. GatedServer keeps httplib's parsing, routing and
// response writing (Server::process_request) and replaces what comes before it
// (Server::process_and_close_socket, which 0.11 lets a subclass override):
//
//   accept (httplib's loop; its task queue runs our admission inline): a connection past
//        max_conn_per_addr from its address, or past max_conn with no idle connection to close
//        for it, is answered 503 (Retry-After: 1) at once and closed (serve/conn_limits.h)
//     -> the gate: one thread polls every connection that waits for its request, reads what
//        arrives into the connection's buffer, and
//          - once the header is whole, reads its Content-Length: past max_body, 413; a
//            Transfer-Encoding body (chunked), 411; a Content-Length that is no number, 400;
//            none, the body is empty (RFC 9112: httplib 0.11 would read until the client closes);
//            "Expect: 100-continue" with the body still to come, a 100 Continue at once;
//          - hands the connection to a handler thread once the buffer holds the whole request
//            (the handler's stream reads the buffer first, then the socket);
//          - answers 408 and closes it when the request is not whole by its deadline
//            (request_timeout after the connection opened, for header and body together; an
//            idle kept-alive connection has keep_alive_timeout for its next request's first
//            byte, then request_timeout);
//          - answers 431 and closes it when the header grows past max_header_bytes;
//          - when more than max_waiting connections wait, or their buffers hold more than
//            max_buffered bytes, closes the one that has waited longest (503): a slow client
//            cannot keep out one whose request arrives at once;
//          - closes the idle kept-alive connections that have waited longest when new ones
//            need their room under max_conn (serve/conn_limits.h);
//          - answers 429 (Retry-After) to a whole request past its address's request rate
//            (rate_per_addr a second, rate_burst at once) and closes the connection.
//     -> a handler thread: process_request() for the request, then the connection goes back
//        to the gate for the next request (keep-alive, or one already sent behind it).
#pragma once

#include <httplib.h>
#include <poll.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "serve/conn_limits.h"

namespace d2o::serve {

struct GateOptions {
  int threads = 16;               // handler threads
  double request_timeout_s = 30;  // for a request's header and body together
  int keep_alive_timeout_s = 5;   // an idle kept-alive connection's wait for a next request
  size_t max_waiting = 512;       // connections waiting for their request at most
  size_t max_header_bytes = size_t{16} << 10;  // request line and headers
  size_t max_body = size_t{4} << 20;           // Content-Length at most (413 past it)
  size_t max_buffered = size_t{64} << 20;      // bytes the waiting connections' buffers hold
  size_t max_conn = 0;                         // open connections at most (0: no bound)
  size_t max_conn_per_addr = 64;  // open connections from one client address (0: no bound)
  double rate_per_addr = 0;       // requests a second from one address (0: no bound)
  double rate_burst = 0;          // requests one address may send at once (0: 2 s of the rate)
  // Called on the gate thread when the connections open fall to a few (4) after many (64 or
  // more) were: what they held can go back to the system (d2o serve: malloc_trim).
  std::function<void()> on_quiet;
};

// Where a request's bytes stand once its header is whole (frame_request).
struct RequestFrame {
  enum Kind {
    kPartial,         // the header is not whole yet
    kWhole,           // the header is whole; the request is `total` bytes
    kTooLarge,        // Content-Length past max_body
    kLengthRequired,  // a Transfer-Encoding body (only Content-Length bodies are taken)
    kBad,             // a Content-Length that is not a number, or two that differ
  } kind = kPartial;
  size_t header_bytes = 0;  // through the blank line
  size_t total = 0;         // header and body (kWhole)
  bool no_length = false;   // no Content-Length: the body is empty
  // An "Expect: 100-continue" line: where it starts in the buffer and its length (CRLF
  // included; 0: none).
  size_t expect_at = 0, expect_len = 0;
};
RequestFrame frame_request(std::string_view buffered, size_t max_body);

class GatedServer : public httplib::Server {
 public:
  explicit GatedServer(const GateOptions& opts);
  ~GatedServer() override;

  // Serves until stop() (httplib's listen_after_bind), then closes the connections still
  // waiting for a header and waits for the handler threads to finish.
  bool serve();
  // Connections open, taken, closed to make room and refused (for /metrics).
  ConnStats conn_stats() const { return limits_.stats(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Conn {
    int fd = -1;
    std::string addr;         // the client's address (what the per-address bound counts)
    std::string buffered;     // read but not yet parsed
    size_t need = 0;          // the request's bytes, once its header is whole (0: not yet)
    int served = 0;           // requests answered on it
    Clock::time_point since;  // when it (re)entered the gate
    Clock::time_point deadline;
  };
  // A kept-alive connection waiting for its next request's first byte.
  static bool idle_conn(const Conn& c) { return c.buffered.empty() && c.served > 0; }

  // httplib's accept loop hands each new connection here (on its own thread, through the
  // inline task queue): it enters the gate.
  bool process_and_close_socket(socket_t sock) override;
  void admit(Conn c);
  void gate_loop();
  // One pass of the gate: reads what arrived, hands whole headers on, ends what is overdue.
  void gate_pass(std::vector<Conn>& waiting, const std::vector<pollfd>& fds);
  // Looks at what a waiting connection has buffered: true when the gate is done with it (its
  // whole request went to a handler thread, or it was refused), false while it must wait.
  bool advance(Conn& c);
  // Closes the `n` idle kept-alive connections that have waited longest; and the connections
  // that have waited longest while more than max_waiting wait.
  void shed_idle(std::vector<Conn>& waiting, size_t n);
  void trim_waiting(std::vector<Conn>& waiting);
  void serve_connection(Conn c);
  // Closes a counted connection.
  void close_conn(Conn& c);
  // Answers a counted connection with an error, counts why, and closes it (retry_after_s: the
  // Retry-After of a 429).
  void give_up(Conn& c, ConnRefusal why, double retry_after_s = 0);

  GateOptions opts_;
  ConnLimits limits_;
  AddrRate rate_;
  std::mutex mu_;  // incoming_, stopping_
  std::vector<Conn> incoming_;
  bool stopping_ = false;
  int wake_fd_ = -1;  // eventfd: new connections, stop
  std::unique_ptr<httplib::ThreadPool> pool_;
  std::thread gate_;
};

}  // namespace d2o::serve
