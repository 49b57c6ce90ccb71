// Random-weight GGUF models for tests: tiny llama-family models written with GgufWriter from a
// fixed-seed integer generator, so the same file is produced on every run and platform. The
// parity tests (tests/model/test_llama_parity.cpp) hand these files to llama.cpp for reference
// logits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/fp16.h"
#include "gguf/gguf_writer.h"

namespace d2o::test {

struct RandomModelConfig {
  std::string arch =
      "llama";  // "llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "gemma3", "gemma4" or "phi3"
  int n_layer = 2;
  int n_embd = 64;
  int n_head = 4;
  int n_head_kv = 4;
  int n_ff = 96;
  int n_vocab = 300;
  bool qkv_bias = false;
  bool tied = true;          // no output.weight: logits use token_embd
  bool f16_matrices = false; // store the matrices as F16 instead of F32
  uint32_t seed = 1;
  int head_dim = 0;        // 0: n_embd / n_head (written as key_length when set)
  int sliding_window = 0;  // gemma3: attention.sliding_window (0: not written)
  // Written as rope_freqs.weight (n_rot / 2 values) when not empty: Llama 3.1's RoPE scaling.
  std::vector<float> rope_freqs;
  // qwen3moe: n_expert experts of width n_ff_exp, n_expert_used per token (expert_count,
  // expert_used_count, expert_feed_forward_length). The router's rows come in groups of
  // n_expert_used nearly equal rows scaled by router_scale (see make_random_model), so that a token
  // picks a whole group and the group it picks leads the next by a clear margin.
  int n_expert = 0;
  int n_expert_used = 0;
  int n_ff_exp = 0;
  float router_scale = 0.0f;
  // qwen35: linear-attention layers (all but every full_attention_interval-th) of ssm_n_v_head
  // value heads and ssm_n_k_head key heads of width ssm_head_dim, a convolution of width
  // ssm_d_conv; RoPE over n_rot dims (0: the head) in rope_sections.
  int full_attention_interval = 0;
  int ssm_d_conv = 0, ssm_head_dim = 0, ssm_n_k_head = 0, ssm_n_v_head = 0;
  int n_rot = 0;
  std::vector<int32_t> rope_sections;
  // gemma4: swa_layers[il] marks a sliding layer (attention.sliding_window_pattern); sliding
  // layers' heads are head_dim_swa wide (key_length_swa), global ones head_dim; the last
  // n_kv_shared layers reuse earlier layers' KV; per-layer embeddings n_embd_per_layer wide; the
  // global layers turn the first global_rot_pairs pairs (rope_freqs 1, the rest 1e30).
  std::vector<bool> swa_layers;
  int head_dim_swa = 0;
  int n_kv_shared = 0;
  int n_embd_per_layer = 0;
  int global_rot_pairs = 0;
  std::string omit_tensor;  // a tensor left out (malformed files for load tests)
  bool synthetic_tokenizer = true;  // false: no tokenizer.* keys (the test writes its own)
};

// The frequency factors llama.cpp's converter writes for rope_scaling type llama3 (Llama 3.1):
// pair i with wavelength 2 pi / base^(-2i/n_rot) keeps its frequency (1) below
// old_ctx / high_freq_factor, is slowed down by `factor` above old_ctx / low_freq_factor, and by
// a blend in between.
inline std::vector<float> llama3_rope_freqs(int n_rot, double base, double factor,
                                            double low_freq_factor, double high_freq_factor,
                                            double old_ctx) {
  const double kPi = 3.14159265358979323846;
  std::vector<float> ff;
  for (int i = 0; i < n_rot / 2; ++i) {
    const double freq = 1.0 / std::pow(base, 2.0 * i / n_rot);
    const double wavelen = 2 * kPi / freq;
    if (wavelen < old_ctx / high_freq_factor) {
      ff.push_back(1.0f);
    } else if (wavelen > old_ctx / low_freq_factor) {
      ff.push_back(static_cast<float>(factor));
    } else {
      const double smooth =
          (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      ff.push_back(static_cast<float>(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  return ff;
}

// The two fixtures the reference logits exist for.
inline RandomModelConfig random_qwen2_config() {
  RandomModelConfig c;
  c.arch = "qwen2";
  c.n_head = 4;
  c.n_head_kv = 2;
  c.n_ff = 128;
  c.qkv_bias = true;
  c.tied = false;
  c.seed = 2;
  return c;
}
// Gemma 3's pieces: QK-norm, sandwich norms, GeGLU, embedding scaling, five sliding-window layers
// (window 8, shorter than the 64 test tokens) then a global one and one more local layer, a head
// size that is not n_embd / n_head, GQA.
inline RandomModelConfig random_gemma3_config() {
  RandomModelConfig c;
  c.arch = "gemma3";
  c.n_layer = 7;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 32;
  c.n_ff = 96;
  c.sliding_window = 8;
  c.tied = true;
  c.seed = 4;
  return c;
}
// Qwen 3's layer: the llama block with QK-norm (per-head RMSNorm of Q and K before RoPE), NeoX
// RoPE, no biases, a head size (32) that is not n_embd / n_head, GQA, tied output.
inline RandomModelConfig random_qwen3_config() {
  RandomModelConfig c;
  c.arch = "qwen3";
  c.n_layer = 3;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 32;
  c.n_ff = 96;
  c.tied = true;
  c.seed = 5;
  return c;
}
// Llama 3.1's RoPE scaling on a llama with GQA: frequency factors as the converter computes them
// for factor 8, low/high frequency factors 1 and 4, and an "original context" of 32 positions, so
// that over the 64 test tokens the pairs span all three cases: 16 pairs (head size 32) of
// wavelengths 6.3 to ~4e4 positions, the first unscaled (< 8), two blended, the rest slowed 8x.
inline RandomModelConfig random_llama31_config() {
  RandomModelConfig c;
  c.arch = "llama";
  c.n_layer = 2;
  c.n_embd = 128;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.n_ff = 192;
  c.tied = false;
  c.seed = 6;
  c.rope_freqs = llama3_rope_freqs(32, 10000.0, 8.0, 1.0, 4.0, 32.0);
  return c;
}
// Phi-3's layer: the llama block with NeoX RoPE, Q/K/V fused into attn_qkv and the gate and up
// projections into one ffn_up of 2 * n_ff rows; GQA (Phi-3 medium has it), untied output.
inline RandomModelConfig random_phi3_config() {
  RandomModelConfig c;
  c.arch = "phi3";
  c.n_layer = 3;
  c.n_embd = 96;
  c.n_head = 6;
  c.n_head_kv = 2;
  c.n_ff = 128;
  c.tied = false;
  c.seed = 7;
  return c;
}
// Qwen 3 MoE: Qwen 3's attention (QK-norm, NeoX RoPE, head size 32, GQA) with 8 SwiGLU experts
// of width 48, 2 per token, untied output. The router's rows are four pairs; within a pair the
// rows differ by a small random part (the two chosen experts get distinct weights), between pairs
// by a large one (router_scale), so the second and third most probable experts of every token are
// far apart and rounding cannot flip the choice (ModelForward.Qwen3MoeParityFixtureRoutesWith-
// ClearMargins checks the gap on the 64 test tokens).
inline RandomModelConfig random_qwen3moe_config() {
  RandomModelConfig c;
  c.arch = "qwen3moe";
  c.n_layer = 2;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 32;
  c.n_ff = 96;
  c.n_expert = 8;
  c.n_expert_used = 2;
  c.n_ff_exp = 48;
  c.router_scale = 32.0f;
  c.tied = false;
  c.seed = 3;  // the smallest gap over the 64 test tokens and both layers is 3.5
  return c;
}
// Qwen 3.5: linear-attention (gated delta rule) and gated full-attention layers alternating
// (full_attention_interval 2: layers 1 and 3 attend), QK-norm, RoPE on 16 of the 32 dims of a
// head in sections {1, 1, 1, 1} (so pairs 3 and 7, the e section's, are not turned for text), GQA,
// 4 value heads over 2 key heads of width 16, a convolution of width 4, untied output.
inline RandomModelConfig random_qwen35_config() {
  RandomModelConfig c;
  c.arch = "qwen35";
  c.n_layer = 4;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 32;
  c.n_ff = 96;
  c.full_attention_interval = 2;
  c.ssm_d_conv = 4;
  c.ssm_head_dim = 16;
  c.ssm_n_k_head = 2;
  c.ssm_n_v_head = 4;
  c.n_rot = 16;
  c.rope_sections = {1, 1, 1, 1};
  c.tied = false;
  c.seed = 8;
  return c;
}
// Gemma 4 (dense): Gemma 3's sandwich layers and QK-norm, V RMS-normalised, sliding layers of
// head size 32 (window 8) and global ones of 64 whose RoPE turns 16 of their 32 pairs
// (proportional RoPE as rope_freqs), the last two layers reading layers 3 and 4's KV, per-layer
// embeddings 16 wide, each layer's output scaled, GQA, tied output, logits soft-capped.
inline RandomModelConfig random_gemma4_config() {
  RandomModelConfig c;
  c.arch = "gemma4";
  c.n_layer = 7;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 64;
  c.head_dim_swa = 32;
  c.n_ff = 96;
  c.sliding_window = 8;
  c.swa_layers = {true, true, false, true, false, true, false};
  c.n_kv_shared = 2;
  c.n_embd_per_layer = 16;
  c.global_rot_pairs = 16;
  c.tied = true;
  c.seed = 9;
  return c;
}
inline RandomModelConfig random_llama_mha_config() {
  RandomModelConfig c;
  c.arch = "llama";
  c.n_head = 4;
  c.n_head_kv = 4;
  c.tied = true;
  c.f16_matrices = true;
  c.seed = 3;
  return c;
}

class Xorshift {
 public:
  explicit Xorshift(uint32_t seed) : s_(seed * 2654435761u + 1u) {}
  uint32_t next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 17;
    s_ ^= s_ << 5;
    return s_;
  }
  // Uniform in [-a, a] on a 2^-20 grid (exactly representable in float and half for a <= 1).
  float uniform(float a) {
    const int32_t k = static_cast<int32_t>(next() >> 11) - (1 << 20);  // [-2^20, 2^20)
    return a * static_cast<float>(k) / static_cast<float>(1 << 20);
  }

 private:
  uint32_t s_;
};

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
inline std::vector<uint8_t> f16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = fp32_to_fp16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return b;
}

// The synthetic SentencePiece-style vocabulary of a random model: <unk>, <s>, </s>, then plain
// pieces.
inline void write_random_model_vocab(const RandomModelConfig& c, GgufWriter& w) {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (int i = 0; i < c.n_vocab; ++i) {
    tokens.push_back(i == 0 ? "<unk>" : i == 1 ? "<s>" : i == 2 ? "</s>" : "t" + std::to_string(i));
    scores.push_back(-static_cast<float>(i));
    types.push_back(i == 0 ? 2 : i < 3 ? 3 : 1);
  }
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_f32_array("tokenizer.ggml.scores", scores);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_u32("tokenizer.ggml.unknown_token_id", 0);
  w.add_bool("tokenizer.ggml.add_bos_token", false);
}

// A mixture of experts' tensors for the layer prefix b: the router ffn_gate_inp [n_expert rows]
// and the stacked experts ffn_gate_exps, ffn_up_exps ({n_embd, n_ff_exp, n_expert}) and
// ffn_down_exps ({n_ff_exp, n_embd, n_expert}), F32. The router's rows come in groups of
// n_expert_used: a shared row times router_scale plus a small row of each expert's own.
template <class AddTensor>
void add_random_experts(const RandomModelConfig& c, const std::string& b, Xorshift& rng,
                        AddTensor& add_tensor) {
  const size_t E = static_cast<size_t>(c.n_embd), F = static_cast<size_t>(c.n_ff_exp);
  const size_t X = static_cast<size_t>(c.n_expert), K = static_cast<size_t>(c.n_expert_used);
  std::vector<float> router(X * E), shared(E);
  for (size_t e = 0; e < X; ++e) {
    if (e % K == 0)
      for (float& v : shared) v = rng.uniform(c.router_scale);
    for (size_t i = 0; i < E; ++i) router[e * E + i] = shared[i] + rng.uniform(0.05f);
  }
  add_tensor(b + "ffn_gate_inp.weight", GgmlType::kF32, {c.n_embd, c.n_expert}, f32_bytes(router));
  auto stack = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = rng.uniform(scale);
    return f32_bytes(v);
  };
  add_tensor(b + "ffn_gate_exps.weight", GgmlType::kF32, {c.n_embd, c.n_ff_exp, c.n_expert},
             stack(E * F * X, 0.3f));
  add_tensor(b + "ffn_up_exps.weight", GgmlType::kF32, {c.n_embd, c.n_ff_exp, c.n_expert},
             stack(E * F * X, 0.3f));
  add_tensor(b + "ffn_down_exps.weight", GgmlType::kF32, {c.n_ff_exp, c.n_embd, c.n_expert},
             stack(E * F * X, 0.2f));
}

// A Qwen 3.5 layer: attn_norm; a linear-attention block (attn_qkv, attn_gate, ssm_conv1d,
// ssm_dt.bias, ssm_a < 0, ssm_beta, ssm_alpha, ssm_norm, ssm_out) or gated full attention
// (attn_q of 2 * q_dim rows: each head's query then its gate; QK-norm); post_attention_norm;
// SwiGLU.
template <class AddTensor>
void add_random_qwen35_layer(const RandomModelConfig& c, int il, Xorshift& rng,
                             AddTensor& add_tensor) {
  const std::string b = "blk." + std::to_string(il) + ".";
  const int hd = c.head_dim > 0 ? c.head_dim : c.n_embd / c.n_head;
  auto vec = [&](size_t n, float scale, float offset) {
    std::vector<float> v(n);
    for (float& x : v) x = offset + rng.uniform(scale);
    return v;
  };
  auto matrix = [&](const std::string& name, int rows, int cols, float scale) {
    add_tensor(name, GgmlType::kF32, {cols, rows},
               f32_bytes(vec(static_cast<size_t>(rows) * cols, scale, 0.0f)));
  };
  auto norm = [&](const std::string& name, int n) {
    add_tensor(name, GgmlType::kF32, {n}, f32_bytes(vec(static_cast<size_t>(n), 0.25f, 1.0f)));
  };
  norm(b + "attn_norm.weight", c.n_embd);
  if ((il + 1) % c.full_attention_interval != 0) {
    const int S = c.ssm_head_dim, nv = c.ssm_n_v_head;
    const int conv_dim = 2 * c.ssm_n_k_head * S + nv * S;
    matrix(b + "attn_qkv.weight", conv_dim, c.n_embd, 0.3f);
    matrix(b + "attn_gate.weight", nv * S, c.n_embd, 0.3f);
    add_tensor(b + "ssm_conv1d.weight", GgmlType::kF32, {c.ssm_d_conv, conv_dim},
               f32_bytes(vec(static_cast<size_t>(conv_dim) * c.ssm_d_conv, 0.5f, 0.0f)));
    add_tensor(b + "ssm_dt.bias", GgmlType::kF32, {nv},
               f32_bytes(vec(static_cast<size_t>(nv), 1.0f, 0.0f)));
    add_tensor(b + "ssm_a", GgmlType::kF32, {nv},
               f32_bytes(vec(static_cast<size_t>(nv), 0.4f, -0.6f)));
    matrix(b + "ssm_beta.weight", nv, c.n_embd, 0.3f);
    matrix(b + "ssm_alpha.weight", nv, c.n_embd, 0.3f);
    norm(b + "ssm_norm.weight", S);
    matrix(b + "ssm_out.weight", c.n_embd, nv * S, 0.2f);
  } else {
    matrix(b + "attn_q.weight", 2 * c.n_head * hd, c.n_embd, 0.3f);
    matrix(b + "attn_k.weight", c.n_head_kv * hd, c.n_embd, 0.3f);
    matrix(b + "attn_v.weight", c.n_head_kv * hd, c.n_embd, 0.3f);
    matrix(b + "attn_output.weight", c.n_embd, c.n_head * hd, 0.2f);
    norm(b + "attn_q_norm.weight", hd);
    norm(b + "attn_k_norm.weight", hd);
  }
  norm(b + "post_attention_norm.weight", c.n_embd);
  matrix(b + "ffn_gate.weight", c.n_ff, c.n_embd, 0.3f);
  matrix(b + "ffn_up.weight", c.n_ff, c.n_embd, 0.3f);
  matrix(b + "ffn_down.weight", c.n_embd, c.n_ff, 0.2f);
}

// Gemma 4's keys beyond the common ones (key_length, the global head size, is written by the
// caller).
inline void write_gemma4_keys(const RandomModelConfig& c, GgufWriter& w) {
  const std::string a = c.arch;
  w.add_bool_array(a + ".attention.sliding_window_pattern", c.swa_layers);
  w.add_u32(a + ".attention.key_length_swa", static_cast<uint32_t>(c.head_dim_swa));
  w.add_u32(a + ".attention.value_length_swa", static_cast<uint32_t>(c.head_dim_swa));
  w.add_u32(a + ".rope.dimension_count_swa", static_cast<uint32_t>(c.head_dim_swa));
  w.add_f32(a + ".rope.freq_base_swa", 10000.0f);
  w.add_u32(a + ".attention.shared_kv_layers", static_cast<uint32_t>(c.n_kv_shared));
  w.add_u32(a + ".embedding_length_per_layer_input", static_cast<uint32_t>(c.n_embd_per_layer));
  w.add_f32(a + ".final_logit_softcapping", 30.0f);
}

// Gemma 4's tensors outside the layers: the per-layer embeddings (token table, projection of the
// scaled token embedding, its norm) and the global layers' RoPE frequency factors.
template <class AddTensor>
void add_random_gemma4_globals(const RandomModelConfig& c, Xorshift& rng, AddTensor& add_tensor) {
  const int P = c.n_embd_per_layer * c.n_layer;
  auto vec = [&](size_t n, float scale, float offset) {
    std::vector<float> v(n);
    for (float& x : v) x = offset + rng.uniform(scale);
    return f32_bytes(v);
  };
  add_tensor("per_layer_token_embd.weight", GgmlType::kF32, {P, c.n_vocab},
             vec(static_cast<size_t>(P) * c.n_vocab, 1.0f, 0.0f));
  add_tensor("per_layer_model_proj.weight", GgmlType::kF32, {c.n_embd, P},
             vec(static_cast<size_t>(P) * c.n_embd, 0.3f, 0.0f));
  add_tensor("per_layer_proj_norm.weight", GgmlType::kF32, {c.n_embd_per_layer},
             vec(static_cast<size_t>(c.n_embd_per_layer), 0.25f, 1.0f));
  std::vector<float> ff(static_cast<size_t>(c.head_dim / 2), 1e30f);
  for (int i = 0; i < c.global_rot_pairs; ++i) ff[static_cast<size_t>(i)] = 1.0f;
  add_tensor("rope_freqs.weight", GgmlType::kF32, {c.head_dim / 2}, f32_bytes(ff));
}

// A Gemma 4 layer: sandwich norms, QK-norm, GeGLU, the per-layer embedding's gate, projection and
// norm, the output scale; a layer of the last n_kv_shared has no K or V projection (nor K norm).
template <class AddTensor>
void add_random_gemma4_layer(const RandomModelConfig& c, int il, Xorshift& rng,
                             AddTensor& add_tensor) {
  const std::string b = "blk." + std::to_string(il) + ".";
  const int hd = c.swa_layers[static_cast<size_t>(il)] ? c.head_dim_swa : c.head_dim;
  const bool own_kv = il < c.n_layer - c.n_kv_shared;
  auto vec = [&](size_t n, float scale, float offset) {
    std::vector<float> v(n);
    for (float& x : v) x = offset + rng.uniform(scale);
    return v;
  };
  auto matrix = [&](const std::string& name, int rows, int cols, float scale) {
    add_tensor(name, GgmlType::kF32, {cols, rows},
               f32_bytes(vec(static_cast<size_t>(rows) * cols, scale, 0.0f)));
  };
  auto norm = [&](const std::string& name, int n) {
    add_tensor(name, GgmlType::kF32, {n}, f32_bytes(vec(static_cast<size_t>(n), 0.25f, 1.0f)));
  };
  norm(b + "attn_norm.weight", c.n_embd);
  matrix(b + "attn_q.weight", c.n_head * hd, c.n_embd, 0.3f);
  if (own_kv) {
    matrix(b + "attn_k.weight", c.n_head_kv * hd, c.n_embd, 0.3f);
    matrix(b + "attn_v.weight", c.n_head_kv * hd, c.n_embd, 0.3f);
    norm(b + "attn_k_norm.weight", hd);
  }
  // Gemma 4 attends with scale 1: the query norm's weights carry 1 / sqrt(head_dim), as trained
  // ones do, so that the softmax is not near one-hot (and rounding does not flip it).
  const float qs = 1.0f / std::sqrt(static_cast<float>(hd));
  add_tensor(b + "attn_q_norm.weight", GgmlType::kF32, {hd},
             f32_bytes(vec(static_cast<size_t>(hd), 0.25f * qs, qs)));
  matrix(b + "attn_output.weight", c.n_embd, c.n_head * hd, 0.2f);
  norm(b + "post_attention_norm.weight", c.n_embd);
  norm(b + "ffn_norm.weight", c.n_embd);
  matrix(b + "ffn_gate.weight", c.n_ff, c.n_embd, 0.3f);
  matrix(b + "ffn_up.weight", c.n_ff, c.n_embd, 0.3f);
  matrix(b + "ffn_down.weight", c.n_embd, c.n_ff, 0.2f);
  norm(b + "post_ffw_norm.weight", c.n_embd);
  matrix(b + "inp_gate.weight", c.n_embd_per_layer, c.n_embd, 0.3f);
  matrix(b + "proj.weight", c.n_embd, c.n_embd_per_layer, 0.3f);
  norm(b + "post_norm.weight", c.n_embd);
  add_tensor(b + "layer_output_scale.weight", GgmlType::kF32, {1}, f32_bytes(vec(1, 0.25f, 0.75f)));
}

inline GgufWriter make_random_model(const RandomModelConfig& c) {
  GgufWriter w;
  // Every tensor goes through here, so that c.omit_tensor can leave one out.
  auto add_tensor = [&](const std::string& name, GgmlType type, std::vector<int64_t> dims,
                        std::vector<uint8_t> data) {
    if (name != c.omit_tensor) w.add_tensor(name, type, dims, std::move(data));
  };
  const std::string a = c.arch;
  const int hd = c.head_dim > 0 ? c.head_dim : c.n_embd / c.n_head;
  const bool gemma = a == "gemma3";
  const bool qk_norm = gemma || a == "qwen3" || a == "qwen3moe";
  const bool phi3 = a == "phi3";
  w.add_string("general.architecture", a);
  // llama.cpp sets Phi-3 token attributes when the name says "phi3", looking up tokens this
  // vocabulary does not have: the name avoids it.
  w.add_string("general.name", "d2o random " + (phi3 ? std::string("phi-three") : a));
  w.add_u32(a + ".block_count", static_cast<uint32_t>(c.n_layer));
  w.add_u32(a + ".context_length", 512);
  w.add_u32(a + ".embedding_length", static_cast<uint32_t>(c.n_embd));
  w.add_u32(a + ".feed_forward_length", static_cast<uint32_t>(c.n_ff));
  w.add_u32(a + ".attention.head_count", static_cast<uint32_t>(c.n_head));
  w.add_u32(a + ".attention.head_count_kv", static_cast<uint32_t>(c.n_head_kv));
  w.add_f32(a + ".rope.freq_base", 10000.0f);
  w.add_f32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.add_u32(a + ".rope.dimension_count", static_cast<uint32_t>(c.n_rot > 0 ? c.n_rot : hd));
  if (!c.rope_sections.empty()) w.add_i32_array(a + ".rope.dimension_sections", c.rope_sections);
  if (c.full_attention_interval > 0) {
    w.add_u32(a + ".full_attention_interval", static_cast<uint32_t>(c.full_attention_interval));
    w.add_u32(a + ".ssm.conv_kernel", static_cast<uint32_t>(c.ssm_d_conv));
    w.add_u32(a + ".ssm.state_size", static_cast<uint32_t>(c.ssm_head_dim));
    w.add_u32(a + ".ssm.group_count", static_cast<uint32_t>(c.ssm_n_k_head));
    w.add_u32(a + ".ssm.time_step_rank", static_cast<uint32_t>(c.ssm_n_v_head));
    w.add_u32(a + ".ssm.inner_size", static_cast<uint32_t>(c.ssm_head_dim * c.ssm_n_v_head));
  }
  if (c.head_dim > 0) {
    w.add_u32(a + ".attention.key_length", static_cast<uint32_t>(hd));
    w.add_u32(a + ".attention.value_length", static_cast<uint32_t>(hd));
  }
  if (c.sliding_window > 0) w.add_u32(a + ".attention.sliding_window", static_cast<uint32_t>(c.sliding_window));
  if (a == "gemma4") write_gemma4_keys(c, w);
  if (c.n_expert > 0) {
    w.add_u32(a + ".expert_count", static_cast<uint32_t>(c.n_expert));
    w.add_u32(a + ".expert_used_count", static_cast<uint32_t>(c.n_expert_used));
    w.add_u32(a + ".expert_feed_forward_length", static_cast<uint32_t>(c.n_ff_exp));
  }
  w.add_u32("general.file_type", c.f16_matrices ? 1 : 0);
  if (c.synthetic_tokenizer) write_random_model_vocab(c, w);

  Xorshift rng(c.seed);
  auto rand_vec = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = rng.uniform(scale);
    return v;
  };
  auto norm_vec = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = 1.0f + rng.uniform(0.25f);
    return v;
  };
  auto matrix = [&](const std::string& name, int rows, int cols, float scale) {
    auto v = rand_vec(static_cast<size_t>(rows) * cols, scale);
    if (c.f16_matrices) {
      add_tensor(name, GgmlType::kF16, {cols, rows}, f16_bytes(v));
    } else {
      add_tensor(name, GgmlType::kF32, {cols, rows}, f32_bytes(v));
    }
  };
  const int q_dim = c.n_head * hd, kv_dim = c.n_head_kv * hd;
  add_tensor("token_embd.weight", GgmlType::kF32, {c.n_embd, c.n_vocab},
             f32_bytes(rand_vec(static_cast<size_t>(c.n_embd) * c.n_vocab, 1.0f)));
  add_tensor("output_norm.weight", GgmlType::kF32, {c.n_embd}, f32_bytes(norm_vec(static_cast<size_t>(c.n_embd))));
  if (!c.tied) matrix("output.weight", c.n_vocab, c.n_embd, 0.25f);
  if (!c.rope_freqs.empty()) {
    add_tensor("rope_freqs.weight", GgmlType::kF32, {static_cast<int64_t>(c.rope_freqs.size())},
               f32_bytes(c.rope_freqs));
  }
  if (a == "gemma4") add_random_gemma4_globals(c, rng, add_tensor);
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    if (a == "gemma4") {
      add_random_gemma4_layer(c, il, rng, add_tensor);
      continue;
    }
    if (a == "qwen35") {
      add_random_qwen35_layer(c, il, rng, add_tensor);
      continue;
    }
    add_tensor(b + "attn_norm.weight", GgmlType::kF32, {c.n_embd}, f32_bytes(norm_vec(static_cast<size_t>(c.n_embd))));
    if (phi3) {
      matrix(b + "attn_qkv.weight", q_dim + 2 * kv_dim, c.n_embd, 0.3f);
    } else {
      matrix(b + "attn_q.weight", q_dim, c.n_embd, 0.3f);
      matrix(b + "attn_k.weight", kv_dim, c.n_embd, 0.3f);
      matrix(b + "attn_v.weight", kv_dim, c.n_embd, 0.3f);
    }
    if (c.qkv_bias) {
      add_tensor(b + "attn_q.bias", GgmlType::kF32, {q_dim}, f32_bytes(rand_vec(static_cast<size_t>(q_dim), 0.5f)));
      add_tensor(b + "attn_k.bias", GgmlType::kF32, {kv_dim}, f32_bytes(rand_vec(static_cast<size_t>(kv_dim), 0.5f)));
      add_tensor(b + "attn_v.bias", GgmlType::kF32, {kv_dim}, f32_bytes(rand_vec(static_cast<size_t>(kv_dim), 0.5f)));
    }
    matrix(b + "attn_output.weight", c.n_embd, q_dim, 0.2f);
    if (qk_norm) {
      add_tensor(b + "attn_q_norm.weight", GgmlType::kF32, {hd}, f32_bytes(norm_vec(static_cast<size_t>(hd))));
      add_tensor(b + "attn_k_norm.weight", GgmlType::kF32, {hd}, f32_bytes(norm_vec(static_cast<size_t>(hd))));
    }
    if (gemma) {
      add_tensor(b + "post_attention_norm.weight", GgmlType::kF32, {c.n_embd}, f32_bytes(norm_vec(static_cast<size_t>(c.n_embd))));
      add_tensor(b + "post_ffw_norm.weight", GgmlType::kF32, {c.n_embd}, f32_bytes(norm_vec(static_cast<size_t>(c.n_embd))));
    }
    add_tensor(b + "ffn_norm.weight", GgmlType::kF32, {c.n_embd}, f32_bytes(norm_vec(static_cast<size_t>(c.n_embd))));
    if (c.n_expert > 0) {
      add_random_experts(c, b, rng, add_tensor);
      continue;
    }
    if (phi3) {
      matrix(b + "ffn_up.weight", 2 * c.n_ff, c.n_embd, 0.3f);  // gate rows, then up rows
    } else {
      matrix(b + "ffn_gate.weight", c.n_ff, c.n_embd, 0.3f);
      matrix(b + "ffn_up.weight", c.n_ff, c.n_embd, 0.3f);
    }
    matrix(b + "ffn_down.weight", c.n_embd, c.n_ff, 0.2f);
  }
  return w;
}

// Fixed token sequence the reference logits were computed for: n ids in [3, n_vocab).
inline std::vector<int32_t> random_model_tokens(int n, int n_vocab) {
  std::vector<int32_t> t;
  Xorshift rng(99);
  for (int i = 0; i < n; ++i) t.push_back(3 + static_cast<int32_t>(rng.next() % static_cast<uint32_t>(n_vocab - 3)));
  return t;
}

}  // namespace d2o::test
