#include "model/model.h"

#include <algorithm>
#include <cmath>

#include "ops/quant.h"

namespace d2o {

namespace {

// Loads tensors by name with shape checks, accumulating the bytes it copies.
class TensorLoader {
 public:
  TensorLoader(const GgufFile& f, bool to_f32) : f_(f), to_f32_(to_f32) {}
  size_t bytes() const { return bytes_; }

  // A matrix with GGUF dims {n_cols, n_rows}.
  Status matrix(const std::string& name, int64_t n_rows, int64_t n_cols, QMatrix* out) {
    return matrix_rows(name, 0, n_rows, n_rows, n_cols, out);
  }

  // Rows [row0, row0 + n_rows) of a matrix with GGUF dims {n_cols, total_rows}: one part of a
  // fused tensor (Phi-3's attn_qkv and gate-and-up ffn_up), read as a matrix of its own.
  Status matrix_rows(const std::string& name, int64_t row0, int64_t n_rows, int64_t total_rows,
                     int64_t n_cols, QMatrix* out) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return not_found("tensor '" + name + "' is missing");
    if (t->dims.size() != 2 || t->dims[0] != n_cols || t->dims[1] != total_rows) {
      return format_error("tensor '" + name + "' has shape " + t->shape_string() + ", expected [" +
                          std::to_string(n_cols) + ", " + std::to_string(total_rows) + "]");
    }
    return read_rows(*t, name, row0, n_rows, total_rows, out);
  }

  // Expert `e` of a stack of n_expert matrices [n_rows, n_cols] (GGUF dims {n_cols, n_rows,
  // n_expert}, a mixture of experts' ffn_*_exps): rows [e * n_rows, (e + 1) * n_rows) of the
  // tensor seen as one matrix, read as a matrix of its own.
  Status expert_matrix(const std::string& name, int64_t e, int64_t n_rows, int64_t n_cols,
                       int64_t n_expert, QMatrix* out) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return not_found("tensor '" + name + "' is missing");
    if (t->dims.size() != 3 || t->dims[0] != n_cols || t->dims[1] != n_rows ||
        t->dims[2] != n_expert) {
      return format_error("tensor '" + name + "' has shape " + t->shape_string() + ", expected [" +
                          std::to_string(n_cols) + ", " + std::to_string(n_rows) + ", " +
                          std::to_string(n_expert) + "] (columns, rows, experts)");
    }
    return read_rows(*t, name, e * n_rows, n_rows, n_rows * n_expert, out);
  }

