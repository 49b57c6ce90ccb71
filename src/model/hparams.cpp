#include "model/hparams.h"

#include <cmath>
#include <limits>

namespace d2o {

const char* model_arch_name(ModelArch arch) {
  switch (arch) {
    case ModelArch::kLlama: return "llama";
    case ModelArch::kQwen2: return "qwen2";
    case ModelArch::kQwen3: return "qwen3";
    case ModelArch::kGemma3: return "gemma3";
    case ModelArch::kPhi3:
      return "phi3";
    case ModelArch::kQwen3Moe:
      return "qwen3moe";
    case ModelArch::kQwen35:
      return "qwen35";
    case ModelArch::kGemma4:
      return "gemma4";
  }
  return "unknown";
}

namespace {
Status require_positive(const char* what, int64_t v, int64_t max) {
  if (v <= 0 || v > max) {
    return format_error(std::string(what) + " = " + std::to_string(v) + " is out of range (1.." +
                        std::to_string(max) + ")");
  }
  return {};
}

// RoPE scaling as llama.cpp reads it: rope.scaling.type defaults to linear, and the factor
// (rope.scaling.factor, or the older rope.scale_linear; 0 or absent: none) divides positions
// unless the type is none. YaRN and LongRoPE change the rotation itself and are refused, as is an
// attention factor other than 1 (it would scale every cos/sin). Llama 3's long-context scaling
// has no key: it is the rope_freqs.weight tensor of per-pair frequency factors (model.cpp).
Status read_rope_scaling(const GgufFile& f, const std::string& p, ModelHParams* hp) {
  std::string type = "linear";
  if (f.find(p + "rope.scaling.type")) {
    D2O_ASSIGN_OR_RETURN(type, f.get_string(p + "rope.scaling.type"));
  }
  if (type != "none" && type != "linear") {
    return unsupported("rope.scaling.type '" + type +
                       "' is not supported (supported: none, linear)");
  }
  D2O_ASSIGN_OR_RETURN(double factor, f.get_float_or(p + "rope.scale_linear", 0.0));
  D2O_ASSIGN_OR_RETURN(factor, f.get_float_or(p + "rope.scaling.factor", factor));
  // (A factor so small that 1 / factor overflows a float is as malformed as a negative one.)
  if (!(factor >= 0.0) || !std::isfinite(factor) ||
      (factor > 0.0 && 1.0 / factor > std::numeric_limits<float>::max())) {
    return format_error("rope.scaling.factor = " + std::to_string(factor) +
                        " must be positive (or 0: no scaling)");
  }
  if (type == "linear" && factor > 0.0) hp->rope_freq_scale = static_cast<float>(1.0 / factor);
  D2O_ASSIGN_OR_RETURN(double attn_factor, f.get_float_or(p + "rope.scaling.attn_factor", 1.0));
  if (attn_factor != 1.0) {
    return unsupported("rope.scaling.attn_factor = " + std::to_string(attn_factor) +
                       " is not supported (only 1)");
  }
  return {};
}

// The mixture of experts (qwen3moe), keys as llama.cpp reads them: expert_count experts, of which
// expert_used_count run per token, each of width expert_feed_forward_length (absent or 0:
// feed_forward_length / expert_used_count). Per-layer arrays of these keys are refused (d2o reads
// the scalar form). llama.cpp allows at most 1024 experts.
Status read_experts(const GgufFile& f, const std::string& p, int64_t n_ff, ModelHParams* hp) {
  for (const char* key : {"expert_count", "expert_used_count"}) {
    if (!f.find(p + key)) {
      return format_error(std::string(key) + " is missing: a " + hp->arch_name +
                          " model routes each token to some of its experts");
    }
  }
  D2O_ASSIGN_OR_RETURN(int64_t n_expert, f.get_int(p + "expert_count"));
  D2O_ASSIGN_OR_RETURN(int64_t n_used, f.get_int(p + "expert_used_count"));
  D2O_ASSIGN_OR_RETURN(int64_t n_ff_exp, f.get_int_or(p + "expert_feed_forward_length", 0));
  D2O_RETURN_IF_ERROR(require_positive("expert_count", n_expert, 1024));
  D2O_RETURN_IF_ERROR(require_positive("expert_used_count", n_used, 1024));
  if (n_used > n_expert) {
    return format_error("expert_used_count = " + std::to_string(n_used) +
                        " is more than expert_count = " + std::to_string(n_expert) +
                        ": a token cannot use more experts than the layer has");
  }
  if (n_ff_exp == 0) n_ff_exp = n_ff / n_used;
  D2O_RETURN_IF_ERROR(require_positive("expert_feed_forward_length", n_ff_exp, 1 << 18));
  hp->n_expert = static_cast<int>(n_expert);
  hp->n_expert_used = static_cast<int>(n_used);
  hp->n_ff_exp = static_cast<int>(n_ff_exp);
  return {};
}

// Which layers are linear-attention layers: attention.recurrent_layers (one flag per block, the
// multi-token-prediction blocks after the trunk included) when written, else every layer but each
// full_attention_interval-th (default 4), as llama.cpp decides.
Status read_recurrent_layers(const GgufFile& f, const std::string& p, int64_t n_layer,
                             int64_t n_block, ModelHParams* hp) {
  hp->recurrent.assign(static_cast<size_t>(n_layer), 0);
  if (const GgufValue* v = f.find(p + "attention.recurrent_layers")) {
    if (v->type != GgufType::kArray || v->array_size != static_cast<uint64_t>(n_block) ||
        (v->array_type != GgufType::kBool && v->array_type != GgufType::kUint8 &&
         v->array_type != GgufType::kInt8)) {
      return format_error("attention.recurrent_layers must be " + std::to_string(n_block) +
                          " flags, one per block");
    }
    for (int64_t il = 0; il < n_layer; ++il)
      hp->recurrent[static_cast<size_t>(il)] = v->array_data[il] != 0;
    return {};
  }
  D2O_ASSIGN_OR_RETURN(int64_t every, f.get_int_or(p + "full_attention_interval", 4));
  D2O_RETURN_IF_ERROR(require_positive("full_attention_interval", every, 1024));
  for (int64_t il = 0; il < n_layer; ++il)
    hp->recurrent[static_cast<size_t>(il)] = (il + 1) % every != 0;
  return {};
}

// Qwen 3.5's linear-attention layers (keys as llama.cpp reads them): ssm.conv_kernel (the
// convolution's width), ssm.state_size (the head width of keys and values), ssm.group_count
// (key/query heads), ssm.time_step_rank (value heads, a multiple of the key heads),
// ssm.inner_size (all value heads' width); and the RoPE sections.
Status read_linear_attention(const GgufFile& f, const std::string& p, ModelHParams* hp) {
  for (const char* key : {"ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                          "ssm.time_step_rank", "ssm.inner_size"}) {
    if (!f.find(p + key)) {
      return format_error(std::string(key) + " is missing: a " + hp->arch_name +
                          " model's linear-attention layers need it");
    }
  }
  D2O_ASSIGN_OR_RETURN(int64_t d_conv, f.get_int(p + "ssm.conv_kernel"));
  D2O_ASSIGN_OR_RETURN(int64_t d_state, f.get_int(p + "ssm.state_size"));
  D2O_ASSIGN_OR_RETURN(int64_t n_k, f.get_int(p + "ssm.group_count"));
  D2O_ASSIGN_OR_RETURN(int64_t n_v, f.get_int(p + "ssm.time_step_rank"));
  D2O_ASSIGN_OR_RETURN(int64_t d_inner, f.get_int(p + "ssm.inner_size"));
  D2O_RETURN_IF_ERROR(require_positive("ssm.conv_kernel", d_conv, 64));
  D2O_RETURN_IF_ERROR(require_positive("ssm.state_size", d_state, 1024));
  D2O_RETURN_IF_ERROR(require_positive("ssm.group_count", n_k, 1024));
  D2O_RETURN_IF_ERROR(require_positive("ssm.time_step_rank", n_v, 1024));
  if (n_v % n_k != 0 || d_inner != d_state * n_v) {
    return unsupported("ssm.time_step_rank = " + std::to_string(n_v) +
                       " must be a multiple of ssm.group_count = " + std::to_string(n_k) +
                       " and ssm.inner_size = " + std::to_string(d_inner) +
                       " equal to ssm.state_size x ssm.time_step_rank");
  }
  hp->ssm_d_conv = static_cast<int>(d_conv);
  hp->ssm_head_dim = static_cast<int>(d_state);
  hp->ssm_n_k_head = static_cast<int>(n_k);
  hp->ssm_n_v_head = static_cast<int>(n_v);
  D2O_ASSIGN_OR_RETURN(std::vector<int64_t> sections,
                       f.get_int_array(p + "rope.dimension_sections"));
  if (sections.empty() || sections.size() > 4) {
    return format_error("rope.dimension_sections must hold 1 to 4 counts");
  }
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i] < 0 || sections[i] > 512)
      return format_error("rope.dimension_sections out of range");
    hp->rope_sections[i] = static_cast<int>(sections[i]);
  }
  if (hp->rope_sections[0] + hp->rope_sections[1] + hp->rope_sections[2] + hp->rope_sections[3] ==
      0)
    return format_error("rope.dimension_sections are all 0");
  return {};
}

