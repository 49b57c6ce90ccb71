// Model hyper-parameters read from GGUF metadata, validated once so the rest of the engine can
// rely on them (positive sizes, heads dividing evenly, supported architecture).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"
#include "ops/ops.h"

namespace d2o {

// Architecture families d2o runs. Adding one: see docs/ADDING_A_MODEL.md.
enum class ModelArch {
  kLlama,     // llama, mistral (SmolLM2, Llama 2/3, Mistral): RMSNorm, SwiGLU, RoPE norm
  kQwen2,     // like llama with biases on Q, K, V and NeoX RoPE
  kQwen3,     // like llama with per-head RMSNorm of Q and K (QK-norm) and NeoX RoPE
  kGemma3,    // Gemma 3: sliding-window and global layers, QK-norm, sandwich norms, GeGLU
  kPhi3,      // Phi-3: llama's layer with NeoX RoPE, Q/K/V fused in one tensor, gate and up in one
  kQwen3Moe,  // Qwen 3 MoE: qwen3's attention, a routed mixture of SwiGLU experts as feed-forward
  // Qwen 3.5 (dense, text): linear-attention layers (a gated delta rule over a per-sequence
  // recurrent state) with a gated full-attention layer every few layers
  kQwen35,
  // Gemma 4 (dense, text): Gemma 3's sandwich layers with per-layer token embeddings, sliding and
  // global layers of different head widths, and the last layers reading earlier layers' KV
  kGemma4,
};
const char* model_arch_name(ModelArch arch);

struct ModelHParams {
  std::string arch_name;  // as written in general.architecture
  ModelArch arch = ModelArch::kLlama;
  int n_layer = 0;
  int n_embd = 0;
  int n_ff = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;       // key/value width per head
  int n_vocab = 0;
  int n_ctx_train = 0;
  float rms_eps = 1e-5f;
  RopeType rope_type = RopeType::kNorm;
  int n_rot = 0;
  float rope_freq_base = 10000.0f;
  float rope_freq_scale = 1.0f;  // linear scaling: positions times this (1 / rope.scaling.factor)
  bool qkv_bias = false;
  // Sliding-window attention (gemma3): layers il with il % swa_pattern < swa_pattern - 1 (every
  // layer when swa_pattern is 0) see only the last sliding_window positions and use their own
  // RoPE base, unscaled; sliding_window 0: none.
  int sliding_window = 0;
  int swa_pattern = 0;
  float rope_freq_base_swa = 10000.0f;
  float final_logit_softcap = 0.0f;  // > 0: logits = cap * tanh(logits / cap)
  // Mixture of experts (qwen3moe; 0 elsewhere): each layer's feed-forward is n_expert_used of
  // n_expert SwiGLU experts of width n_ff_exp, chosen per token by a router.
  int n_expert = 0;
  int n_expert_used = 0;
  int n_ff_exp = 0;
  // Linear-attention layers (qwen35; empty elsewhere): recurrent[il] != 0 marks layer il as a
  // gated delta-rule layer, which keeps a recurrent state instead of keys and values. Its input
  // projection feeds a causal convolution of width ssm_d_conv over 2 * ssm_n_k_head key/query
  // heads and ssm_n_v_head value heads, all of width ssm_head_dim.
  std::vector<uint8_t> recurrent;
  int ssm_d_conv = 0;
  int ssm_head_dim = 0;
  int ssm_n_k_head = 0;
  int ssm_n_v_head = 0;
  // Multi-section RoPE (qwen35): rope pairs are dealt to the sections t, h, w, e (interleaved);
  // a text token's t, h and w positions are its position, its e position 0.
  int rope_sections[4] = {0, 0, 0, 0};
  // Gemma 4 (0 or empty elsewhere). swa_layers[il] != 0 marks a sliding-window layer (the file's
  // per-layer pattern; empty: the swa_pattern rule). Sliding layers' heads are head_dim_swa wide
  // and turn n_rot_swa dims; global ones use head_dim and n_rot. The last n_kv_shared layers hold
  // no keys or values of their own: each reads those of the last earlier layer of its kind
  // (kv_source). n_embd_per_layer > 0: every layer adds a per-layer token embedding that wide.
  std::vector<uint8_t> swa_layers;
  int head_dim_swa = 0;
  int n_rot_swa = 0;
  int n_kv_shared = 0;
  int n_embd_per_layer = 0;

  int n_group() const { return n_head / n_head_kv; }  // query heads per KV head
  bool is_recurrent(int il) const {
    return !recurrent.empty() && recurrent[static_cast<size_t>(il)] != 0;
  }
  // Widths of a linear-attention layer's parts: keys (and queries), values, the convolved input.
  int ssm_key_dim() const { return ssm_n_k_head * ssm_head_dim; }
  int ssm_value_dim() const { return ssm_n_v_head * ssm_head_dim; }
  int ssm_conv_dim() const { return 2 * ssm_key_dim() + ssm_value_dim(); }
  bool is_sliding(int il) const {
    if (!swa_layers.empty()) return sliding_window > 0 && swa_layers[static_cast<size_t>(il)] != 0;
    return sliding_window > 0 && (swa_pattern == 0 || il % swa_pattern < swa_pattern - 1);
  }
  // The head width of layer il (Gemma 4's sliding layers have their own).
  int layer_head_dim(int il) const {
    return head_dim_swa > 0 && is_sliding(il) ? head_dim_swa : head_dim;
  }
  // The layer whose keys and values layer il attends over: il itself, or for one of the last
  // n_kv_shared layers the last earlier layer of the same kind that holds its own.
  int kv_source(int il) const;
  // Reads and validates; errors name the missing or bad key.
  static Result<ModelHParams> from_gguf(const GgufFile& file);
};

}  // namespace d2o
