// Qwen 3 MoE's forward pass (GGUF architecture qwen3moe: Qwen3-30B-A3B, Qwen3-235B-A22B and the
// small mixtures built on them). Qwen 3's attention layer with a routed mixture of SwiGLU experts
// (moe.h) as its feed-forward block.
//
//   x = token_embd[token]
//   every layer:  h = rmsnorm(x) * attn_norm
//                 q, k, v = h Wq, h Wk, h Wv
//                 q, k = rmsnorm per head * attn_q_norm, attn_k_norm      (QK-norm)
//                 q, k = RoPE(q, k, position)                             (NeoX layout)
//                 append k, v to the cache;  x += attention(q, cache) Wo
//                 h = rmsnorm(x) * ffn_norm
//                 p = softmax(h Wrouter);  E = the n_expert_used experts of largest p
//                 x += sum_{e in E} p_e / sum_E p * (silu(h Wgate_e) * h Wup_e) Wdown_e
//   logits = (rmsnorm(x) * output_norm) Wout   (Wout = token_embd when tied)
//
// The attention layers are ordinary global layers: KV policies work on this model unchanged.
#include <memory>

#include "core/assert.h"
#include "model/archs.h"
#include "model/blocks.h"
#include "model/kv_attention.h"
#include "model/moe.h"

namespace d2o {

namespace {

class Qwen3MoeForward final : public ModelForward {
 public:
  Qwen3MoeForward(const Model& model, ThreadPool& pool, const ForwardOptions& opts)
      : model_(model),
        pool_(pool),
        max_rows_(opts.max_rows < 1 ? 1 : opts.max_rows),
        attn_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
              model.hparams().head_dim) {
    // What this file computes; describe_model gives qwen3moe nothing else.
    for (const LayerDesc& d : model.desc().layers) {
      D2O_ASSERT(d.kind == LayerKind::kGlobal && d.ffn == FfnKind::kMoeSwiGlu);
      D2O_ASSERT(d.norms.attn_pre && d.norms.ffn_pre && d.norms.qk && !d.norms.attn_post &&
                 !d.norms.ffn_post);
    }
    D2O_ASSERT(model.desc().embd_scale == 1.0f && model.hparams().n_expert > 0);
  }

  Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) override {
    const ModelHParams& h = model_.hparams();
    const int n = static_cast<int>(in.tokens.size());
    D2O_ASSERT(n <= max_rows_);
    act_.ensure(h, max_rows_);
    moe_.ensure(h, max_rows_);
    BlockPass b(h, pool_, act_, n, t);

    b.embed(model_.token_embd(), in.tokens);
    for (int il = 0; il < h.n_layer; ++il) {
      const LayerWeights& L = model_.layer(il);
      const LayerDesc& d = model_.desc().layers[static_cast<size_t>(il)];
      // Attention block (Qwen 3's: QK-norm, NeoX RoPE).
      b.norm(L.attn_norm);
      b.qkv_rope(L, d, in.pos);
      D2O_RETURN_IF_ERROR(b.attention(attn_, il, d, in, hooks));
      b.attn_output(L.wo);
      // Feed-forward block: the routed experts.
      b.norm(L.ffn_norm);
      b.moe_ffn(L.moe, moe_);
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
  MoeFfn moe_;
  KvAttention attn_;
};

}  // namespace

std::unique_ptr<ModelForward> make_qwen3moe_forward(const Model& model, ThreadPool& pool,
                                                    const ForwardOptions& opts) {
  return std::make_unique<Qwen3MoeForward>(model, pool, opts);
}

}  // namespace d2o
