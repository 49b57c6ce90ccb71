// The llama family's forward pass: llama, mistral (SmolLM2, Llama 2/3, Mistral), qwen2 (the same
// with biases on Q, K and V and NeoX RoPE) and qwen3 (no biases; NeoX RoPE and QK-norm: each head
// of Q and K RMS-normalised before RoPE). The differences are LayerDesc fields (qkv_bias,
// norms.qk, rope) that BlockPass::qkv_rope reads, so one block serves all four. Llama 3.1's
// long-context scaling is in the RoPE too (per-pair frequency factors, RopeParams::freq_factors).
// Phi-3 is this layer with NeoX RoPE; its fused Q/K/V and gate/up tensors are split at load.
//
//   x = token_embd[token]
//   every layer:  h = rmsnorm(x) * attn_norm
//                 q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)
//                 q, k = rmsnorm per head * attn_q_norm, attn_k_norm     (qwen3: QK-norm)
//                 q, k = RoPE(q, k, position)
//                 append k, v to the cache;  x += attention(q, cache) Wo
//                 h = rmsnorm(x) * ffn_norm;  x += (silu(h Wgate) * h Wup) Wdown
//   logits = (rmsnorm(x) * output_norm) Wout   (Wout = token_embd when tied)
#include <memory>

#include "core/assert.h"
#include "model/archs.h"
#include "model/blocks.h"
#include "model/kv_attention.h"

namespace d2o {

namespace {

class LlamaForward final : public ModelForward {
 public:
  LlamaForward(const Model& model, ThreadPool& pool, const ForwardOptions& opts)
      : model_(model),
        pool_(pool),
        max_rows_(opts.max_rows < 1 ? 1 : opts.max_rows),
        attn_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
              model.hparams().head_dim) {
    // What this file computes; describe_model gives the llama family nothing else.
    for (const LayerDesc& d : model.desc().layers) {
      D2O_ASSERT(d.kind == LayerKind::kGlobal && d.ffn == FfnKind::kSwiGlu);
      D2O_ASSERT(d.norms.attn_pre && d.norms.ffn_pre && !d.norms.attn_post && !d.norms.ffn_post);
    }
    D2O_ASSERT(model.desc().embd_scale == 1.0f);
  }

  Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) override {
    const ModelHParams& h = model_.hparams();
    const int n = static_cast<int>(in.tokens.size());
    D2O_ASSERT(n <= max_rows_);
    act_.ensure(h, max_rows_);
    BlockPass b(h, pool_, act_, n, t);

    b.embed(model_.token_embd(), in.tokens);
    for (int il = 0; il < h.n_layer; ++il) {
      const LayerWeights& L = model_.layer(il);
      const LayerDesc& d = model_.desc().layers[static_cast<size_t>(il)];
      // Attention block.
      b.norm(L.attn_norm);
      b.qkv_rope(L, d, in.pos);  // biases and QK-norm as d says
      D2O_RETURN_IF_ERROR(b.attention(attn_, il, d, in, hooks));
      b.attn_output(L.wo);
      // Feed-forward block (SwiGLU).
      b.norm(L.ffn_norm);
      b.ffn(L, FfnKind::kSwiGlu);
    }
    b.add_residual();
    b.logits(model_.output_norm(), model_.output(), in.logit_rows, hooks);
    return {};
  }

 private:
  const Model& model_;
  ThreadPool& pool_;
  const int max_rows_;
  Activations act_;
  KvAttention attn_;
};

}  // namespace

std::unique_ptr<ModelForward> make_llama_forward(const Model& model, ThreadPool& pool,
                                                 const ForwardOptions& opts) {
  return std::make_unique<LlamaForward>(model, pool, opts);
}

}  // namespace d2o