// An integer llama.cpp reads as one value or one per layer (feed_forward_length,
// attention.head_count_kv): a per-layer array is accepted when all its values are equal (d2o's
// layers share one width); `fallback` when absent.
Result<int64_t> get_layer_int(const GgufFile& f, const std::string& key, int64_t fallback) {
  const GgufValue* v = f.find(key);
  if (!v) return fallback;
  if (v->type != GgufType::kArray) return f.get_int(key);
  D2O_ASSIGN_OR_RETURN(std::vector<int64_t> a, f.get_int_array(key));
  if (a.empty()) return format_error(key + " is an empty array");
  for (int64_t x : a) {
    if (x != a[0]) {
      return unsupported(key + " differs between layers (" + std::to_string(a[0]) + " and " +
                         std::to_string(x) + "): per-layer widths are not supported");
    }
  }
  return a[0];
}

// A flag per layer (a GGUF array of bools or small integers), exactly n_layer of them.
Result<std::vector<uint8_t>> get_layer_flags(const GgufFile& f, const std::string& key,
                                             int64_t n_layer) {
  const GgufValue* v = f.find(key);
  if (!v) return format_error(key + " is missing");
  if (v->type != GgufType::kArray || v->array_size != static_cast<uint64_t>(n_layer) ||
      (v->array_type != GgufType::kBool && v->array_type != GgufType::kUint8 &&
       v->array_type != GgufType::kInt8)) {
    return format_error(key + " must be " + std::to_string(n_layer) + " flags, one per layer");
  }
  std::vector<uint8_t> out(static_cast<size_t>(n_layer));
  for (int64_t il = 0; il < n_layer; ++il) out[static_cast<size_t>(il)] = v->array_data[il] != 0;
  return out;
}

