// The mixture-of-experts feed-forward (FfnKind::kMoeSwiGlu, Qwen 3 MoE) on the rows of a
// micro-batch:
//
//   p = softmax(h Wrouter)                      over the n_expert experts
//   E = the n_expert_used experts of largest p  (most probable first)
//   w_e = p_e / max(sum_{e' in E} p_e', 2^-14)  (the chosen probabilities renormalised)
//   y = sum_{e in E} w_e * Wdown_e (silu(Wgate_e h) * Wup_e h)
//
// as llama.cpp computes it for qwen3moe (softmax gating, top-k, weights normalised, no scale).
// The rows are grouped by expert before the products, so each chosen expert's matrices are read
// once per micro-batch (for all the rows that chose it) and the experts no row chose are not read
// at all; in a decode step (one row) that is n_expert_used experts of n_expert. Each row's
// weighted sum runs over its experts in the order chosen, so a row's output does not depend on
// which rows share its micro-batch nor on the thread count.
#pragma once

#include <vector>

#include "core/mem.h"
#include "core/thread_pool.h"
#include "model/forward.h"
#include "model/hparams.h"
#include "model/model.h"

namespace d2o {

class MoeFfn {
 public:
  // Buffers for up to max_rows rows of the model `h` (grown, never shrunk: a steady decode loop
  // allocates nothing).
  void ensure(const ModelHParams& h, int max_rows);
  // xn [n, n_embd]: each row replaced by the mixture's output for it. Matmul time goes to t.
  void run(const ModelHParams& h, const MoeWeights& w, float* xn, int n, ThreadPool& pool,
           ForwardTimings& t);

 private:
  void route(const ModelHParams& h, const MoeWeights& w, const float* xn, int n, ThreadPool& pool,
             ForwardTimings& t);
  void group(const ModelHParams& h, const float* xn, int n, ThreadPool& pool);
  void run_experts(const ModelHParams& h, const MoeWeights& w, ThreadPool& pool, ForwardTimings& t);
  void combine(const ModelHParams& h, float* xn, int n, ThreadPool& pool);

  int k_ = 0;  // n_expert_used
  int rows_cap_ = 0;
  AlignedBuffer<float> probs_;      // [n, n_expert] router logits, then probabilities
  std::vector<int> choice_;         // [n, k] chosen experts, most probable first
  std::vector<float> weight_;       // [n, k] their renormalised weights
  std::vector<int> slot_;           // [n, k] where (row, rank) sits in the grouped buffers
  std::vector<int> slot_row_;       // [n * k] the row of each grouped slot
  std::vector<int> offset_;         // [n_expert + 1] each expert's first slot (slots by expert)
  std::vector<int> cursor_;         // [n_expert] scratch for the grouping
  AlignedBuffer<float> xg_;         // [n * k, n_embd] grouped inputs, then the experts' outputs
  AlignedBuffer<float> gate_, up_;  // [n * k, n_ff_exp]
};

}  // namespace d2o
