// The bounds on open connections (serve/conn_limits.h) enforced by the connection gate
// (serve/http_gate.h), over real loopback sockets from several client addresses (127.0.0.x):
// a connection past --max-conn-per-addr gets 503 with Retry-After at once and is closed while
// other addresses are served; at --max-conn the idle kept-alive connection that has waited
// longest is closed for a new one, and with none idle the new one gets 503. Every wait is
// bounded; the only timing bound is a generous one on how long an answer may take.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "serve/http_gate.h"

namespace d2o::serve {
namespace {

// A connection to 127.0.0.1:port from `from` (any loopback address); -1 when it fails.
int gate_connect(int port, const char* from) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) == 0 &&
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0) {
    return fd;
  }
  ::close(fd);
  return -1;
}

// What arrives on fd until `needle` is in it, the peer closes, or `ms` pass; `closed` tells
// whether the peer closed (or reset) the connection.
std::string gate_read(int fd, int ms, const std::string& needle, bool* closed = nullptr) {
  std::string got;
  if (closed) *closed = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    if (!needle.empty() && got.find(needle) != std::string::npos) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      if (closed) *closed = true;
      break;
    }
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

// GET /health on fd: whether a 200 came back within 5 s.
bool gate_health(int fd) {
  const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != std::ssize(req)) return false;
  return gate_read(fd, 5000, "ok").rfind("HTTP/1.1 200 ", 0) == 0;
}

bool gate_wait(const std::function<bool()>& done, int ms = 5000) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// A gate with /health on a free loopback port, serving on its own thread.
struct GateFixture {
  std::unique_ptr<GatedServer> svr;
  std::thread thread;
  int port = 0;

  explicit GateFixture(const GateOptions& g) : svr(std::make_unique<GatedServer>(g)) {
    svr->Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok", "text/plain");
    });
    svr->Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content("got " + std::to_string(req.body.size()), "text/plain");
    });
    int listen_fd = -1;
    svr->set_socket_options([&](int sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_fd = sock;
    });
    port = svr->bind_to_any_port("127.0.0.1");
    if (listen_fd >= 0) ::listen(listen_fd, SOMAXCONN);  // httplib's backlog is 5
    thread = std::thread([this] { svr->serve(); });
  }
  ~GateFixture() {
    svr->stop();
    thread.join();
  }
  int64_t refused(ConnRefusal r) const { return svr->conn_stats().refused[static_cast<size_t>(r)]; }
};

GateOptions gate_test_options() {
  GateOptions g;
  g.threads = 4;
  g.request_timeout_s = 30;  // no connection times out during a test
  g.keep_alive_timeout_s = 30;
  return g;
}

TEST(ServeGate, OneAddressIsBoundedOthersAreServed) {
  GateOptions g = gate_test_options();
  g.max_conn_per_addr = 4;
  GateFixture f(g);
  ASSERT_GT(f.port, 0);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(gate_connect(f.port, "127.0.0.2"));
    ASSERT_GE(held.back(), 0);
  }
  ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 4; }));
  // The fifth from the same address: 503 with Retry-After, closed, whatever it sends.
  const int over = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(over, 0);
  bool closed = false;
  const std::string got = gate_read(over, 5000, "", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 503 ", 0), 0u) << got;
  EXPECT_NE(got.find("Retry-After: 1\r\n"), std::string::npos) << got;
  EXPECT_TRUE(closed);
  ::close(over);
  EXPECT_EQ(f.refused(ConnRefusal::kPerAddress), 1);
  // Another address is served meanwhile, and so are the four held ones.
  const int other = gate_connect(f.port, "127.0.0.3");
  ASSERT_GE(other, 0);
  EXPECT_TRUE(gate_health(other));
  ::close(other);
  for (int fd : held) EXPECT_TRUE(gate_health(fd));
  // One closed by its client: its address may open one more.
  ::close(held.back());
  held.pop_back();
  ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 3; }));
  const int again = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(again, 0);
  EXPECT_TRUE(gate_health(again));
  EXPECT_EQ(f.refused(ConnRefusal::kPerAddress), 1);
  ::close(again);
  for (int fd : held) ::close(fd);
  EXPECT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 0; }));
}