// Gemma 3 and 4's sliding-window keys: the window, the local RoPE base, the logit soft-cap.
Status read_sliding_window(const GgufFile& f, const std::string& p, ModelHParams* hp) {
  D2O_ASSIGN_OR_RETURN(int64_t window, f.get_int_or(p + "attention.sliding_window", 0));
  if (window < 0 || window > (1 << 24)) {
    return format_error("attention.sliding_window = " + std::to_string(window) +
                        " is out of range (0.." + std::to_string(1 << 24) + ")");
  }
  D2O_ASSIGN_OR_RETURN(double base_swa, f.get_float_or(p + "rope.freq_base_swa", 10000.0));
  D2O_ASSIGN_OR_RETURN(double softcap, f.get_float_or(p + "final_logit_softcapping", 0.0));
  if (!(base_swa > 0.0) || !(softcap >= 0.0)) {
    return format_error("rope.freq_base_swa must be positive and final_logit_softcapping >= 0");
  }
  hp->sliding_window = static_cast<int>(window);
  hp->rope_freq_base_swa = static_cast<float>(base_swa);
  hp->final_logit_softcap = static_cast<float>(softcap);
  return {};
}

// Gemma 4's keys, as llama.cpp reads them: attention.sliding_window_pattern (one flag per layer),
// attention.key_length_swa / value_length_swa (the sliding layers' head width),
// rope.dimension_count_swa, attention.shared_kv_layers (how many last layers reuse earlier
// layers' KV), embedding_length_per_layer_input. The mixture-of-experts variant is refused.
Status read_gemma4(const GgufFile& f, const std::string& p, int64_t n_layer, ModelHParams* hp) {
  if (f.find(p + "expert_count")) {
    D2O_ASSIGN_OR_RETURN(int64_t n_expert, f.get_int(p + "expert_count"));
    if (n_expert > 0) {
      return unsupported("gemma4 with a mixture of experts (expert_count = " +
                         std::to_string(n_expert) + ") is not supported: dense gemma4 only");
    }
  }
  D2O_RETURN_IF_ERROR(read_sliding_window(f, p, hp));
  if (hp->sliding_window <= 0) return format_error("attention.sliding_window is missing or 0");
  D2O_ASSIGN_OR_RETURN(hp->swa_layers,
                       get_layer_flags(f, p + "attention.sliding_window_pattern", n_layer));
  D2O_ASSIGN_OR_RETURN(int64_t hd_swa, f.get_int_or(p + "attention.key_length_swa", 0));
  D2O_ASSIGN_OR_RETURN(int64_t vd_swa, f.get_int_or(p + "attention.value_length_swa", hd_swa));
  D2O_RETURN_IF_ERROR(require_positive("attention.key_length_swa", hd_swa, 1024));
  if (vd_swa != hd_swa || hd_swa % 2 != 0) {
    return unsupported("attention.value_length_swa must equal attention.key_length_swa (even)");
  }
  D2O_ASSIGN_OR_RETURN(int64_t rot_swa, f.get_int_or(p + "rope.dimension_count_swa", hd_swa));
  if (rot_swa <= 0 || rot_swa > hd_swa || rot_swa % 2 != 0) {
    return format_error("rope.dimension_count_swa = " + std::to_string(rot_swa) +
                        " must be even and at most attention.key_length_swa");
  }
  D2O_ASSIGN_OR_RETURN(int64_t shared, f.get_int_or(p + "attention.shared_kv_layers", 0));
  if (shared < 0 || shared >= n_layer) {
    return format_error("attention.shared_kv_layers = " + std::to_string(shared) +
                        " must leave at least one layer with its own keys and values");
  }
  D2O_ASSIGN_OR_RETURN(int64_t ple, f.get_int_or(p + "embedding_length_per_layer_input", 0));
  if (ple < 0 || ple > (1 << 16)) {
    return format_error("embedding_length_per_layer_input = " + std::to_string(ple) +
                        " is out of range (0..65536)");
  }
  hp->head_dim_swa = static_cast<int>(hd_swa);
  hp->n_rot_swa = static_cast<int>(rot_swa);
  hp->n_kv_shared = static_cast<int>(shared);
  hp->n_embd_per_layer = static_cast<int>(ple);
  hp->n_layer = static_cast<int>(n_layer);  // kv_source reads it
  for (int il = 0; il < n_layer; ++il) {
    if (hp->kv_source(il) < 0) {
      return format_error(std::string("layer ") + std::to_string(il) +
                          " shares the keys and values of an earlier " +
                          (hp->is_sliding(il) ? "sliding" : "global") +
                          " layer, and none holds its own (attention.shared_kv_layers)");
    }
  }
  return {};
}

}  // namespace

