// The pieces decoder layers are built from, shared by the architecture files
// (src/model/arch_*.cpp): embedding, RMSNorm with the residual add folded in, Q/K/V projection with
// biases and RoPE, attention over the sequences' caches (KvAttention, kv_attention.h), the output
// projection and the feed-forward kinds (the mixture of experts in moe.h).
//
// Every piece works on all n rows of a micro-batch and keeps the work layout the engine has always
// had: per-row work in pool.parallel_for chunks of 16 rows, products that share an input as one
// matmul_many call, one attention call per layer. The data flow, all [n, width] buffers of
// Activations:
//
//   x   the residual stream.
//   xn  a block's normalised input, then the block's output: a block (attention output
//       projection, feed-forward) leaves its output in xn and marks the residual pending; the next
//       norm() adds it to x row by row inside its own parallel loop (element-wise, so the same
//       values as a separate pass) before normalising, and add_residual() does the last one.
//
// Matmul and attention wall time go to ForwardTimings.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/mem.h"
#include "core/thread_pool.h"
#include "model/delta_net.h"
#include "model/forward.h"
#include "model/kv_attention.h"
#include "model/layer_desc.h"
#include "model/model.h"
#include "model/moe.h"
#include "ops/matmul.h"

namespace d2o {

// Activations of one micro-batch (grown to the largest, never shrunk, so a steady decode loop
// allocates nothing).
struct Activations {
  AlignedBuffer<float> x;         // [n, n_embd]
  AlignedBuffer<float> xn;        // [n, max(n_embd, q_dim)]
  AlignedBuffer<float> q;         // [n, n_head * head_dim]
  AlignedBuffer<float> k, v;      // [n, n_head_kv * head_dim]
  AlignedBuffer<float> attn_out;  // [n, n_head * head_dim]
  AlignedBuffer<float> gate, up;  // [n, n_ff] (empty for a mixture of experts: MoeFfn's own)
  AlignedBuffer<float> logits;    // [ForwardHooks::kLogitRows, n_vocab], allocated on first use
  // Gated attention (LayerDesc::attn_gate; empty otherwise): Q's projection, then the gates.
  AlignedBuffer<float> q_gate;     // [n, 2 * n_head * head_dim]
  AlignedBuffer<float> gate_attn;  // [n, n_head * head_dim]
  int rows_cap = 0;
  void ensure(const ModelHParams& h, int n_rows);
};

// One micro-batch going through the pieces, in the order the architecture file calls them.
class BlockPass {
 public:
  BlockPass(const ModelHParams& h, ThreadPool& pool, Activations& a, int n_rows, ForwardTimings& t);

  // x = rows of `table` for the tokens, times `scale` (ModelDesc::embd_scale) unless 1.
  void embed(const QMatrix& table, std::span<const int32_t> tokens, float scale = 1.0f);
  // x += the pending block output; xn = rmsnorm(x) * w.
  void norm(const std::vector<float>& w);
  // A sandwich norm on the pending block output (still pending): xn = rmsnorm(xn) * w.
  void post_norm(const std::vector<float>& w);
  // x += the pending block output (after the last layer).
  void add_residual();
  // q, k, v = xn Wq, xn Wk, xn Wv (+ biases if d.qkv_bias); with d.norms.qk, each head of q and
  // k RMS-normalised (weights attn_q_norm, attn_k_norm); RoPE of d at the rows' positions on q
  // and k.
  void qkv_rope(const LayerWeights& L, const LayerDesc& d, std::span<const int32_t> pos);
  // A gated attention layer (d.attn_gate): xn Wq holds each head's query and then its gate; q
  // and the gates are split from it, k and v as above, then QK-norm and RoPE as above.
  void gated_qkv_rope(const LayerWeights& L, const LayerDesc& d, std::span<const int32_t> pos);
  // attn_out *= sigmoid(the gates of gated_qkv_rope), after attention().
  void gate_attention();
  // Appends k, v to every sequence's cache and runs attention into attn_out.
  Status attention(KvAttention& attn, int il, const LayerDesc& d, const UbatchInput& in,
                   ForwardHooks& hooks);
  // xn = attn_out Wo; the residual is pending.
  void attn_output(const QMatrix& wo);
  // xn = Wdown (act(Wgate xn) * Wup xn), act = silu (kSwiGlu) or tanh GELU (kGeGluTanh); the
  // residual is pending.
  void ffn(const LayerWeights& L, FfnKind kind);
  // xn = the mixture of experts' output for each row (FfnKind::kMoeSwiGlu, moe.h), computed with
  // `moe`'s buffers; the residual is pending.
  void moe_ffn(const MoeWeights& w, MoeFfn& moe);
  // xn = the linear-attention block's output (LayerKind::kRecurrent, delta_net.h) for layer il,
  // computed with `dn`'s buffers; each sequence's recurrent state moves past its rows; the
  // residual is pending.
  void delta_net(const DeltaNetWeights& w, DeltaNet& dn, int il, const UbatchInput& in);
  // For the rows, kLogitRows at a time: rmsnorm(x) * norm_w, times `output` (soft-capped when
  // softcap > 0), to hooks.logits.
  void logits(const std::vector<float>& norm_w, const QMatrix& output, std::span<const int> rows,
              ForwardHooks& hooks, float softcap = 0.0f);

 private:
  void mm(const QMatrix& w, const float* in, float* out);
  void mm_many(std::initializer_list<MatmulCall> calls);
  // Per row: the biases, QK-norm and RoPE of qkv_rope on q and k.
  void bias_norm_rope(const LayerWeights& L, const LayerDesc& d, std::span<const int32_t> pos);

  const ModelHParams& h_;
  ThreadPool& pool_;
  Activations& a_;
  const int n_;
  ForwardTimings& t_;
  bool residual_pending_ = false;
};

}  // namespace d2o
