// What each layer of a model computes, as data: the description an architecture's block file
// (src/model/arch_*.cpp) reads while it runs a micro-batch. Built once from the hyper-parameters
// when the model loads (describe_model), so the forward pass asks "does this layer have a
// post-attention norm, which RoPE base, which attention window" of a struct rather than of the
// architecture's name. For the llama family every layer is the same; the fields exist for models
// whose layers differ (Gemma 3: sliding-window attention on five layers of six, each kind with its
// own RoPE base, sandwich norms, QK-norm, GeGLU) or that add one piece (Qwen 3: QK-norm; Qwen 3
// MoE: QK-norm and a mixture of experts as feed-forward).
// Adding an architecture: docs/ADDING_A_MODEL.md.
#pragma once

#include <vector>

#include "d2o/status.h"
#include "kv/kv_cache.h"
#include "model/hparams.h"
#include "ops/ops.h"

namespace d2o {

// Which cached keys a layer's queries see.
enum class LayerKind {
  kGlobal,   // every slot the sequence's cache holds (as its KV policy left them)
  kSliding,  // only the last `window` positions, the query's own included (local attention)
  // No keys or values: a linear-attention layer (a gated delta rule, qwen35) whose per-sequence
  // recurrent state (KvCache::recurrent) carries the past; no KV policy touches it.
  kRecurrent,
};
const char* layer_kind_name(LayerKind k);

// The feed-forward block: down(act(gate x) * up x).
enum class FfnKind {
  kSwiGlu,     // act = silu (llama, mistral, qwen2, qwen3)
  kGeGluTanh,  // act = GELU, tanh approximation (gemma)
  // A routed mixture of SwiGLU experts (qwen3moe): softmax over the router's logits, the
  // n_expert_used most probable experts, their probabilities renormalised to sum 1 as weights,
  // the weighted sum of those experts' SwiGLU outputs.
  kMoeSwiGlu,
};
const char* ffn_kind_name(FfnKind k);

// The RMSNorms a layer applies (each one present has an [n_embd] weight; qk has [head_dim]).
struct LayerNorms {
  bool attn_pre = true;    // on the residual stream before Q/K/V (attn_norm)
  bool attn_post = false;  // on the attention block's output before its residual add (sandwich)
  bool ffn_pre = true;     // on the residual stream before the feed-forward block (ffn_norm)
  bool ffn_post = false;   // on the feed-forward output before its residual add (sandwich)
  bool qk = false;         // per head on Q and K, before RoPE (QK-norm)
};

struct LayerDesc {
  LayerKind kind = LayerKind::kGlobal;
  int window = 0;           // kSliding: positions a query sees; 0 for kGlobal
  RopeParams rope;          // this layer's RoPE: type, base, linear scaling, frequency factors
  float attn_scale = 1.0f;  // multiplies q.k before the softmax
  LayerNorms norms;
  bool qkv_bias = false;  // biases added to Q, K and V after their matmuls
  // The attention output is multiplied by sigmoid(gate) before Wo; Q's projection yields each
  // head's query and then its gate (qwen35).
  bool attn_gate = false;
  FfnKind ffn = FfnKind::kSwiGlu;
};

// The whole model's description.
struct ModelDesc {
  // Token embeddings are multiplied by this before the first layer (Gemma: sqrt(n_embd)); the
  // architecture's block file applies it (the llama family has none: 1).
  float embd_scale = 1.0f;
  // > 0: the logits are soft-capped, cap * tanh(logits / cap) (ModelHParams::final_logit_softcap).
  float logit_softcap = 0.0f;
  // The RoPE a KV policy re-rotates kept keys with when it shifts positions (PassInfo::rope):
  // the global layers' RoPE. One for all layers: see docs/ADDING_A_MODEL.md on per-layer bases.
  RopeParams policy_rope;
  std::vector<LayerDesc> layers;  // [n_layer]
};

// Describes the model of `hp`. `rope_freq_factors` (the model's rope_freqs tensor, n_rot / 2
// values, or null) must outlive the description: the RoPE parameters point into it.
Result<ModelDesc> describe_model(const ModelHParams& hp, const float* rope_freq_factors);

// Multi-section RoPE of a text token (qwen35): every section but e turns with the token's
// position, e (position 0) not at all; as frequency factors (n_rot / 2 of them) for RopeParams:
// 1 for a pair that turns, infinity for one that does not (its angle becomes 0, also when a KV
// policy re-rotates keys). Empty for a model without sections.
std::vector<float> mrope_text_freq_factors(const ModelHParams& hp);

// The KV cache shape a sequence of this model needs (every layer: n_head_kv heads of head_dim,
// or gemma4's per-layer widths; sliding-window layers marked with their window; layers that read
// an earlier layer's keys and values marked with it).
KvCacheConfig kv_cache_config(const ModelHParams& hp, KvType type);

}  // namespace d2o
