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
  int64_t refused(ConnRefusal r) const {
    return svr->conn_stats().refused[static_cast<size_t>(r)];
  }
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
  for (int i = 0; i < 3; ++i) {
    idle.push_back(gate_connect(f.port, "127.0.0.2"));
    ASSERT_GE(idle.back(), 0);
    ASSERT_TRUE(gate_health(idle.back()));
  }
  ASSERT_TRUE(gate_wait([&] { return f.svr->conn_stats().idle == 3; }));
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

}  // namespace
}  // namespace d2o::serve
