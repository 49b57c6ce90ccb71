#include "kv/query_window.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"

namespace d2o {

namespace {

// Pair i's angle per position (rope_pair_angles' formula).
double pair_angle(const RopeParams& rope, int i) {
  const double ff = rope.freq_factors ? static_cast<double>(rope.freq_factors[i]) : 1.0;
  return static_cast<double>(rope.freq_scale) *
         std::pow(static_cast<double>(rope.freq_base), -2.0 * i / static_cast<double>(rope.n_rot)) /
         ff;
}

}  // namespace

void rope_pair_angles(const RopeParams& rope, std::vector<double>& theta) {
  const int half = rope.n_rot / 2;
  theta.resize(static_cast<size_t>(std::max(0, half)));
  for (int i = 0; i < half; ++i) theta[static_cast<size_t>(i)] = pair_angle(rope, i);
}

void QueryWindow::configure(int n_head, int head_dim, int cap, float scale,
                            const RopeParams& rope) {
  D2O_ASSERT(n_head > 0 && head_dim > 0 && cap > 0 && rope.n_rot <= head_dim);
  // Called by every pass for every layer: unchanged (the usual case) costs no allocation, and
  // the angles are compared only when the RoPE's parameters are not the ones last seen.
  if (n_head == n_head_ && head_dim == head_dim_ && cap == cap_ && scale == scale_ &&
      rope.type == rope_type_ && rope.n_rot == n_rot_) {
    bool same = rope.freq_base == base_ && rope.freq_scale == freq_scale_ &&
                rope.freq_factors == freq_factors_;
    if (!same) {
      same = true;
      for (int i = 0; same && i < n_rot_ / 2; ++i)
        same = pair_angle(rope, i) == theta_[static_cast<size_t>(i)];
      if (same) {  // the same angles from other parameters: remember these
        base_ = rope.freq_base;
        freq_scale_ = rope.freq_scale;
        freq_factors_ = rope.freq_factors;
      }
    }
    if (same) return;
  }
  base_ = rope.freq_base;
  freq_scale_ = rope.freq_scale;
  freq_factors_ = rope.freq_factors;
  std::vector<double> theta;
  rope_pair_angles(rope, theta);
  n_head_ = n_head;
  head_dim_ = head_dim;
  cap_ = cap;
  scale_ = scale;
  rope_type_ = rope.type;
  n_rot_ = rope.n_rot;
  theta_ = std::move(theta);
  start_ = count_ = 0;
  q_.assign(static_cast<size_t>(cap) * static_cast<size_t>(n_head) * static_cast<size_t>(head_dim),
            0.0f);
}

void QueryWindow::push(const float* q, int n_tok) {
  D2O_ASSERT(cap_ > 0 && n_tok >= 0);
  const size_t row = static_cast<size_t>(n_head_) * static_cast<size_t>(head_dim_);
  // Only the last cap tokens can stay.
  const int skip = std::max(0, n_tok - cap_);
  for (int t = skip; t < n_tok; ++t) {
    const int slot = (start_ + count_) % cap_;
    std::memcpy(q_.data() + static_cast<size_t>(slot) * row, q + static_cast<size_t>(t) * row,
                row * sizeof(float));
    if (count_ < cap_) {
      ++count_;
    } else {
      start_ = (start_ + 1) % cap_;
    }
  }
}

}  // namespace d2o
