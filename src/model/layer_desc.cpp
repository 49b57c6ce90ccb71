#include "model/layer_desc.h"

#include <cmath>
#include <limits>

namespace d2o {

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::kGlobal:
      return "global";
    case LayerKind::kSliding:
      return "sliding";
    case LayerKind::kRecurrent:
      return "recurrent";
  }
  return "?";
}

const char* ffn_kind_name(FfnKind k) {
  switch (k) {
    case FfnKind::kSwiGlu:
      return "swiglu";
    case FfnKind::kGeGluTanh:
      return "geglu-tanh";
    case FfnKind::kMoeSwiGlu:
      return "moe-swiglu";
  }
  return "?";
}

Result<ModelDesc> describe_model(const ModelHParams& hp, const float* rope_freq_factors) {
  ModelDesc md;
  RopeParams rope;
  rope.type = hp.rope_type;
  rope.head_dim = hp.head_dim;
  rope.n_rot = hp.n_rot;
  rope.freq_base = hp.rope_freq_base;
  rope.freq_scale = hp.rope_freq_scale;
  rope.freq_factors = rope_freq_factors;
  md.policy_rope = rope;

  LayerDesc d;
  d.kind = LayerKind::kGlobal;
  d.rope = rope;
  d.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
  switch (hp.arch) {
    case ModelArch::kLlama:
    case ModelArch::kQwen2:
    case ModelArch::kQwen3:
    case ModelArch::kPhi3:
    case ModelArch::kQwen3Moe:
      // Pre-norm layers, all alike: attn_norm, Q/K/V (qwen2: with biases; qwen3: each head of Q
      // and K RMS-normalised), RoPE, attention, O, residual; ffn_norm, SwiGLU, residual. Phi-3
      // differs only in how its file stores Q/K/V and gate/up (fused; model.cpp splits them).
      // Qwen 3 MoE is qwen3's layer with a mixture of experts in place of the one SwiGLU; its
      // attention layers are ordinary global layers, so KV policies treat it as any other.
      d.norms = LayerNorms{};
      d.norms.qk = hp.arch == ModelArch::kQwen3 || hp.arch == ModelArch::kQwen3Moe;
      d.qkv_bias = hp.qkv_bias;
      d.ffn = hp.arch == ModelArch::kQwen3Moe ? FfnKind::kMoeSwiGlu : FfnKind::kSwiGlu;
      md.layers.assign(static_cast<size_t>(hp.n_layer), d);
      return md;
    case ModelArch::kQwen35:
      // Pre-norm layers: attn_norm, then a linear-attention block (kRecurrent) or a full
      // attention block with QK-norm, multi-section RoPE and a gated output; residual; the
      // post-attention norm before the SwiGLU (the ffn_pre norm), residual. Only the attention
      // layers hold keys, so only they are compressed.
      d.norms = LayerNorms{};
      d.norms.qk = true;
      d.attn_gate = true;
      for (int il = 0; il < hp.n_layer; ++il) {
        LayerDesc l = d;
        if (hp.is_recurrent(il)) {
          l.kind = LayerKind::kRecurrent;
          l.norms.qk = false;
          l.attn_gate = false;
        }
        md.layers.push_back(l);
      }
      return md;
    case ModelArch::kGemma3: {
      // Sandwich norms around both blocks, QK-norm, GeGLU (tanh GELU); embeddings scaled by
      // sqrt(n_embd). Five sliding-window layers (RoPE base 10000, unscaled) to one global layer
      // (the file's RoPE base and scaling). A KV policy re-rotates only global layers' keys (it
      // never compacts the others).
      md.embd_scale = std::sqrt(static_cast<float>(hp.n_embd));
      md.logit_softcap = hp.final_logit_softcap;
      d.norms = LayerNorms{true, true, true, true, true};
      d.ffn = FfnKind::kGeGluTanh;
      RopeParams local = rope;
      local.freq_base = hp.rope_freq_base_swa;
      local.freq_scale = 1.0f;
      for (int il = 0; il < hp.n_layer; ++il) {
        LayerDesc l = d;
        if (hp.is_sliding(il)) {
          l.kind = LayerKind::kSliding;
          l.window = hp.sliding_window;
          l.rope = local;
        }
        md.layers.push_back(l);
      }
      return md;
    }
    case ModelArch::kGemma4: {
      // Gemma 3's layer (sandwich norms, QK-norm, GeGLU, scaled embeddings, soft-capped logits)
      // with an attention scale of 1 (the QK-norm's weights carry it). Sliding layers have their
      // own head width, RoPE base and turned dims, and no frequency factors; global layers turn
      // by the file's rope_freqs (proportional RoPE). Shared layers: ModelHParams::kv_source.
      md.embd_scale = std::sqrt(static_cast<float>(hp.n_embd));
      md.logit_softcap = hp.final_logit_softcap;
      d.norms = LayerNorms{true, true, true, true, true};
      d.ffn = FfnKind::kGeGluTanh;
      d.attn_scale = 1.0f;
      RopeParams local = rope;
      local.head_dim = hp.head_dim_swa;
      local.n_rot = hp.n_rot_swa;
      local.freq_base = hp.rope_freq_base_swa;
      local.freq_scale = 1.0f;
      local.freq_factors = nullptr;
      for (int il = 0; il < hp.n_layer; ++il) {
        LayerDesc l = d;
        if (hp.is_sliding(il)) {
          l.kind = LayerKind::kSliding;
          l.window = hp.sliding_window;
          l.rope = local;
        }
        md.layers.push_back(l);
      }
      return md;
    }
  }
  return unsupported(std::string("no layer description for architecture ") +
                     model_arch_name(hp.arch));
}

