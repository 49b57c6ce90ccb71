// Gemma 3's forward pass (GGUF architecture gemma3).
//
//   x = token_embd[token] * sqrt(n_embd)
//   every layer:  h = rmsnorm(x) * attn_norm
//                 q, k, v = h Wq, h Wk, h Wv
//                 q, k = rmsnorm per head * attn_q_norm, attn_k_norm      (QK-norm)
//                 q, k = RoPE(q, k, position)     (base 10000 on sliding-window layers, the file's
//                                                  base and scaling on global ones)
//                 append k, v to the cache;  a = attention(q, cache) Wo
//                     (sliding-window layers: each query sees the last `window` positions)
//                 x += rmsnorm(a) * post_attention_norm                    (sandwich norm)
//                 h = rmsnorm(x) * ffn_norm
//                 x += rmsnorm((gelu_tanh(h Wgate) * h Wup) Wdown) * post_ffw_norm
//   logits = (rmsnorm(x) * output_norm) token_embd^T    (tied output matrix)
//
// The attention scale is 1 / sqrt(head_dim) (LayerDesc::attn_scale). Five sliding-window layers
// to one global layer (ModelHParams::is_sliding); a KV policy compacts only the global layers.
#include <memory>

#include "core/assert.h"
#include "model/archs.h"
#include "model/blocks.h"
#include "model/kv_attention.h"

namespace d2o {

namespace {

class Gemma3Forward final : public ModelForward {
 public:
  Gemma3Forward(const Model& model, ThreadPool& pool, const ForwardOptions& opts)
      : model_(model),
        pool_(pool),
        max_rows_(opts.max_rows < 1 ? 1 : opts.max_rows),
        attn_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
              model.hparams().head_dim) {
    for (const LayerDesc& d : model.desc().layers) {
      D2O_ASSERT(d.ffn == FfnKind::kGeGluTanh && !d.qkv_bias);
      D2O_ASSERT(d.norms.attn_pre && d.norms.attn_post && d.norms.ffn_pre && d.norms.ffn_post &&
                 d.norms.qk);
    }
  }

  Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) override {
    const ModelHParams& h = model_.hparams();
    const int n = static_cast<int>(in.tokens.size());
    D2O_ASSERT(n <= max_rows_);
    act_.ensure(h, max_rows_);
    BlockPass b(h, pool_, act_, n, t);

    b.embed(model_.token_embd(), in.tokens, model_.desc().embd_scale);
    for (int il = 0; il < h.n_layer; ++il) {
      const LayerWeights& L = model_.layer(il);
      const LayerDesc& d = model_.desc().layers[static_cast<size_t>(il)];
      // Attention block, sandwiched.
      b.norm(L.attn_norm);
      b.qkv_rope(L, d, in.pos);
      D2O_RETURN_IF_ERROR(b.attention(attn_, il, d, in, hooks));
      b.attn_output(L.wo);
      b.post_norm(L.attn_post_norm);
      // Feed-forward block (GeGLU), sandwiched.
      b.norm(L.ffn_norm);
      b.ffn(L, FfnKind::kGeGluTanh);
      b.post_norm(L.ffn_post_norm);
    }
    b.add_residual();
    b.logits(model_.output_norm(), model_.output(), in.logit_rows, hooks,
             model_.desc().logit_softcap);
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

std::unique_ptr<ModelForward> make_gemma3_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts) {
  return std::make_unique<Gemma3Forward>(model, pool, opts);
}

}  // namespace d2o