  // A vector of n floats (stored as F32, F16 or BF16).
  Status vector(const std::string& name, int64_t n, std::vector<float>* out) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return not_found("tensor '" + name + "' is missing");
    if (t->n_elements() != n) {
      return format_error("tensor '" + name + "' has shape " + t->shape_string() + ", expected " +
                          std::to_string(n) + " elements");
    }
    if (t->type != GgmlType::kF32 && t->type != GgmlType::kF16 && t->type != GgmlType::kBF16) {
      return unsupported("tensor '" + name + "' has type " + ggml_type_name(t->type) +
                         " (expected F32, F16 or BF16)");
    }
    D2O_ASSIGN_OR_RETURN(const uint8_t* src, read(*t));
    out->resize(static_cast<size_t>(n));
    dequantize_row(t->type, src, out->data(), n);
    trim_scratch();
    bytes_ += out->size() * sizeof(float);
    return {};
  }

  bool has(const std::string& name) const { return f_.find_tensor(name) != nullptr; }

 private:
  // Rows [row0, row0 + n_rows) of `t`, whose shape the caller checked: total_rows rows of n_cols
  // (the row width of *out).
  Status read_rows(const GgufTensorInfo& t, const std::string& name, int64_t row0, int64_t n_rows,
                   int64_t total_rows, QMatrix* out) {
    const int64_t n_cols = t.dims[0];
    // Whole rows of blocks: the file's bytes divide evenly by its rows (checked below).
    const uint64_t row_bytes = total_rows > 0 ? t.n_bytes / static_cast<uint64_t>(total_rows) : 0;
    const uint64_t first = static_cast<uint64_t>(row0) * row_bytes;
    Result<QMatrix> m = QMatrix();
    if (to_f32_ && t.type != GgmlType::kF32) {
      if (!dequantize_supported(t.type)) {
        return unsupported("tensor '" + name + "' has type " + ggml_type_name(t.type) +
                           ", which d2o cannot compute with");
      }
      if (n_cols % ggml_block_size(t.type) != 0 ||
          static_cast<uint64_t>(ggml_row_bytes(t.type, n_cols)) != row_bytes) {
        return format_error("tensor '" + name + "' has " + std::to_string(t.n_bytes) +
                            " bytes of data, not whole rows of " + std::to_string(n_cols));
      }
      // Only the rows asked for (an expert's share of a stacked tensor, not the whole stack).
      const uint64_t n_read = static_cast<uint64_t>(n_rows) * row_bytes;
      if (scratch_.size() < n_read) scratch_.resize(static_cast<size_t>(n_read));
      D2O_RETURN_IF_ERROR(f_.read_tensor_bytes(t, first, n_read, scratch_.data()));
      std::vector<float> rows(static_cast<size_t>(n_rows * n_cols));
      for (int64_t r = 0; r < n_rows; ++r) {
        dequantize_row(t.type, scratch_.data() + static_cast<size_t>(r) * row_bytes,
                       rows.data() + r * n_cols, n_cols);
      }
      m = QMatrix::from_gguf_bytes(GgmlType::kF32, n_rows, n_cols,
                                   reinterpret_cast<const uint8_t*>(rows.data()),
                                   rows.size() * sizeof(float));
    } else {
      // Read a slice of rows at a time (about kKeepScratch bytes): the repacked matrix never sits
      // beside a whole copy of its file bytes.
      const int64_t slice =
          std::max<int64_t>(1, row_bytes > 0 ? static_cast<int64_t>(kKeepScratch / row_bytes) : 1);
      m = QMatrix::from_gguf_rows(t.type, n_rows, n_cols, slice,
                                  [&](uint64_t offset, uint64_t n, uint8_t* dst) {
                                    return f_.read_tensor_bytes(t, first + offset, n, dst);
                                  });
      if (m.ok() && static_cast<uint64_t>(m->raw_row_bytes() * total_rows) != t.n_bytes) {
        m = invalid_argument("expected " + std::to_string(m->raw_row_bytes() * total_rows) +
                             " bytes of data, got " + std::to_string(t.n_bytes));
      }
    }
    if (!m.ok()) return m.status().with_context("tensor '" + name + "'");
    *out = std::move(m).value();
    trim_scratch();
    bytes_ += out->bytes();
    return {};
  }

  // A tensor's bytes, read from the file into scratch_.
  Result<const uint8_t*> read(const GgufTensorInfo& t) {
    if (scratch_.size() < t.n_bytes) scratch_.resize(static_cast<size_t>(t.n_bytes));
    D2O_RETURN_IF_ERROR(f_.read_tensor(t, scratch_.data()));
    return static_cast<const uint8_t*>(scratch_.data());
  }
  // After a tensor is copied: a large scratch is freed, so that loading holds at most one
  // tensor's file bytes besides the weights (not the largest one for the rest of the load).
  void trim_scratch() {
    if (scratch_.size() > kKeepScratch) scratch_ = AlignedBuffer<uint8_t>();
  }
  static constexpr size_t kKeepScratch = size_t{4} << 20;

  const GgufFile& f_;
  bool to_f32_;
  size_t bytes_ = 0;
  AlignedBuffer<uint8_t> scratch_;
};

// rope_freqs.weight: Llama 3's long-context RoPE scaling, one factor per rotated pair (n_rot / 2)
// that divides the pair's angle (the converter computes them from rope_scaling type llama3).
// Optional, and only in the llama architecture (and gemma4, whose global layers turn their pairs
// by these factors: llama.cpp's proportional RoPE), as in llama.cpp, whose other architectures
// would ignore or refuse the tensor: a file that carries it elsewhere is refused rather than run
// with different positions.
Status load_rope_freqs(const GgufFile& f, TensorLoader& ld, const ModelHParams& h,
                       std::vector<float>* out) {
  const char* name = "rope_freqs.weight";
  const GgufTensorInfo* t = f.find_tensor(name);
  if (!t) return {};
  if (h.arch != ModelArch::kLlama && h.arch != ModelArch::kGemma4) {
    return unsupported(std::string("tensor '") + name +
                       "' (RoPE frequency factors) is not part of the " + model_arch_name(h.arch) +
                       " architecture");
  }
  if (t->dims.size() != 1) {
    return format_error(std::string("tensor '") + name + "' has shape " + t->shape_string() +
                        ", expected [" + std::to_string(h.n_rot / 2) +
                        "] (rope.dimension_count / 2)");
  }
  D2O_RETURN_IF_ERROR(ld.vector(name, h.n_rot / 2, out));
  for (size_t i = 0; i < out->size(); ++i) {
    const float v = (*out)[i];
    if (!(v > 0.0f) || !std::isfinite(v)) {
      return format_error(std::string("tensor '") + name + "' holds " + std::to_string(v) +
                          " at " + std::to_string(i) +
                          ": frequency factors must be positive and finite");
    }
  }
  return {};
}