std::vector<float> mrope_text_freq_factors(const ModelHParams& hp) {
  const int* s = hp.rope_sections;
  const int n_sect = s[0] + s[1] + s[2] + s[3];
  if (n_sect == 0) return {};
  std::vector<float> ff(static_cast<size_t>(hp.n_rot / 2), 1.0f);
  // Interleaved sections (llama.cpp's IMROPE): pair i falls in sector i mod n_sect; sectors
  // 0, 3, 6, ... below 3 s[0] are t, 1, 4, ... below 3 s[1] h, 2, 5, ... below 3 s[2] w; the
  // rest e.
  for (int i = 0; i < hp.n_rot / 2; ++i) {
    const int sector = i % n_sect;
    const int m = sector % 3;
    if (!(sector < 3 * s[m])) ff[static_cast<size_t>(i)] = std::numeric_limits<float>::infinity();
  }
  return ff;
}

KvCacheConfig kv_cache_config(const ModelHParams& hp, KvType type) {
  KvCacheConfig c{hp.n_layer, hp.n_head_kv, hp.head_dim, type};
  c.n_head = hp.n_head;
  if (!hp.recurrent.empty()) {
    c.layer_recurrent = hp.recurrent;
    c.recurrent_conv = (hp.ssm_d_conv - 1) * hp.ssm_conv_dim();
    c.recurrent_delta = hp.ssm_n_v_head * hp.ssm_head_dim * hp.ssm_head_dim;
  }
  if (hp.sliding_window > 0) {
    for (int il = 0; il < hp.n_layer; ++il)
      c.layer_window.push_back(hp.is_sliding(il) ? hp.sliding_window : 0);
  }
  if (hp.head_dim_swa > 0) {
    for (int il = 0; il < hp.n_layer; ++il) c.layer_head_dim.push_back(hp.layer_head_dim(il));
  }
  if (hp.n_kv_shared > 0) {
    for (int il = 0; il < hp.n_layer; ++il) c.layer_kv_source.push_back(hp.kv_source(il));
  }
  return c;
}

}  // namespace d2o
