// Qwen 3.5's forward pass (GGUF architecture qwen35: the dense Qwen 3.5 models, text only).
// Three linear-attention layers to one full-attention layer (as the file's recurrent-layer flags
// or full_attention_interval say); the attention layers use the KV cache, the linear ones a
// recurrent state per sequence (kv/recurrent_state.h).
//
//   x = token_embd[token]
//   every layer:  h = rmsnorm(x) * attn_norm
//     linear:     x += gated delta rule(h)                  (delta_net.h; its state moves on)
//     attention:  q | gate = h Wq (per head);  k, v = h Wk, h Wv
//                 q, k = rmsnorm per head * attn_q_norm, attn_k_norm      (QK-norm)
//                 q, k = RoPE(q, k, position) over rope.dimension_count dims, NeoX layout, the
//                        pairs of the multi-section RoPE's e section (position 0 for text) not
//                        turned (mrope_text_freq_factors)
//                 append k, v to the cache;  x += (attention(q, cache) * sigmoid(gate)) Wo
//                 h = rmsnorm(x) * post_attention_norm
//                 x += (silu(h Wgate) * h Wup) Wdown
//   logits = (rmsnorm(x) * output_norm) Wout   (Wout = token_embd when tied)
//
// Only the attention layers hold keys and values: KV policies compress those and never see the
// recurrent layers. A recurrent state cannot be taken back to an earlier token, so a sequence of
// this model is never cut back to a prefix (KvCache::intact_prefix).
#include <memory>

#include "core/assert.h"
#include "model/archs.h"
#include "model/blocks.h"
#include "model/delta_net.h"
#include "model/kv_attention.h"

namespace d2o {

namespace {

class Qwen35Forward final : public ModelForward {
 public:
  Qwen35Forward(const Model& model, ThreadPool& pool, const ForwardOptions& opts)
      : model_(model),
        pool_(pool),
        max_rows_(opts.max_rows < 1 ? 1 : opts.max_rows),
        attn_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
              model.hparams().head_dim) {
    // What this file computes; describe_model gives qwen35 nothing else.
    for (const LayerDesc& d : model.desc().layers) {
      D2O_ASSERT(d.ffn == FfnKind::kSwiGlu && d.norms.attn_pre && d.norms.ffn_pre &&
                 !d.norms.attn_post && !d.norms.ffn_post && !d.qkv_bias);
      D2O_ASSERT(d.kind == LayerKind::kRecurrent ||
                 (d.kind == LayerKind::kGlobal && d.norms.qk && d.attn_gate));
    }
    D2O_ASSERT(model.desc().embd_scale == 1.0f);
  }

  Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) override {
    const ModelHParams& h = model_.hparams();
    const int n = static_cast<int>(in.tokens.size());
    D2O_ASSERT(n <= max_rows_);
    act_.ensure(h, max_rows_);
    dn_.ensure(h, max_rows_);
    BlockPass b(h, pool_, act_, n, t);

    b.embed(model_.token_embd(), in.tokens);
    for (int il = 0; il < h.n_layer; ++il) {
      const LayerWeights& L = model_.layer(il);
      const LayerDesc& d = model_.desc().layers[static_cast<size_t>(il)];
      b.norm(L.attn_norm);
      if (d.kind == LayerKind::kRecurrent) {
        b.delta_net(L.dn, dn_, il, in);
      } else {
        b.gated_qkv_rope(L, d, in.pos);
        D2O_RETURN_IF_ERROR(b.attention(attn_, il, d, in, hooks));
        b.gate_attention();
        b.attn_output(L.wo);
      }
      b.norm(L.ffn_norm);  // post_attention_norm
      b.ffn(L, FfnKind::kSwiGlu);
    }
    b.add_residual();
    // Every recurrent layer's state has moved past the sequences' rows.
    for (const SeqRows& s : in.seqs) s.cache->recurrent_for_update().n_tokens += s.r1 - s.r0;
    b.logits(model_.output_norm(), model_.output(), in.logit_rows, hooks);
    return {};
  }

 private:
  const Model& model_;
  ThreadPool& pool_;
  const int max_rows_;
  Activations act_;
  DeltaNet dn_;
  KvAttention attn_;
};

}  // namespace

std::unique_ptr<ModelForward> make_qwen35_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts) {
  return std::make_unique<Qwen35Forward>(model, pool, opts);
}

}  // namespace d2o