// Q, K and V: three tensors, or (Phi-3) one fused attn_qkv whose rows are Q's, then K's, then
// V's, read as three matrices.
Status load_qkv(TensorLoader& ld, const ModelHParams& h, const std::string& b, LayerWeights* L) {
  const int64_t q_dim = int64_t{h.n_head} * h.head_dim;
  const int64_t kv_dim = int64_t{h.n_head_kv} * h.head_dim;
  const std::string fused = b + "attn_qkv.weight";
  if (h.arch == ModelArch::kPhi3 && ld.has(fused)) {
    const int64_t total = q_dim + 2 * kv_dim;
    D2O_RETURN_IF_ERROR(ld.matrix_rows(fused, 0, q_dim, total, h.n_embd, &L->wq));
    D2O_RETURN_IF_ERROR(ld.matrix_rows(fused, q_dim, kv_dim, total, h.n_embd, &L->wk));
    return ld.matrix_rows(fused, q_dim + kv_dim, kv_dim, total, h.n_embd, &L->wv);
  }
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_q.weight", q_dim, h.n_embd, &L->wq));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_k.weight", kv_dim, h.n_embd, &L->wk));
  return ld.matrix(b + "attn_v.weight", kv_dim, h.n_embd, &L->wv);
}

// The SwiGLU gate and up projections: two tensors, or (Phi-3) one ffn_up of 2 * n_ff rows, the
// gate's first, as llama.cpp's fused SwiGLU splits it.
Status load_gate_up(TensorLoader& ld, const ModelHParams& h, const std::string& b,
                    LayerWeights* L) {
  if (h.arch == ModelArch::kPhi3) {
    const int64_t n_ff = h.n_ff;
    D2O_RETURN_IF_ERROR(
        ld.matrix_rows(b + "ffn_up.weight", 0, n_ff, 2 * n_ff, h.n_embd, &L->w_gate));
    return ld.matrix_rows(b + "ffn_up.weight", n_ff, n_ff, 2 * n_ff, h.n_embd, &L->w_up);
  }
  D2O_RETURN_IF_ERROR(ld.matrix(b + "ffn_gate.weight", h.n_ff, h.n_embd, &L->w_gate));
  return ld.matrix(b + "ffn_up.weight", h.n_ff, h.n_embd, &L->w_up);
}

// A mixture of experts (qwen3moe): the router ffn_gate_inp (one row per expert) and the experts'
// gate, up and down projections, stacked in 3-D tensors that are split into one matrix per expert.
Status load_moe(TensorLoader& ld, const ModelHParams& h, const std::string& b, MoeWeights* moe) {
  D2O_RETURN_IF_ERROR(ld.matrix(b + "ffn_gate_inp.weight", h.n_expert, h.n_embd, &moe->router));
  moe->experts.resize(static_cast<size_t>(h.n_expert));
  for (int e = 0; e < h.n_expert; ++e) {
    ExpertWeights& x = moe->experts[static_cast<size_t>(e)];
    D2O_RETURN_IF_ERROR(
        ld.expert_matrix(b + "ffn_gate_exps.weight", e, h.n_ff_exp, h.n_embd, h.n_expert, &x.gate));
    D2O_RETURN_IF_ERROR(
        ld.expert_matrix(b + "ffn_up_exps.weight", e, h.n_ff_exp, h.n_embd, h.n_expert, &x.up));
    D2O_RETURN_IF_ERROR(
        ld.expert_matrix(b + "ffn_down_exps.weight", e, h.n_embd, h.n_ff_exp, h.n_expert, &x.down));
  }
  return {};
}

