// The linear-attention block of Qwen 3.5 (LayerKind::kRecurrent): a gated delta rule
// (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024) over a per-sequence recurrent
// state (kv/recurrent_state.h), as llama.cpp computes it for qwen35. For the rows of a sequence,
// in order (x: a row of the layer's normalised input):
//
//   m = x Wqkv                        [conv_dim]  all query heads, key heads, value heads
//   c = silu(causal_conv(m))          each channel convolved with its d_conv-wide kernel over this
//                                     row and the d_conv - 1 before it (the conv state)
//   q, k = c's query and key heads, each L2-normalised;  v = c's value heads
//   beta = sigmoid(x Wbeta);  g = softplus(x Walpha + dt_bias) * a   (per value head; a < 0)
//   per value head h (keys and queries of head h mod n_k_head):
//     S_h = exp(g_h) S_h                               S_h [head_dim (v), head_dim (k)]
//     S_h += beta_h (v_h - S_h k) k^T                  the delta rule's write
//     o_h = S_h q / sqrt(head_dim)
//   y = (rmsnorm(o_h) * ssm_norm * silu(z_h) for each head) Wout,   z = x Wgate
//
// Every row's recurrence runs token by token, so a sequence fed in passes of any length gets the
// same state and outputs as fed whole. Heads and channels are independent: the work is split
// over them, each computed by one task in a fixed order (results do not depend on the thread
// count).
#pragma once

#include "core/mem.h"
#include "core/thread_pool.h"
#include "model/forward.h"
#include "model/hparams.h"
#include "model/model.h"

namespace d2o {

class DeltaNet {
 public:
  // Buffers for up to max_rows rows (grown, never shrunk).
  void ensure(const ModelHParams& h, int max_rows);
  // xn [n, n_embd] (the layer's normalised input of in's rows): replaced by the block's output.
  // Each sequence's recurrent state of layer il moves past its rows. Matmul time goes to t.
  void run(const ModelHParams& h, const DeltaNetWeights& w, int il, const UbatchInput& in,
           float* xn, ThreadPool& pool, ForwardTimings& t);

 private:
  void convolve(const ModelHParams& h, const DeltaNetWeights& w, const SeqRows& s, float* state,
                ThreadPool& pool);
  void prepare_rows(const ModelHParams& h, const DeltaNetWeights& w, int n, ThreadPool& pool);
  void recur(const ModelHParams& h, const SeqRows& s, float* state, ThreadPool& pool);
  void gate_rows(const ModelHParams& h, const DeltaNetWeights& w, int n, ThreadPool& pool);

  int rows_cap_ = 0;
  AlignedBuffer<float> mixed_;        // [n, conv_dim] x Wqkv
  AlignedBuffer<float> conv_;         // [n, conv_dim] silu(conv(mixed)), q and k normalised
  AlignedBuffer<float> z_;            // [n, value_dim] the output gate
  AlignedBuffer<float> beta_, gate_;  // [n, n_v_head] write strength; log decay g
  AlignedBuffer<float> out_;          // [n, value_dim] o, then gated and normalised
};

}  // namespace d2o
