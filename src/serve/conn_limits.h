// The bounds on `d2o serve`'s open connections (--max-conn, --max-conn-per-addr), counted by the
// connection gate (serve/http_gate.h) from accept to close, and what was refused.
//
// A connection counts from the moment it is accepted until it is closed, wherever it is: waiting
// in the gate for its header, queued for a handler thread, or being answered. At accept:
//   - one client address may hold max_per_addr connections (0: no bound); one more is refused;
//   - the server may hold max_conn (0: no bound). At the bound, a new connection is still taken
//     while the gate holds idle kept-alive connections not yet promised to others: the gate
//     closes the one idle longest for it (shed). Otherwise it is refused.
// Refusals, and connections the gate gives up on (408, 431, pushed out of the waiting room),
// are counted by reason for /metrics; the two refusals at accept are also logged, at most one
// line per reason every 10 s (with how many were refused since the last line).
// Thread-safe: httplib's accept thread, the gate thread and the handler threads all use it.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace d2o::serve {

enum class ConnRefusal {
  kPerAddress,      // --max-conn-per-addr reached (at accept: 503)
  kMaxConn,         // --max-conn reached with no idle connection to close (at accept: 503)
  kWaitingFull,     // pushed out of the gate's waiting room by newer connections (503)
  kHeaderTimeout,   // the header was not whole by its deadline (408)
  kHeaderTooLarge,  // the header grew past its bound (431)
  kBodyTimeout,     // the body was not whole by the request's deadline (408)
  kBodyTooLarge,    // Content-Length past --max-body (413)
  kLengthRequired,  // a body with no Content-Length (chunked, or none given) (411)
  kBadRequest,      // a Content-Length that is not a number (400)
  kRateLimited,     // past --rate-per-addr (429)
  kCount
};
// The label of a reason in /metrics: per_address, max_conn, waiting_full, header_timeout,
// header_too_large, body_timeout, body_too_large, length_required, bad_request, rate_limited.
const char* conn_refusal_name(ConnRefusal r);

struct ConnStats {
  int64_t open = 0;      // connections open now
  int64_t idle = 0;      // of those, idle kept-alive ones in the gate (after its last pass)
  int64_t accepted = 0;  // connections taken since start
  int64_t shed = 0;      // idle kept-alive connections closed to make room under max_conn
  std::array<int64_t, static_cast<size_t>(ConnRefusal::kCount)> refused{};
};

class ConnLimits {
 public:
  ConnLimits(size_t max_conn, size_t max_per_addr)
      : max_conn_(max_conn), max_per_addr_(max_per_addr) {}

  enum class Admit { kYes, kShed, kPerAddress, kMaxConn };
  // A connection from `addr` was accepted. kYes / kShed: it is counted (kShed: the gate must
  // close one idle connection for it, see take_shed()); a refusal is counted and logged, and
  // the connection is not (the caller refuses it and must not release() it).
  Admit admit(const std::string& addr);
  // A counted connection from `addr` was closed.
  void release(const std::string& addr);
  // The gate gave up on a counted connection for reason r (the caller still release()s it).
  void refused(ConnRefusal r);
  // The gate holds `idle` idle kept-alive connections (after its last pass); those promised to
  // new connections and not yet closed (take_shed) are not counted as free.
  void set_idle(size_t idle);
  // How many idle connections the gate must close now (promised to admitted ones); each one
  // closed for it is counted with shed().
  size_t take_shed();
  void shed();

  ConnStats stats() const;
  size_t max_conn() const { return max_conn_; }
  size_t max_per_addr() const { return max_per_addr_; }

 private:
  using Clock = std::chrono::steady_clock;
  // Counts a refusal at accept and writes its rate-limited line (mu_ held).
  void refuse_locked(ConnRefusal r, const std::string& addr, size_t held);

  const size_t max_conn_, max_per_addr_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, size_t> per_addr_;
  size_t open_ = 0;
  size_t idle_ = 0;     // idle connections in the gate not yet promised to new ones
  size_t to_shed_ = 0;  // promised, not yet closed by the gate
  ConnStats stats_;
  // The rate limit of the log lines, per reason at accept: when the last line was written, and
  // the refusals since then.
  struct LogState {
    Clock::time_point last{};
    int64_t since = 0;
  };
  std::array<LogState, 2> log_{};
};

// A token bucket per client address (--rate-per-addr): each request takes a token; an address
// holds at most `burst` tokens and gets `rate` a second back. Addresses whose bucket is full
// again are forgotten (checked every 10 s), so the table holds only the addresses seen lately.
// rate 0: no bound. Thread-safe.
class AddrRate {
 public:
  using Clock = std::chrono::steady_clock;
  AddrRate(double rate, double burst) : rate_(rate), burst_(std::max(1.0, burst)) {}
  // Takes a token for `addr`: 0 when there was one, else the seconds until there is one (> 0).
  double take(const std::string& addr, Clock::time_point now = Clock::now());
  bool enabled() const { return rate_ > 0; }
  size_t tracked() const;

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point at{};
  };
  const double rate_, burst_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;
  Clock::time_point last_sweep_{};
};

// Raises the soft limit on open files to the hard limit; returns the soft limit after (0 when
// it cannot be read).
size_t raise_open_file_limit();
// --max-conn when not given: the open-file limit less 128 descriptors for everything else
// (model, session files, the listener), at most 16384 (each connection may buffer a 16 KiB
// header: 256 MiB at most), at least 16.
size_t default_max_conn(size_t open_file_limit);

}  // namespace d2o::serve