// A linear-attention layer's tensors (qwen35).
Status load_delta_net(TensorLoader& ld, const ModelHParams& h, const std::string& b,
                      DeltaNetWeights* w) {
  const int64_t nv = h.ssm_n_v_head, vd = h.ssm_value_dim(), cd = h.ssm_conv_dim();
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_qkv.weight", cd, h.n_embd, &w->qkv));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_gate.weight", vd, h.n_embd, &w->gate));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "ssm_beta.weight", nv, h.n_embd, &w->beta));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "ssm_alpha.weight", nv, h.n_embd, &w->alpha));
  D2O_RETURN_IF_ERROR(ld.vector(b + "ssm_conv1d.weight", cd * h.ssm_d_conv, &w->conv));
  D2O_RETURN_IF_ERROR(ld.vector(b + "ssm_dt.bias", nv, &w->dt_bias));
  D2O_RETURN_IF_ERROR(ld.vector(b + "ssm_a", nv, &w->a));
  D2O_RETURN_IF_ERROR(ld.vector(b + "ssm_norm.weight", h.ssm_head_dim, &w->norm));
  return ld.matrix(b + "ssm_out.weight", h.n_embd, vd, &w->out);
}

// A Qwen 3.5 layer: attn_norm; a linear-attention block, or full attention whose Q projection
// yields each head's query and gate (2 * q_dim rows), with QK-norm; post_attention_norm (the
// norm before the SwiGLU, kept as ffn_norm); the SwiGLU.
Status load_qwen35_layer(TensorLoader& ld, const ModelHParams& h, const LayerDesc& d,
                         const std::string& b, LayerWeights* L) {
  const int64_t q_dim = int64_t{h.n_head} * h.head_dim;
  const int64_t kv_dim = int64_t{h.n_head_kv} * h.head_dim;
  D2O_RETURN_IF_ERROR(ld.vector(b + "attn_norm.weight", h.n_embd, &L->attn_norm));
  if (d.kind == LayerKind::kRecurrent) {
    D2O_RETURN_IF_ERROR(load_delta_net(ld, h, b, &L->dn));
  } else {
    const std::string fused = b + "attn_qkv.weight";  // Q (with the gates), K, V in one tensor
    if (ld.has(fused)) {
      const int64_t total = 2 * q_dim + 2 * kv_dim;
      D2O_RETURN_IF_ERROR(ld.matrix_rows(fused, 0, 2 * q_dim, total, h.n_embd, &L->wq));
      D2O_RETURN_IF_ERROR(ld.matrix_rows(fused, 2 * q_dim, kv_dim, total, h.n_embd, &L->wk));
      D2O_RETURN_IF_ERROR(
          ld.matrix_rows(fused, 2 * q_dim + kv_dim, kv_dim, total, h.n_embd, &L->wv));
    } else {
      D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_q.weight", 2 * q_dim, h.n_embd, &L->wq));
      D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_k.weight", kv_dim, h.n_embd, &L->wk));
      D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_v.weight", kv_dim, h.n_embd, &L->wv));
    }
    D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_output.weight", h.n_embd, q_dim, &L->wo));
    D2O_RETURN_IF_ERROR(ld.vector(b + "attn_q_norm.weight", h.head_dim, &L->attn_q_norm));
    D2O_RETURN_IF_ERROR(ld.vector(b + "attn_k_norm.weight", h.head_dim, &L->attn_k_norm));
  }
  D2O_RETURN_IF_ERROR(ld.vector(b + "post_attention_norm.weight", h.n_embd, &L->ffn_norm));
  D2O_RETURN_IF_ERROR(load_gate_up(ld, h, b, L));
  return ld.matrix(b + "ffn_down.weight", h.n_embd, h.n_ff, &L->w_down);
}

