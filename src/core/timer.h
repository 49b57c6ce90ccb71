// Wall-clock timing for reports and benchmarks (never asserted in tests).
#pragma once

#include <chrono>
#include <cstdint>

namespace d2o {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(now_ns()) {}
  void reset() { start_ = now_ns(); }
  double seconds() const { return static_cast<double>(now_ns() - start_) * 1e-9; }
  double millis() const { return static_cast<double>(now_ns() - start_) * 1e-6; }

 private:
  int64_t start_;
};

}  // namespace d2o