TEST(ServeGate, AtTheBoundIdleConnectionsGoFirstThenNewOnesAreRefused) {
  GateOptions g = gate_test_options();
  g.max_conn = 6;
  g.max_conn_per_addr = 0;
  GateFixture f(g);
  ASSERT_GT(f.port, 0);
  // Three kept-alive connections answered once (idle in the gate), three that send nothing.
  std::vector<int> idle, silent;
  // Each one is back in the gate, idle, before the next is answered: the order in which they
  // became idle (what "idle longest" means) is then theirs, whatever the handler threads'
  // scheduling (a handler puts its connection back after the client has read the answer).
  for (int i = 0; i < 3; ++i) {
    idle.push_back(gate_connect(f.port, "127.0.0.2"));
    ASSERT_GE(idle.back(), 0);
    ASSERT_TRUE(gate_health(idle.back()));
    ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().idle == i + 1; }));
  }
  for (int i = 0; i < 3; ++i) {
    silent.push_back(gate_connect(f.port, "127.0.0.3"));
    ASSERT_GE(silent.back(), 0);
  }
  ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 6; }));
  // A seventh: the connection idle longest is closed for it, and it is served.
  const int seventh = gate_connect(f.port, "127.0.0.4");
  ASSERT_GE(seventh, 0);
  bool closed = false;
  EXPECT_EQ(gate_read(idle[0], 5000, "", &closed), "");
  EXPECT_TRUE(closed) << "the oldest idle connection is still open";
  EXPECT_TRUE(gate_health(seventh));
  EXPECT_EQ(f.svr->conn_stats().shed, 1);
  EXPECT_TRUE(gate_health(idle[1]));  // the other idle ones stay
  // With no idle connection left, a new one gets 503 at once.
  ::close(seventh);
  for (int fd : idle) ::close(fd);
  ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 3; }));
  for (int i = 0; i < 3; ++i) {
    silent.push_back(gate_connect(f.port, "127.0.0.3"));
    ASSERT_GE(silent.back(), 0);
  }
  ASSERT_TRUE(gate_wait([&] {
    const ConnStats c = f.svr->conn_stats();
    return c.open == 6 && c.idle == 0;
  }));
  const int over = gate_connect(f.port, "127.0.0.5");
  ASSERT_GE(over, 0);
  const std::string got = gate_read(over, 5000, "", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 503 ", 0), 0u) << got;
  EXPECT_TRUE(closed);
  ::close(over);
  EXPECT_EQ(f.refused(ConnRefusal::kMaxConn), 1);
  EXPECT_EQ(f.svr->conn_stats().open, 6);
  for (int fd : silent) ::close(fd);
  EXPECT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 0; }));
}

// Sends all of `s` on fd.
bool gate_send(int fd, const std::string& s) {
  return ::send(fd, s.data(), s.size(), MSG_NOSIGNAL) == std::ssize(s);
}

TEST(ServeGate, RequestFrames) {
  using K = RequestFrame;
  const size_t max = 1000;
  EXPECT_EQ(frame_request("GET / HTTP/1.1\r\nHost: x\r\n", max).kind, K::kPartial);
  RequestFrame f = frame_request("GET / HTTP/1.1\r\nHost: x\r\n\r\n", max);
  EXPECT_EQ(f.kind, K::kWhole);
  EXPECT_TRUE(f.no_length);
  EXPECT_EQ(f.total, f.header_bytes);
  const std::string post = "POST /a HTTP/1.1\r\ncontent-LENGTH:  12 \r\nHost: x\r\n\r\n";
  f = frame_request(post + "abc", max);
  EXPECT_EQ(f.kind, K::kWhole);
  EXPECT_FALSE(f.no_length);
  EXPECT_EQ(f.header_bytes, post.size());
  EXPECT_EQ(f.total, post.size() + 12);
  EXPECT_EQ(frame_request("POST / HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", max).kind,
            K::kTooLarge);
  EXPECT_EQ(frame_request("POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n", max).kind, K::kWhole);
  EXPECT_EQ(frame_request("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n", max).kind,
            K::kLengthRequired);
  for (const char* bad : {"-1", "1e3", "", "0x10", "99999999999999999999", "1 2"}) {
    EXPECT_EQ(
        frame_request(std::string("POST / HTTP/1.1\r\nContent-Length: ") + bad + "\r\n\r\n", max)
            .kind,
        K::kBad)
        << bad;
  }
  EXPECT_EQ(
      frame_request("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", max).kind,
      K::kBad);
  EXPECT_EQ(
      frame_request("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n", max).kind,
      K::kWhole);
}