// A Gemma 4 layer: per-kind head width; Q (and, unless the layer reads an earlier layer's, K, V
// and the K norm); sandwich norms; GeGLU; the per-layer embedding's gate, projection and norm;
// the output scale when present.
Status load_gemma4_layer(TensorLoader& ld, const ModelHParams& h, int il, const std::string& b,
                         LayerWeights* L) {
  const int64_t hd = h.layer_head_dim(il), E = h.n_embd, P = h.n_embd_per_layer;
  const int64_t q_dim = h.n_head * hd, kv_dim = h.n_head_kv * hd;
  D2O_RETURN_IF_ERROR(ld.vector(b + "attn_norm.weight", E, &L->attn_norm));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_q.weight", q_dim, E, &L->wq));
  D2O_RETURN_IF_ERROR(ld.vector(b + "attn_q_norm.weight", hd, &L->attn_q_norm));
  if (h.kv_source(il) == il) {
    D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_k.weight", kv_dim, E, &L->wk));
    if (!ld.has(b + "attn_v.weight")) {
      return unsupported("tensor '" + b +
                         "attn_v.weight' is missing: gemma4 with values equal "
                         "to keys (no V projection) is not supported");
    }
    D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_v.weight", kv_dim, E, &L->wv));
    D2O_RETURN_IF_ERROR(ld.vector(b + "attn_k_norm.weight", hd, &L->attn_k_norm));
  }
  D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_output.weight", E, q_dim, &L->wo));
  D2O_RETURN_IF_ERROR(ld.vector(b + "post_attention_norm.weight", E, &L->attn_post_norm));
  D2O_RETURN_IF_ERROR(ld.vector(b + "ffn_norm.weight", E, &L->ffn_norm));
  D2O_RETURN_IF_ERROR(load_gate_up(ld, h, b, L));
  D2O_RETURN_IF_ERROR(ld.matrix(b + "ffn_down.weight", E, h.n_ff, &L->w_down));
  D2O_RETURN_IF_ERROR(ld.vector(b + "post_ffw_norm.weight", E, &L->ffn_post_norm));
  if (P > 0) {
    D2O_RETURN_IF_ERROR(ld.matrix(b + "inp_gate.weight", P, E, &L->ple_gate));
    D2O_RETURN_IF_ERROR(ld.matrix(b + "proj.weight", E, P, &L->ple_proj));
    D2O_RETURN_IF_ERROR(ld.vector(b + "post_norm.weight", E, &L->ple_post_norm));
  }
  if (ld.has(b + "layer_output_scale.weight")) {
    std::vector<float> s;
    D2O_RETURN_IF_ERROR(ld.vector(b + "layer_output_scale.weight", 1, &s));
    L->out_scale = s[0];
  }
  return {};
}

// Gemma 4's per-layer token embeddings (P = n_embd_per_layer > 0), as wide as the gate buffer.
Status load_gemma4_ple(TensorLoader& ld, const ModelHParams& h, PerLayerEmbd* pe) {
  const int64_t P = h.n_embd_per_layer, width = P * h.n_layer;
  if (P == 0) return {};
  if (P > h.n_ff) {
    return unsupported("embedding_length_per_layer_input = " + std::to_string(P) +
                       " above feed_forward_length is not supported");
  }
  D2O_RETURN_IF_ERROR(ld.matrix("per_layer_token_embd.weight", h.n_vocab, width, &pe->token));
  D2O_RETURN_IF_ERROR(ld.matrix("per_layer_model_proj.weight", width, h.n_embd, &pe->proj));
  return ld.vector("per_layer_proj_norm.weight", P, &pe->proj_norm);
}

// Phi-3's LongRoPE (the 128K models, Phi-3.5): per-pair factors chosen by the context length,
// with a magnitude factor on the rotation that a re-rotated key would receive twice. Refused
// rather than run with other positions.
Status refuse_long_rope(const GgufFile& f) {
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"}) {
    if (f.find_tensor(name) || f.find_tensor(std::string("blk.0.") + name)) {
      return unsupported(std::string("tensor '") + name +
                         "': LongRoPE scaling (Phi-3 128K, Phi-3.5) is not supported; the 4K "
                         "Phi-3 models run");
    }
  }
  return {};
}

}  // namespace

Result<std::unique_ptr<Model>> Model::load(const std::string& path, const ModelLoadOptions& opts) {
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::open(path));
  return load(*file, opts);
}

