#include "eval/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "core/timer.h"

namespace d2o::eval {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  const long t = std::lround(s);
  if (t >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
  } else if (t >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lds", t);
  }
  return buf;
}

Progress::Progress(std::string label, double total, std::FILE* out)
    : label_(std::move(label)), total_(std::max(total, 1e-12)), out_(out), start_ns_(now_ns()) {
  if (out_) tty_ = ::isatty(::fileno(out_)) != 0;
  if (out_ && !tty_) {
    std::fprintf(out_, "%s: started\n", label_.c_str());
    std::fflush(out_);
  }
}

Progress::~Progress() {
  finish();
}

double Progress::elapsed_seconds() const {
  return static_cast<double>(now_ns() - start_ns_) * 1e-9;
}

void Progress::update(double done, const std::string& note) {
  done_ = std::clamp(std::max(done, done_), 0.0, total_);
  note_ = note;
  if (!out_ || finished_) return;
  const int64_t t = now_ns();
  if (tty_) {
    if (t - last_draw_ns_ < 200'000'000 && done_ < total_) return;
    last_draw_ns_ = t;
    draw(false);
  } else {
    const int decile = static_cast<int>(std::floor(10.0 * done_ / total_));
    if (decile > last_decile_ && decile < 10) {
      last_decile_ = decile;
      draw(false);
    }
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (!out_) return;
  done_ = total_;
  draw(true);
}

void Progress::draw(bool final_line) {
  const double frac = done_ / total_;
  const double el = elapsed_seconds();
  std::string eta = "?";
  if (done_ > 0) eta = format_duration(el / done_ * (total_ - done_));
  constexpr int kWidth = 28;
  const int fill = static_cast<int>(std::lround(frac * kWidth));
  std::string bar(static_cast<size_t>(fill), '#');
  bar.append(static_cast<size_t>(kWidth - fill), '-');
  if (final_line) {
    std::fprintf(out_, "%s%s [%s] 100%% done in %s%s%s\n", tty_ ? "\r" : "", label_.c_str(),
                 bar.c_str(), format_duration(el).c_str(), note_.empty() ? "" : "  ",
                 note_.c_str());
  } else {
    std::fprintf(out_, "%s%s [%s] %3.0f%% elapsed %s ETA %s%s%s%s", tty_ ? "\r" : "",
                 label_.c_str(), bar.c_str(), 100.0 * frac, format_duration(el).c_str(),
                 eta.c_str(), note_.empty() ? "" : "  ", note_.c_str(), tty_ ? "\033[K" : "\n");
  }
  std::fflush(out_);
}

}  // namespace d2o::eval
