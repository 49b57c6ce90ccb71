#include "serve/conn_limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <utility>

namespace d2o::serve {

const char* conn_refusal_name(ConnRefusal r) {
  switch (r) {
    case ConnRefusal::kPerAddress:
      return "per_address";
    case ConnRefusal::kMaxConn:
      return "max_conn";
    case ConnRefusal::kWaitingFull:
      return "waiting_full";
    case ConnRefusal::kHeaderTimeout:
      return "header_timeout";
    case ConnRefusal::kHeaderTooLarge:
      return "header_too_large";
    case ConnRefusal::kBodyTimeout:
      return "body_timeout";
    case ConnRefusal::kBodyTooLarge:
      return "body_too_large";
    case ConnRefusal::kLengthRequired:
      return "length_required";
    case ConnRefusal::kBadRequest:
      return "bad_request";
    case ConnRefusal::kRateLimited:
      return "rate_limited";
    case ConnRefusal::kCount:
      break;
  }
  return "?";
}

ConnLimits::Admit ConnLimits::admit(const std::string& addr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = per_addr_.find(addr);
  const size_t held = it == per_addr_.end() ? 0 : it->second;
  if (max_per_addr_ > 0 && held >= max_per_addr_) {
    refuse_locked(ConnRefusal::kPerAddress, addr, held);
    return Admit::kPerAddress;
  }
  Admit a = Admit::kYes;
  if (max_conn_ > 0 && open_ >= max_conn_) {
    if (idle_ == 0) {
      refuse_locked(ConnRefusal::kMaxConn, addr, held);
      return Admit::kMaxConn;
    }
    --idle_;
    ++to_shed_;
    a = Admit::kShed;
  }
  ++open_;
  ++stats_.accepted;
  if (it == per_addr_.end()) {
    per_addr_.emplace(addr, 1);
  } else {
    ++it->second;
  }
  return a;
}

void ConnLimits::release(const std::string& addr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_ > 0) --open_;
  auto it = per_addr_.find(addr);
  if (it == per_addr_.end()) return;
  if (--it->second == 0) per_addr_.erase(it);
}

void ConnLimits::refused(ConnRefusal r) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.refused[static_cast<size_t>(r)];
}

void ConnLimits::set_idle(size_t idle) {
  std::lock_guard<std::mutex> lock(mu_);
  // Those promised to new connections but not yet closed are no longer free.
  idle_ = idle > to_shed_ ? idle - to_shed_ : 0;
}

size_t ConnLimits::take_shed() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(to_shed_, 0);
}

void ConnLimits::shed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.shed;
}

ConnStats ConnLimits::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ConnStats s = stats_;
  s.open = static_cast<int64_t>(open_);
  s.idle = static_cast<int64_t>(idle_);
  return s;
}

void ConnLimits::refuse_locked(ConnRefusal r, const std::string& addr, size_t held) {
  ++stats_.refused[static_cast<size_t>(r)];
  LogState& l = log_[r == ConnRefusal::kPerAddress ? 0 : 1];
  ++l.since;
  const auto now = Clock::now();
  if (l.last != Clock::time_point{} && now - l.last < std::chrono::seconds(10)) return;
  if (r == ConnRefusal::kPerAddress) {
    std::fprintf(stderr,
                 "d2o serve: refused %lld connection(s) over --max-conn-per-addr %zu (the last "
                 "from %s, which holds %zu)\n",
                 static_cast<long long>(l.since), max_per_addr_, addr.c_str(), held);
  } else {
    std::fprintf(stderr,
                 "d2o serve: refused %lld connection(s) over --max-conn %zu (none idle to close; "
                 "the last from %s)\n",
                 static_cast<long long>(l.since), max_conn_, addr.c_str());
  }
  l.last = now;
  l.since = 0;
}

double AddrRate::take(const std::string& addr, Clock::time_point now) {
  if (rate_ <= 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  const auto refill = [&](Bucket& b) {
    const double dt = std::chrono::duration<double>(now - b.at).count();
    if (dt > 0) b.tokens = std::min(burst_, b.tokens + dt * rate_);
    b.at = std::max(b.at, now);
  };
  if (now - last_sweep_ >= std::chrono::seconds(10)) {
    last_sweep_ = now;
    for (auto it = buckets_.begin(); it != buckets_.end();) {
      refill(it->second);
      it = it->second.tokens >= burst_ ? buckets_.erase(it) : std::next(it);
    }
  }
  auto [it, fresh] = buckets_.try_emplace(addr);
  Bucket& b = it->second;
  if (fresh) {
    b.tokens = burst_;
    b.at = now;
  }
  refill(b);
  if (b.tokens >= 1) {
    b.tokens -= 1;
    return 0;
  }
  return (1 - b.tokens) / rate_;
}

size_t AddrRate::tracked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buckets_.size();
}

size_t raise_open_file_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    rlimit want = r;
    want.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) r = want;
  }
  if (r.rlim_cur == RLIM_INFINITY) return size_t{1} << 20;
  return static_cast<size_t>(r.rlim_cur);
}

size_t default_max_conn(size_t open_file_limit) {
  constexpr size_t kReserve = 128, kMost = 16384, kLeast = 16;
  if (open_file_limit <= kReserve + kLeast) return kLeast;
  return std::min(kMost, open_file_limit - kReserve);
}

}  // namespace d2o::serve
