// Model: hyper-parameters and weights of one transformer, loaded into process memory.
//
// Loading reads the GGUF through its validated mapping and copies every tensor into buffers the
// process owns (QMatrix for matrices, plain float vectors for norms and biases), then drops the
// mapping. Resident weights therefore cannot be evicted to disk by page reclaim, and decode speed
// does not depend on the page cache (see the project's machine notes).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"
#include "model/hparams.h"
#include "model/layer_desc.h"
#include "ops/matmul.h"

namespace d2o {

// One expert of a mixture-of-experts layer: a SwiGLU feed-forward of width n_ff_exp.
struct ExpertWeights {
  QMatrix gate;  // [n_ff_exp, n_embd]
  QMatrix up;    // [n_ff_exp, n_embd]
  QMatrix down;  // [n_embd, n_ff_exp]
};

// A mixture-of-experts feed-forward (FfnKind::kMoeSwiGlu). The file stacks the experts in 3-D
// tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps); each expert is loaded as matrices of its
// own, so a pass reads only the experts its tokens chose.
struct MoeWeights {
  QMatrix router;                      // ffn_gate_inp [n_expert, n_embd]
  std::vector<ExpertWeights> experts;  // [n_expert]
};

// A linear-attention layer (LayerKind::kRecurrent, qwen35): a gated delta rule (model/delta_net.h).
struct DeltaNetWeights {
  QMatrix qkv;                 // attn_qkv [conv_dim, n_embd]: all query, key, then value heads
  QMatrix gate;                // attn_gate [value_dim, n_embd]: the output gate z
  QMatrix beta;                // ssm_beta [n_v_head, n_embd]: the write strength, before sigmoid
  QMatrix alpha;               // ssm_alpha [n_v_head, n_embd]: the decay, before softplus
  std::vector<float> conv;     // ssm_conv1d [conv_dim, d_conv]: per-channel causal kernels
  std::vector<float> dt_bias;  // ssm_dt.bias [n_v_head]
  std::vector<float> a;        // ssm_a [n_v_head]: -exp(A_log), the decay rate
  std::vector<float> norm;     // ssm_norm [head_dim]: RMSNorm of each value head's output
  QMatrix out;                 // ssm_out [n_embd, value_dim]
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [n_embd]
  QMatrix wq;                    // [n_head * head_dim, n_embd] (attn_gate: [2 * n_head * head_dim])
  QMatrix wk;                    // [n_head_kv * head_dim, n_embd]
  QMatrix wv;                    // [n_head_kv * head_dim, n_embd]
  QMatrix wo;                    // [n_embd, n_head * head_dim]
  std::vector<float> bq, bk, bv;  // empty unless hparams.qkv_bias
  std::vector<float> ffn_norm;   // [n_embd]
  // Present when the layer's LayerNorms say so (Gemma 3), else empty.
  std::vector<float> attn_q_norm, attn_k_norm;     // [head_dim] QK-norm
  std::vector<float> attn_post_norm, ffn_post_norm;  // [n_embd] sandwich norms
  QMatrix w_gate;                // [n_ff, n_embd]
  QMatrix w_up;                  // [n_ff, n_embd]
  QMatrix w_down;                // [n_embd, n_ff]
  MoeWeights moe;                // FfnKind::kMoeSwiGlu layers (then w_gate, w_up, w_down are empty)
  DeltaNetWeights dn;            // LayerKind::kRecurrent layers (then wq, wk, wv, wo are empty)
  // Gemma 4: the per-layer embedding's gate [P, n_embd], projection [n_embd, P] and norm
  // [n_embd] (ModelHParams::n_embd_per_layer = P > 0), and the factor the layer's output is
  // scaled by (layer_output_scale; 1 when absent). A layer that reads an earlier layer's keys
  // and values (kv_source) has no wk, wv or attn_k_norm.
  QMatrix ple_gate, ple_proj;
  std::vector<float> ple_post_norm;
  float out_scale = 1.0f;
};

// Gemma 4's per-layer token embeddings (n_embd_per_layer = P > 0; empty otherwise).
struct PerLayerEmbd {
  QMatrix token;                 // per_layer_token_embd [n_vocab, n_layer * P]
  QMatrix proj;                  // per_layer_model_proj [n_layer * P, n_embd]
  std::vector<float> proj_norm;  // per_layer_proj_norm [P]
};

struct ModelLoadOptions {
  // Dequantise every matrix to F32 at load time: the exact computation of the stored weights
  // (no 8-bit activation quantisation), for reference comparisons; about 4-8x the memory.
  bool dequantize_to_f32 = false;
};

class Model {
 public:
  // Loads `path`. Errors name the file and what is wrong (missing tensor, wrong shape,
  // unsupported type or architecture).
  static Result<std::unique_ptr<Model>> load(const std::string& path,
                                             const ModelLoadOptions& opts = {});
  // Same from an open file (the file may be closed afterwards).
  static Result<std::unique_ptr<Model>> load(const GgufFile& file, const ModelLoadOptions& opts = {});

  Model(const Model&) = delete;  // the description points into the model's own tensors
  Model& operator=(const Model&) = delete;

  const ModelHParams& hparams() const { return hp_; }
  // What every layer computes (built from the hyper-parameters at load time).
  const ModelDesc& desc() const { return desc_; }
  const QMatrix& token_embd() const { return token_embd_; }  // [n_vocab, n_embd]
  const QMatrix& output() const { return output_ ? *output_ : token_embd_; }  // tied if absent
  bool tied_embeddings() const { return !output_.has_value(); }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<float>& rope_freq_factors() const { return rope_freqs_; }  // may be empty
  const LayerWeights& layer(int il) const { return layers_[static_cast<size_t>(il)]; }
  const PerLayerEmbd& per_layer_embd() const { return ple_; }
  // Bytes of weights held in memory.
  size_t weight_bytes() const { return weight_bytes_; }
  const std::string& path() const { return path_; }

 private:
  Model() = default;
  std::string path_;
  ModelHParams hp_;
  ModelDesc desc_;
  QMatrix token_embd_;
  std::optional<QMatrix> output_;
  std::vector<float> output_norm_;
  std::vector<float> rope_freqs_;
  std::vector<LayerWeights> layers_;
  PerLayerEmbd ple_;
  size_t weight_bytes_ = 0;
};

}  // namespace d2o
