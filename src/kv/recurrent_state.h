// RecurrentState: what a sequence keeps of its past in a model's recurrent layers (Qwen 3.5's
// linear-attention layers, LayerKind::kRecurrent), beside the keys and values of its attention
// layers. Per recurrent layer il:
//   conv[il]   [d_conv - 1, conv_dim]               the last d_conv - 1 inputs of the causal
//                                                   convolution, oldest first
//   delta[il]  [n_v_head, head_dim (v), head_dim (k)] the delta rule's state matrix per value head
// (empty for the other layers). n_tokens counts the tokens folded in: the state is that of a
// sequence fed exactly its first n_tokens tokens, and cannot be taken back to fewer (a sequence
// with such a state cannot be cut back to a prefix; it is rebuilt). Owned by the sequence's
// KvCache, copied and saved with it; KV policies never read or change it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace d2o {

struct RecurrentState {
  std::vector<std::vector<float>> conv;   // [n_layer][(d_conv - 1) * conv_dim] or empty
  std::vector<std::vector<float>> delta;  // [n_layer][n_v_head * head_dim * head_dim] or empty
  int64_t n_tokens = 0;

  // Zeroes every layer's state (a new sequence).
  void reset() {
    for (auto& c : conv) std::fill(c.begin(), c.end(), 0.0f);
    for (auto& d : delta) std::fill(d.begin(), d.end(), 0.0f);
    n_tokens = 0;
  }
  size_t bytes() const {
    size_t n = 0;
    for (const auto& c : conv) n += c.size() * sizeof(float);
    for (const auto& d : delta) n += d.size() * sizeof(float);
    return n;
  }
};

}  // namespace d2o
