// QueryWindow: the last queries one layer of a sequence saw, per query head, before RoPE: what
// expected attention (kv/policy/score_expected.cpp) estimates the next queries from.
//
// The attention pass records them (model/kv_attention.cpp) when the sequence's KV policy asks
// (StatsNeeds::queries = w): each pass appends its last min(w, tokens) queries, each rotated back
// from its position (RoPE at -pos), and the window keeps the last w tokens' queries of the
// sequence, across passes (a decode step pushes one and drops the oldest). Memory: w x n_head x
// head_dim floats per layer, whatever the sequence's length (a ring, not a growing list).
//
// It keeps the attention's scale and the RoPE as per-pair angles per position (not the model's
// RopeParams, whose frequency factors live in the model), so a compaction can turn the statistics
// towards future positions without the model at hand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/ops.h"

namespace d2o {

class QueryWindow {
 public:
  // Holds up to `cap` tokens' queries of n_head heads of head_dim elements, for a layer of
  // attention scale `scale` and RoPE `rope`. Keeps what it holds when the shape, scale and RoPE
  // are unchanged; otherwise starts empty.
  void configure(int n_head, int head_dim, int cap, float scale, const RopeParams& rope);
  // Appends n_tok tokens' queries, [n_tok, n_head * head_dim], already rotated back to position
  // 0; beyond cap the oldest go.
  void push(const float* q, int n_tok);
  // Forgets everything and frees the memory.
  void clear() { *this = QueryWindow(); }

  int count() const { return count_; }  // tokens held (<= cap)
  bool empty() const { return count_ == 0; }
  int cap() const { return cap_; }
  int n_head() const { return n_head_; }
  int head_dim() const { return head_dim_; }
  float scale() const { return scale_; }
  RopeType rope_type() const { return rope_type_; }
  int n_rot() const { return n_rot_; }
  // [n_rot / 2] the angle pair i turns by per position: freq_scale * base^(-2i / n_rot) / ff_i.
  const double* theta() const { return theta_.data(); }
  // Query head h's query of the i-th oldest token held (i < count()), [head_dim].
  const float* query(int h, int i) const {
    const int slot = (start_ + i) % cap_;
    return q_.data() + (static_cast<size_t>(slot) * n_head_ + static_cast<size_t>(h)) * head_dim_;
  }
  // Bytes held (the ring and the angles).
  size_t bytes() const { return q_.capacity() * sizeof(float) + theta_.capacity() * sizeof(double); }
  // Bytes a window of that shape holds.
  static size_t bytes_for(int n_head, int head_dim, int cap, int n_rot) {
    return static_cast<size_t>(cap) * static_cast<size_t>(n_head) *
               static_cast<size_t>(head_dim) * sizeof(float) +
           static_cast<size_t>(n_rot / 2) * sizeof(double);
  }

 private:
  int n_head_ = 0, head_dim_ = 0, cap_ = 0;
  int start_ = 0, count_ = 0;  // the oldest token's ring slot, tokens held
  float scale_ = 0.0f;
  RopeType rope_type_ = RopeType::kNorm;
  int n_rot_ = 0;
  // The RoPE parameters the angles were formed from (a pass with the same ones keeps the window).
  float base_ = 0.0f, freq_scale_ = 0.0f;
  const float* freq_factors_ = nullptr;
  std::vector<double> theta_;  // [n_rot / 2]
  std::vector<float> q_;       // [cap, n_head, head_dim], a ring of tokens
};

// The angle each RoPE pair turns by per position, as rope_tables() forms it (in double):
// theta[i] = freq_scale * base^(-2i / n_rot) / freq_factors[i], i < n_rot / 2.
void rope_pair_angles(const RopeParams& rope, std::vector<double>& theta);

}  // namespace d2o