TEST(ServeGate, RequestFramesFindExpectContinue) {
  const std::string req =
      "POST / HTTP/1.1\r\nHost: x\r\nexpect:  100-Continue\r\nContent-Length: 2\r\n\r\n";
  const RequestFrame f = frame_request(req, 100);
  ASSERT_EQ(f.kind, RequestFrame::kWhole);
  EXPECT_EQ(req.substr(f.expect_at, f.expect_len), "expect:  100-Continue\r\n");
  EXPECT_EQ(frame_request("GET / HTTP/1.1\r\nHost: x\r\n\r\n", 100).expect_len, 0u);
}

TEST(ServeGate, AddrRateIsATokenBucketPerAddress) {
  AddrRate r(10, 3);  // 10 a second, 3 at once
  const auto t0 = AddrRate::Clock::now();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(r.take("a", t0), 0.0);
  const double wait = r.take("a", t0);
  EXPECT_NEAR(wait, 0.1, 1e-9);
  EXPECT_EQ(r.take("b", t0), 0.0);  // another address has its own bucket
  EXPECT_EQ(r.take("a", t0 + std::chrono::milliseconds(100)), 0.0);
  EXPECT_GT(r.take("a", t0 + std::chrono::milliseconds(100)), 0.0);
  // Full again after 0.3 s, and forgotten at the next sweep (every 10 s).
  EXPECT_EQ(r.tracked(), 2u);
  EXPECT_EQ(r.take("c", t0 + std::chrono::seconds(20)), 0.0);
  EXPECT_EQ(r.tracked(), 1u);
  AddrRate off(0, 1);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(off.take("a", t0), 0.0);
}

// A body trickled a few bytes at a time is cut off at the request's deadline (408, counted as
// body_timeout) and holds no handler thread meanwhile: with one handler thread, /health is
// answered throughout.
TEST(ServeGate, ATrickledBodyHoldsNoThreadAndTimesOut) {
  GateOptions g = gate_test_options();
  g.threads = 1;
  g.request_timeout_s = 1.5;
  GateFixture f(g);
  ASSERT_GT(f.port, 0);
  std::vector<int> slow;
  for (int i = 0; i < 3; ++i) {
    slow.push_back(gate_connect(f.port, "127.0.0.2"));
    ASSERT_GE(slow.back(), 0);
    ASSERT_TRUE(gate_send(slow.back(),
                          "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\nab"));
  }
  // Two bytes to each every 200 ms (far more often than the deadline), /health meanwhile,
  // until each is answered.
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> got(slow.size());
  std::vector<bool> done(slow.size(), false);
  while (std::count(done.begin(), done.end(), false) > 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
    const int h = gate_connect(f.port, "127.0.0.3");
    ASSERT_GE(h, 0);
    EXPECT_TRUE(gate_health(h));
    ::close(h);
    for (size_t i = 0; i < slow.size(); ++i) {
      if (done[i]) continue;
      gate_send(slow[i], "cd");
      bool closed = false;
      got[i] += gate_read(slow[i], 200, "", &closed);
      done[i] = closed;
    }
  }
  for (size_t i = 0; i < slow.size(); ++i) {
    EXPECT_TRUE(done[i]);
    EXPECT_EQ(got[i].rfind("HTTP/1.1 408 ", 0), 0u) << got[i];
    EXPECT_NE(got[i].find("request_timeout"), std::string::npos) << got[i];
    ::close(slow[i]);
  }
  // Cut off at the deadline, not per read: they sent bytes more often than every 1.5 s.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(f.refused(ConnRefusal::kBodyTimeout), 3);
  EXPECT_EQ(f.refused(ConnRefusal::kHeaderTimeout), 0);
  EXPECT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 0; }));
}

