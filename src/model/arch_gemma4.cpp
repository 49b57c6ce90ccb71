// Gemma 4's forward pass (GGUF architecture gemma4: the dense models, text only).
//
//   x = token_embd[token] * sqrt(n_embd)
//   per-layer inputs (n_embd_per_layer = P > 0), for every layer l:
//     e_l = (rmsnorm((x W_pl_proj)[l] / sqrt(n_embd)) * per_layer_proj_norm
//            + per_layer_token_embd[token][l] * sqrt(P)) / sqrt(2)
//   every layer:  h = rmsnorm(x) * attn_norm
//                 q = h Wq;  q = rmsnorm per head * attn_q_norm;  q = RoPE(q)
//                 own keys:  k, v = h Wk, h Wv;  k = rmsnorm per head * attn_k_norm, RoPE;
//                            v = rmsnorm per head (no weight); append k, v to the layer's cache
//                 a = attention(q, the cache of kv_source(layer)) Wo    (scale 1)
//                 x += rmsnorm(a) * post_attention_norm                        (sandwich norm)
//                 x += rmsnorm((gelu_tanh(h' Wgate) * h' Wup) Wdown) * post_ffw_norm,
//                      h' = rmsnorm(x) * ffn_norm
//                 P > 0:  x += rmsnorm((gelu_tanh(x W_inp_gate) * e_l) W_proj) * post_norm
//                 x *= layer_output_scale
//   logits = softcap((rmsnorm(x) * output_norm) token_embd^T)
//
// Sliding-window layers (the file's per-layer pattern) have heads of head_dim_swa and their own
// RoPE base; global layers heads of head_dim and the file's rope_freqs as frequency factors (their
// proportional RoPE). The last n_kv_shared layers compute no keys or values: they attend over the
// cache of the last earlier layer of their kind (ModelHParams::kv_source), which they leave as it
// is. Only the global layers that hold their own keys are compressible: a KV policy decides once
// for each such cache, and the layers that read it see what it kept.
#include <algorithm>
#include <cmath>
#include <memory>
#include <span>

#include "core/assert.h"
#include "core/timer.h"
#include "model/archs.h"
#include "model/blocks.h"
#include "model/kv_attention.h"
#include "ops/ops.h"

namespace d2o {

namespace {

class Gemma4Forward final : public ModelForward {
 public:
  Gemma4Forward(const Model& model, ThreadPool& pool, const ForwardOptions& opts)
      : model_(model),
        pool_(pool),
        max_rows_(opts.max_rows < 1 ? 1 : opts.max_rows),
        attn_global_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
                     model.hparams().head_dim),
        attn_sliding_(pool, opts.attn_split, model.hparams().n_head, model.hparams().n_head_kv,
                      model.hparams().head_dim_swa) {
    for (const LayerDesc& d : model.desc().layers) {
      D2O_ASSERT(d.ffn == FfnKind::kGeGluTanh && !d.qkv_bias && !d.attn_gate);
      D2O_ASSERT(d.norms.attn_pre && d.norms.attn_post && d.norms.ffn_pre && d.norms.ffn_post &&
                 d.norms.qk);
    }
    ones_.assign(
        static_cast<size_t>(std::max(model.hparams().head_dim, model.hparams().head_dim_swa)),
        1.0f);
  }

  Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) override {
    const ModelHParams& h = model_.hparams();
    const int n = static_cast<int>(in.tokens.size());
    D2O_ASSERT(n <= max_rows_);
    act_.ensure(h, max_rows_);
    BlockPass b(h, pool_, act_, n, t);

    b.embed(model_.token_embd(), in.tokens, model_.desc().embd_scale);
    if (h.n_embd_per_layer > 0) per_layer_inputs(in, n, t);
    for (int il = 0; il < h.n_layer; ++il) {
      const LayerWeights& L = model_.layer(il);
      const LayerDesc& d = model_.desc().layers[static_cast<size_t>(il)];
      const bool own_kv = h.kv_source(il) == il;
      // Attention block, sandwiched.
      b.norm(L.attn_norm);
      qkv_rope(L, d, own_kv, in.pos, n, t);
      KvAttention& attn = d.kind == LayerKind::kSliding ? attn_sliding_ : attn_global_;
      Stopwatch s;
      Status st = attn.run(il, d, in, act_.q.data(), own_kv ? act_.k.data() : nullptr,
                           own_kv ? act_.v.data() : nullptr, act_.attn_out.data(), hooks);
      t.attention_s += s.seconds();
      D2O_RETURN_IF_ERROR(st);
      b.attn_output(L.wo);
      b.post_norm(L.attn_post_norm);
      // Feed-forward block (GeGLU), sandwiched.
      b.norm(L.ffn_norm);
      b.ffn(L, FfnKind::kGeGluTanh);
      b.post_norm(L.ffn_post_norm);
      b.add_residual();
      if (h.n_embd_per_layer > 0) per_layer_block(L, il, n, t);
      if (L.out_scale != 1.0f) scale_rows(n, L.out_scale);
    }
    b.logits(model_.output_norm(), model_.output(), in.logit_rows, hooks,
             model_.desc().logit_softcap);
    return {};
  }

