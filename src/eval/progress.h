// A progress bar with an ETA for long evaluation runs, written to a terminal stream (stderr).
//
// Work is counted in caller-chosen units (tokens fed, trials, steps): the ETA assumes the
// remaining units cost what the finished ones did on average, so callers with uneven work (a
// needle trial at 8K tokens costs far more than one at 1K) should count in units proportional to
// cost. On a terminal the bar redraws in place at most a few times a second; on a file or pipe it
// prints a line every 10%, so logs stay short. Output never affects the results.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace d2o::eval {

class Progress {
 public:
  // out = nullptr: silent.
  Progress(std::string label, double total, std::FILE* out);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Sets the amount of work done so far (monotone) and an optional note ("d2o 4/8").
  void update(double done, const std::string& note = "");
  void add(double units, const std::string& note = "") { update(done_ + units, note); }
  // Prints the final line (100%, total time). Called by the destructor if not called before.
  void finish();
  double elapsed_seconds() const;

 private:
  void draw(bool final_line);

  std::string label_;
  double total_;
  double done_ = 0;
  std::string note_;
  std::FILE* out_;
  bool tty_ = false;
  bool finished_ = false;
  int64_t start_ns_;
  int64_t last_draw_ns_ = 0;
  int last_decile_ = -1;
};

// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);

}  // namespace d2o::eval