// Bodies: past max_body 413 at once (from the header alone); Transfer-Encoding 411; a bad
// Content-Length 400; a POST with no Content-Length has an empty body; a body sent whole is
// answered, also in pieces, behind another request on the same connection, and after a
// 100 Continue the client waited for.
TEST(ServeGate, BodiesAreBoundedAndFramedByContentLength) {
  GateOptions g = gate_test_options();
  g.max_body = 1000;
  GateFixture f(g);
  ASSERT_GT(f.port, 0);
  const auto ask = [&](const std::string& req, bool* closed) {
    const int fd = gate_connect(f.port, "127.0.0.2");
    EXPECT_GE(fd, 0);
    EXPECT_TRUE(gate_send(fd, req));
    const std::string got = gate_read(fd, 5000, "", closed);
    ::close(fd);
    return got;
  };
  bool closed = false;
  std::string got = ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 413 ", 0), 0u) << got;
  EXPECT_NE(got.find("--max-body"), std::string::npos) << got;
  EXPECT_TRUE(closed);
  got = ask("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
            &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 411 ", 0), 0u) << got;
  got = ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 400 ", 0), 0u) << got;
  got = ask("POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 200 ", 0), 0u) << got;
  EXPECT_NE(got.find("got 0"), std::string::npos) << got;
  EXPECT_EQ(f.refused(ConnRefusal::kBodyTooLarge), 1);
  EXPECT_EQ(f.refused(ConnRefusal::kLengthRequired), 1);
  EXPECT_EQ(f.refused(ConnRefusal::kBadRequest), 1);
  // In pieces, then two requests at once on one kept-alive connection.
  const int fd = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(gate_send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"));
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_TRUE(gate_send(fd, std::string(100, 'a')));
  }
  got = gate_read(fd, 5000, "got 1000");
  EXPECT_NE(got.find("got 1000"), std::string::npos) << got;
  ASSERT_TRUE(gate_send(fd,
                        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde"));
  got = gate_read(fd, 5000, "got 5");
  EXPECT_NE(got.find("got 3"), std::string::npos) << got;
  EXPECT_NE(got.find("got 5"), std::string::npos) << got;
  // A client waiting for 100 Continue before it sends its body gets one (one only).
  ASSERT_TRUE(gate_send(fd,
                        "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                        "Content-Length: 4\r\n\r\n"));
  got = gate_read(fd, 5000, "\r\n\r\n");
  EXPECT_EQ(got, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(gate_send(fd, "abcd"));
  got = gate_read(fd, 5000, "got 4");
  EXPECT_EQ(got.rfind("HTTP/1.1 200 ", 0), 0u) << got;
  EXPECT_NE(got.find("got 4"), std::string::npos) << got;
  ::close(fd);
  EXPECT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 0; }));
}

// Past its rate, an address gets 429 with Retry-After, on a new connection and on a kept-alive
// one, once its request has arrived; other addresses are served.
TEST(ServeGate, RequestsPastTheRateGet429) {
  GateOptions g = gate_test_options();
  g.rate_per_addr = 0.01;  // one token per 100 s: none comes back during the test
  g.rate_burst = 3;
  GateFixture f(g);
  ASSERT_GT(f.port, 0);
  const int kept = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(kept, 0);
  EXPECT_TRUE(gate_health(kept));  // token 1
  EXPECT_TRUE(gate_health(kept));  // token 2
  const int second = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(second, 0);
  EXPECT_TRUE(gate_health(second));  // token 3
  bool closed = false;
  const int over = gate_connect(f.port, "127.0.0.2");
  ASSERT_GE(over, 0);
  ASSERT_TRUE(gate_send(over, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"));
  std::string got = gate_read(over, 5000, "", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 429 ", 0), 0u) << got;
  EXPECT_NE(got.find("Retry-After: "), std::string::npos) << got;
  EXPECT_NE(got.find("rate_limited"), std::string::npos) << got;
  EXPECT_TRUE(closed);
  ::close(over);
  ASSERT_TRUE(gate_send(kept, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  got = gate_read(kept, 5000, "", &closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 429 ", 0), 0u) << got;
  EXPECT_TRUE(closed);
  ::close(kept);
  EXPECT_EQ(f.refused(ConnRefusal::kRateLimited), 2);
  const int other = gate_connect(f.port, "127.0.0.3");
  ASSERT_GE(other, 0);
  EXPECT_TRUE(gate_health(other));
  ::close(other);
  ::close(second);
  EXPECT_TRUE(gate_wait([&] { return f.svr->conn_stats().open == 0; }));
}

}  // namespace
}  // namespace d2o::serve