 private:
  void mm(const QMatrix& w, const float* x, int n, float* out, ForwardTimings& t) {
    Stopwatch s;
    matmul(w, x, n, out, pool_);
    t.matmul_s += s.seconds();
  }

  // q (and, for a layer with its own keys, k and v) of the rows, normalised and turned.
  void qkv_rope(const LayerWeights& L, const LayerDesc& d, bool own_kv,
                std::span<const int32_t> pos, int n, ForwardTimings& t) {
    const ModelHParams& h = model_.hparams();
    const int hd = d.rope.head_dim, q_dim = h.n_head * hd, kv_dim = h.n_head_kv * hd;
    Stopwatch s;
    if (own_kv) {
      const MatmulCall calls[] = {{&L.wq, act_.xn.data(), act_.q.data()},
                                  {&L.wk, act_.xn.data(), act_.k.data()},
                                  {&L.wv, act_.xn.data(), act_.v.data()}};
      matmul_many(std::span<const MatmulCall>(calls, 3), n, pool_);
    } else {
      matmul(L.wq, act_.xn.data(), n, act_.q.data(), pool_);
    }
    t.matmul_s += s.seconds();
    const float eps = h.rms_eps;
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
        rope_tables(d.rope, static_cast<float>(pos[static_cast<size_t>(r)]), cos_t, sin_t);
        float* q = act_.q.data() + r * q_dim;
        for (int hh = 0; hh < h.n_head; ++hh)
          rmsnorm(q + hh * hd, L.attn_q_norm.data(), eps, hd, q + hh * hd);
        rope_apply_tables(d.rope, cos_t, sin_t, h.n_head, q);
        if (!own_kv) continue;
        float* k = act_.k.data() + r * kv_dim;
        float* v = act_.v.data() + r * kv_dim;
        for (int hh = 0; hh < h.n_head_kv; ++hh) {
          rmsnorm(k + hh * hd, L.attn_k_norm.data(), eps, hd, k + hh * hd);
          rmsnorm(v + hh * hd, ones_.data(), eps, hd, v + hh * hd);
        }
        rope_apply_tables(d.rope, cos_t, sin_t, h.n_head_kv, k);
      }
    });
  }

  // ple_[r] = every layer's per-layer input of row r ([n_layer, P]).
  void per_layer_inputs(const UbatchInput& in, int n, ForwardTimings& t) {
    const ModelHParams& h = model_.hparams();
    const PerLayerEmbd& pe = model_.per_layer_embd();
    const int P = h.n_embd_per_layer, width = P * h.n_layer;
    const size_t need = static_cast<size_t>(n) * width;
    if (ple_.size() < need) {
      ple_.resize(need);
      ple_tok_.resize(need);
    }
    mm(pe.proj, act_.x.data(), n, ple_.data(), t);
    const float proj_scale = 1.0f / std::sqrt(static_cast<float>(h.n_embd));
    const float tok_scale = std::sqrt(static_cast<float>(P));
    const float mix = 1.0f / std::sqrt(2.0f);
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        float* e = ple_.data() + r * width;
        float* tok = ple_tok_.data() + r * width;
        pe.token.get_row(in.tokens[static_cast<size_t>(r)], tok);
        for (int i = 0; i < width; ++i) e[i] *= proj_scale;
        for (int l = 0; l < h.n_layer; ++l)
          rmsnorm(e + l * P, pe.proj_norm.data(), h.rms_eps, P, e + l * P);
        for (int i = 0; i < width; ++i) e[i] = (e[i] + tok[i] * tok_scale) * mix;
      }
    });
  }

  // x += rmsnorm((gelu_tanh(x W_inp_gate) * e_il) W_proj) * post_norm.
  void per_layer_block(const LayerWeights& L, int il, int n, ForwardTimings& t) {
    const ModelHParams& h = model_.hparams();
    const int P = h.n_embd_per_layer, width = P * h.n_layer, E = h.n_embd;
    mm(L.ple_gate, act_.x.data(), n, act_.gate.data(), t);  // [n, P] (P <= n_ff checked at load)
    float* g = act_.gate.data();
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r)
        geglu_tanh(g + r * P, ple_.data() + r * width + il * P, P, g + r * P);
    });
    mm(L.ple_proj, g, n, act_.xn.data(), t);
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t r = b; r < end; ++r) {
        float* y = act_.xn.data() + r * E;
        rmsnorm(y, L.ple_post_norm.data(), h.rms_eps, E, y);
        add_inplace(act_.x.data() + r * E, y, E);
      }
    });
  }

  void scale_rows(int n, float s) {
    const int E = model_.hparams().n_embd;
    float* x = act_.x.data();
    pool_.parallel_for(n, 16, [&](int64_t b, int64_t end, int) {
      for (int64_t i = b * E; i < end * E; ++i) x[i] *= s;
    });
  }

  const Model& model_;
  ThreadPool& pool_;
  const int max_rows_;
  Activations act_;
  KvAttention attn_global_, attn_sliding_;
  std::vector<float> ones_;           // the value norm's weight
  std::vector<float> ple_, ple_tok_;  // [n, n_layer * P]
};

}  // namespace

std::unique_ptr<ModelForward> make_gemma4_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts) {
  return std::make_unique<Gemma4Forward>(model, pool, opts);
}

}  // namespace d2o