int ModelHParams::kv_source(int il) const {
  const int first_shared = n_layer - n_kv_shared;
  if (n_kv_shared <= 0 || il < first_shared) return il;
  for (int j = first_shared - 1; j >= 0; --j)
    if (is_sliding(j) == is_sliding(il)) return j;
  return -1;
}

Result<ModelHParams> ModelHParams::from_gguf(const GgufFile& f) {
  ModelHParams hp;
  D2O_ASSIGN_OR_RETURN(hp.arch_name, f.get_string("general.architecture"));
  if (hp.arch_name == "llama" || hp.arch_name == "mistral") {
    hp.arch = ModelArch::kLlama;
    hp.rope_type = RopeType::kNorm;
  } else if (hp.arch_name == "qwen2") {
    hp.arch = ModelArch::kQwen2;
    hp.rope_type = RopeType::kNeox;
    hp.qkv_bias = true;
  } else if (hp.arch_name == "qwen3") {
    hp.arch = ModelArch::kQwen3;
    hp.rope_type = RopeType::kNeox;
  } else if (hp.arch_name == "gemma3") {
    hp.arch = ModelArch::kGemma3;
    hp.rope_type = RopeType::kNeox;
  } else if (hp.arch_name == "phi3") {
    hp.arch = ModelArch::kPhi3;
    hp.rope_type = RopeType::kNeox;
  } else if (hp.arch_name == "qwen3moe") {
    hp.arch = ModelArch::kQwen3Moe;
    hp.rope_type = RopeType::kNeox;
  } else if (hp.arch_name == "qwen35") {
    hp.arch = ModelArch::kQwen35;
    hp.rope_type = RopeType::kNeox;
  } else if (hp.arch_name == "gemma4") {
    hp.arch = ModelArch::kGemma4;
    hp.rope_type = RopeType::kNeox;
  } else {
    return unsupported("model architecture '" + hp.arch_name +
                       "' is not supported (supported: llama, mistral, qwen2, qwen3, qwen3moe, "
                       "qwen35, gemma3, gemma4, phi3)");
  }
  const std::string p = hp.arch_name + ".";
  D2O_ASSIGN_OR_RETURN(int64_t n_layer, f.get_int(p + "block_count"));
  D2O_ASSIGN_OR_RETURN(int64_t n_embd, f.get_int(p + "embedding_length"));
  const std::string ff_key = p + "feed_forward_length";
  D2O_ASSIGN_OR_RETURN(int64_t n_ff,
                       f.find(ff_key) ? get_layer_int(f, ff_key, 0) : f.get_int(ff_key));
  D2O_ASSIGN_OR_RETURN(int64_t n_head, f.get_int(p + "attention.head_count"));
  D2O_ASSIGN_OR_RETURN(int64_t n_head_kv, get_layer_int(f, p + "attention.head_count_kv", n_head));
  D2O_ASSIGN_OR_RETURN(int64_t n_ctx, f.get_int_or(p + "context_length", 2048));
  D2O_RETURN_IF_ERROR(require_positive("block_count", n_layer, 1024));
  D2O_RETURN_IF_ERROR(require_positive("embedding_length", n_embd, 1 << 16));
  D2O_RETURN_IF_ERROR(require_positive("feed_forward_length", n_ff, 1 << 18));
  D2O_RETURN_IF_ERROR(require_positive("attention.head_count", n_head, 1024));
  D2O_RETURN_IF_ERROR(require_positive("attention.head_count_kv", n_head_kv, n_head));
  D2O_RETURN_IF_ERROR(require_positive("context_length", n_ctx, 1 << 24));
  if (n_head % n_head_kv != 0) {
    return format_error("attention.head_count (" + std::to_string(n_head) +
                        ") is not a multiple of attention.head_count_kv (" +
                        std::to_string(n_head_kv) + ")");
  }
  if (n_head / n_head_kv > 64) {
    return unsupported("more than 64 query heads per KV head is not supported");
  }
  D2O_ASSIGN_OR_RETURN(int64_t head_dim, f.get_int_or(p + "attention.key_length", n_embd / n_head));
  D2O_ASSIGN_OR_RETURN(int64_t v_dim, f.get_int_or(p + "attention.value_length", head_dim));
  D2O_RETURN_IF_ERROR(require_positive("attention.key_length", head_dim, 1024));
  if (v_dim != head_dim) {
    return unsupported("attention.value_length != attention.key_length is not supported");
  }
  if (head_dim % 2 != 0) return format_error("head dimension must be even for RoPE");
  D2O_ASSIGN_OR_RETURN(int64_t n_rot, f.get_int_or(p + "rope.dimension_count", head_dim));
  if (n_rot <= 0 || n_rot > head_dim || n_rot % 2 != 0) {
    return format_error("rope.dimension_count = " + std::to_string(n_rot) +
                        " must be even and at most the head dimension " + std::to_string(head_dim));
  }
  D2O_ASSIGN_OR_RETURN(double base, f.get_float_or(p + "rope.freq_base", 10000.0));
  D2O_ASSIGN_OR_RETURN(double eps, f.get_float_or(p + "attention.layer_norm_rms_epsilon", 1e-5));
  if (!(base > 0.0) || !(eps > 0.0) || eps > 1.0) {
    return format_error("rope.freq_base and layer_norm_rms_epsilon must be positive");
  }
  D2O_RETURN_IF_ERROR(read_rope_scaling(f, p, &hp));
  int64_t n_vocab = 0;
  if (auto vs = f.get_int(p + "vocab_size"); vs.ok()) {
    n_vocab = *vs;
  } else if (const GgufValue* t = f.find("tokenizer.ggml.tokens")) {
    n_vocab = static_cast<int64_t>(t->array_size);
  } else if (const GgufTensorInfo* te = f.find_tensor("token_embd.weight"); te && te->dims.size() == 2) {
    n_vocab = te->dims[1];
  }
  D2O_RETURN_IF_ERROR(require_positive("vocab size", n_vocab, 1 << 22));

  if (hp.arch == ModelArch::kGemma3) {
    // Five sliding-window layers, then a global one (the pattern is not written in the file; it
    // is Gemma 3's design). The local layers' RoPE base is fixed at 10000, unscaled.
    // Without a window every layer is global. A pattern of 0 makes every layer local.
    D2O_RETURN_IF_ERROR(read_sliding_window(f, p, &hp));
    D2O_ASSIGN_OR_RETURN(int64_t pattern, f.get_int_or(p + "attention.sliding_window_pattern", 6));
    if (pattern < 0 || pattern > 1024) {
      return format_error("attention.sliding_window_pattern = " + std::to_string(pattern) +
                          " is out of range (0..1024)");
    }
    hp.swa_pattern = static_cast<int>(pattern);
  }
  if (hp.arch == ModelArch::kGemma4) D2O_RETURN_IF_ERROR(read_gemma4(f, p, n_layer, &hp));

  if (hp.arch == ModelArch::kQwen3Moe) D2O_RETURN_IF_ERROR(read_experts(f, p, n_ff, &hp));
  if (hp.arch == ModelArch::kQwen35) {
    // The blocks after the trunk (nextn_predict_layers) predict further tokens; d2o runs the trunk.
    D2O_ASSIGN_OR_RETURN(int64_t n_next, f.get_int_or(p + "nextn_predict_layers", 0));
    if (n_next < 0 || n_next >= n_layer) {
      return format_error("nextn_predict_layers = " + std::to_string(n_next) +
                          " leaves no trunk of the " + std::to_string(n_layer) + " blocks");
    }
    D2O_RETURN_IF_ERROR(read_linear_attention(f, p, &hp));
    D2O_RETURN_IF_ERROR(read_recurrent_layers(f, p, n_layer - n_next, n_layer, &hp));
    n_layer -= n_next;
  }

  hp.n_layer = static_cast<int>(n_layer);
  hp.n_embd = static_cast<int>(n_embd);
  hp.n_ff = static_cast<int>(n_ff);
  hp.n_head = static_cast<int>(n_head);
  hp.n_head_kv = static_cast<int>(n_head_kv);
  hp.head_dim = static_cast<int>(head_dim);
  hp.n_rot = static_cast<int>(n_rot);
  hp.n_vocab = static_cast<int>(n_vocab);
  hp.n_ctx_train = static_cast<int>(n_ctx);
  hp.rope_freq_base = static_cast<float>(base);
  hp.rms_eps = static_cast<float>(eps);
  return hp;
}

}  // namespace d2o