Result<std::unique_ptr<Model>> Model::load(const GgufFile& f, const ModelLoadOptions& opts) {
  std::unique_ptr<Model> m(new Model());
  m->path_ = f.path();
  auto hp = ModelHParams::from_gguf(f);
  if (!hp.ok()) return hp.status().with_context(f.path());
  m->hp_ = *hp;
  const ModelHParams& h = m->hp_;
  const int64_t q_dim = int64_t{h.n_head} * h.head_dim;
  const int64_t kv_dim = int64_t{h.n_head_kv} * h.head_dim;

  TensorLoader ld(f, opts.dequantize_to_f32);
  auto load_all = [&]() -> Status {
    D2O_RETURN_IF_ERROR(ld.matrix("token_embd.weight", h.n_vocab, h.n_embd, &m->token_embd_));
    D2O_RETURN_IF_ERROR(ld.vector("output_norm.weight", h.n_embd, &m->output_norm_));
    if (ld.has("output.weight")) {
      m->output_.emplace();
      D2O_RETURN_IF_ERROR(ld.matrix("output.weight", h.n_vocab, h.n_embd, &*m->output_));
    }
    D2O_RETURN_IF_ERROR(load_rope_freqs(f, ld, h, &m->rope_freqs_));
    D2O_RETURN_IF_ERROR(refuse_long_rope(f));
    // Multi-section RoPE (qwen35): which pairs a text token's position turns, as factors.
    if (m->rope_freqs_.empty()) m->rope_freqs_ = mrope_text_freq_factors(h);
    // What each layer holds follows from its description (the RoPE tables point into the
    // model's own rope_freqs_, which no longer moves).
    auto desc = describe_model(h, m->rope_freqs_.empty() ? nullptr : m->rope_freqs_.data());
    if (!desc.ok()) return desc.status();
    m->desc_ = std::move(desc).value();
    if (h.arch == ModelArch::kGemma4) D2O_RETURN_IF_ERROR(load_gemma4_ple(ld, h, &m->ple_));
    m->layers_.resize(static_cast<size_t>(h.n_layer));
    for (int il = 0; il < h.n_layer; ++il) {
      LayerWeights& L = m->layers_[static_cast<size_t>(il)];
      const LayerDesc& layer_desc = m->desc_.layers[static_cast<size_t>(il)];
      const LayerNorms& nd = layer_desc.norms;
      const std::string b = "blk." + std::to_string(il) + ".";
      if (h.arch == ModelArch::kQwen35) {
        D2O_RETURN_IF_ERROR(load_qwen35_layer(ld, h, layer_desc, b, &L));
        continue;
      }
      if (h.arch == ModelArch::kGemma4) {
        D2O_RETURN_IF_ERROR(load_gemma4_layer(ld, h, il, b, &L));
        continue;
      }
      D2O_RETURN_IF_ERROR(ld.vector(b + "attn_norm.weight", h.n_embd, &L.attn_norm));
      if (nd.qk) {
        D2O_RETURN_IF_ERROR(ld.vector(b + "attn_q_norm.weight", h.head_dim, &L.attn_q_norm));
        D2O_RETURN_IF_ERROR(ld.vector(b + "attn_k_norm.weight", h.head_dim, &L.attn_k_norm));
      }
      if (nd.attn_post) {
        D2O_RETURN_IF_ERROR(
            ld.vector(b + "post_attention_norm.weight", h.n_embd, &L.attn_post_norm));
      }
      if (nd.ffn_post) {
        D2O_RETURN_IF_ERROR(ld.vector(b + "post_ffw_norm.weight", h.n_embd, &L.ffn_post_norm));
      }
      D2O_RETURN_IF_ERROR(load_qkv(ld, h, b, &L));
      D2O_RETURN_IF_ERROR(ld.matrix(b + "attn_output.weight", h.n_embd, q_dim, &L.wo));
      if (h.qkv_bias) {
        D2O_RETURN_IF_ERROR(ld.vector(b + "attn_q.bias", q_dim, &L.bq));
        D2O_RETURN_IF_ERROR(ld.vector(b + "attn_k.bias", kv_dim, &L.bk));
        D2O_RETURN_IF_ERROR(ld.vector(b + "attn_v.bias", kv_dim, &L.bv));
      }
      D2O_RETURN_IF_ERROR(ld.vector(b + "ffn_norm.weight", h.n_embd, &L.ffn_norm));
      if (layer_desc.ffn == FfnKind::kMoeSwiGlu) {
        D2O_RETURN_IF_ERROR(load_moe(ld, h, b, &L.moe));
        continue;
      }
      D2O_RETURN_IF_ERROR(load_gate_up(ld, h, b, &L));
      D2O_RETURN_IF_ERROR(ld.matrix(b + "ffn_down.weight", h.n_embd, h.n_ff, &L.w_down));
    }
    return {};
  };
  Status s = load_all();
  if (!s.ok()) return s.with_context(f.path());
  m->weight_bytes_ = ld.bytes();
  return m;
}

}  // namespace d2o
