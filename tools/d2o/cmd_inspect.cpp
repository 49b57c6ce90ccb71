// d2o inspect MODEL.gguf: what a GGUF file holds (architecture, hyper-parameters, tokenizer,
// tensors), without loading the weights, and what of it d2o runs: the model, the tokenizer, how
// each weight type is computed, which layers a KV policy compresses.
#include <cstdio>
#include <map>
#include <string>

#include "commands.h"
#include "core/mem.h"
#include "gguf/gguf.h"
#include "model/hparams.h"
#include "model/layer_desc.h"
#include "ops/matmul_pack.h"
#include "ops/quant.h"
#include "runtime/tokenizer.h"

namespace d2o::cli {

namespace {

struct InspectOptions {
  std::string model;
  bool all_metadata = false;
  bool no_tensors = false;
};

// How d2o computes with weights of `type`.
const char* weight_path(GgmlType type) {
  if (type == GgmlType::kBF16 && mm::pack_kind_for(type) != mm::PackKind::kRaw)
    return "packed kernels (rows of odd length: dequantised to F32)";
  if (mm::pack_kind_for(type) != mm::PackKind::kRaw) return "packed kernels";
  if (type == GgmlType::kF32) return "F32";
  if (dequantize_supported(type)) return "rows dequantised to F32 (no packed kernel: slower)";
  return "not supported";
}

// Which layers a KV policy compresses (global attention layers) and which keep their window.
void print_layers(const ModelHParams& hp) {
  auto desc = describe_model(hp, nullptr);
  if (!desc.ok()) {
    std::printf("%-13s %s\n", "d2o layers", desc.status().message().c_str());
    return;
  }
  int global = 0, recurrent = 0;
  std::string recurrent_list;
  for (size_t il = 0; il < desc->layers.size(); ++il) {
    const LayerKind k = desc->layers[il].kind;
    global += k == LayerKind::kGlobal;
    if (k != LayerKind::kRecurrent) continue;
    recurrent_list += (recurrent++ ? "," : "") + std::to_string(il);
  }
  const int n = static_cast<int>(desc->layers.size());
  int n_shared_global = 0;
  for (int il = hp.n_layer - hp.n_kv_shared; il < hp.n_layer; ++il)
    n_shared_global += !hp.is_sliding(il);
  if (hp.n_kv_shared > 0) {
    std::printf(
        "%-13s %d global and %d sliding-window attention layers (window %d); the last %d "
        "read earlier layers' keys and values, so a KV policy compresses the %d global "
        "layers that hold their own\n",
        "d2o layers", global, n - global, hp.sliding_window, hp.n_kv_shared,
        global - n_shared_global);
  } else if (recurrent > 0) {
    std::printf(
        "%-13s %d global attention layers compressed by a KV policy; %d linear-attention "
        "layers (%s) keep a recurrent state no policy touches\n",
        "d2o layers", global, recurrent, recurrent_list.c_str());
  } else if (global == n) {
    std::printf("%-13s %d global attention layers, every one compressed by a KV policy\n",
                "d2o layers", n);
  } else {
    std::printf(
        "%-13s %d global attention layers compressed by a KV policy; %d sliding-window "
        "layers keep their window of %d\n",
        "d2o layers", global, n - global, hp.sliding_window);
  }
}

// Gemma 4's layer shapes: which layers slide, each kind's head width, which layers share KV.
void print_gemma4(const ModelHParams& hp) {
  if (hp.arch != ModelArch::kGemma4) return;
  int sliding = 0;
  for (int il = 0; il < hp.n_layer; ++il) sliding += hp.is_sliding(il);
  std::printf("%-13s %d sliding-window layers (window %d, head_dim %d), %d global (head_dim %d)\n",
              "gemma4", sliding, hp.sliding_window, hp.head_dim_swa, hp.n_layer - sliding,
              hp.head_dim);
  if (hp.n_kv_shared > 0) {
    // The shared layers read the last earlier layer of their kind that holds its own KV.
    const int first = hp.n_layer - hp.n_kv_shared;
    int src_sliding = -1, src_global = -1;
    for (int il = first; il < hp.n_layer; ++il)
      (hp.is_sliding(il) ? src_sliding : src_global) = hp.kv_source(il);
    std::printf("%-13s layers %d..%d hold no KV: sliding ones read layer %d's, global ones %d's\n",
                "kv shared", first, hp.n_layer - 1, src_sliding, src_global);
  }
  if (hp.n_embd_per_layer > 0)
    std::printf("%-13s %d per layer\n", "layer embd", hp.n_embd_per_layer);
}

std::string value_string(const GgufValue& v) {
  switch (v.type) {
    case GgufType::kString: {
      std::string s = v.str.size() > 60 ? v.str.substr(0, 57) + "..." : v.str;
      for (char& ch : s) if (ch == '\n') ch = ' ';
      return "\"" + s + "\"";
    }
    case GgufType::kArray:
      return std::string("array<") + gguf_type_name(v.array_type) + ">[" +
             std::to_string(v.array_size) + "]";
    case GgufType::kFloat32:
    case GgufType::kFloat64: {
      char b[64];
      std::snprintf(b, sizeof b, "%g", v.f);
      return b;
    }
    case GgufType::kBool: return v.i ? "true" : "false";
    case GgufType::kUint64: return std::to_string(v.u);
    default: return std::to_string(v.i);
  }
}

int run_inspect(const InspectOptions& o) {
  auto file = GgufFile::open(o.model);
  if (!file.ok()) return fail(file.status());
  const GgufFile& f = **file;

  auto arch_r = f.get_string("general.architecture");
  const std::string arch = arch_r.ok() ? *arch_r : "(missing)";
  std::printf("file          %s\n", f.path().c_str());
  std::printf("gguf version  %u, %s, %zu metadata keys, %zu tensors\n", f.version(),
              format_bytes(static_cast<double>(f.file_size())).c_str(), f.metadata().size(),
              f.tensors().size());
  if (auto n = f.get_string("general.name"); n.ok()) std::printf("name          %s\n", n->c_str());
  std::printf("architecture  %s\n", arch.c_str());

  auto show_int = [&](const char* label, const std::string& key) {
    if (const GgufValue* v = f.find(key)) std::printf("%-13s %s\n", label, value_string(*v).c_str());
    else std::printf("%-13s (missing: %s)\n", label, key.c_str());
  };
  const std::string p = arch + ".";
  show_int("layers", p + "block_count");
  show_int("embedding", p + "embedding_length");
  show_int("ffn", p + "feed_forward_length");
  show_int("heads", p + "attention.head_count");
  show_int("kv heads", p + "attention.head_count_kv");
  // head_dim: explicit key_length if present, else embedding / heads.
  {
    auto kl = f.get_int(p + "attention.key_length");
    auto emb = f.get_int(p + "embedding_length");
    auto nh = f.get_int(p + "attention.head_count");
    if (kl.ok()) std::printf("%-13s %lld\n", "head_dim", static_cast<long long>(*kl));
    else if (emb.ok() && nh.ok() && *nh > 0)
      std::printf("%-13s %lld\n", "head_dim", static_cast<long long>(*emb / *nh));
  }
  show_int("context", p + "context_length");
  show_int("rope base", p + "rope.freq_base");
  show_int("rms eps", p + "attention.layer_norm_rms_epsilon");
  {
    long long vocab = -1;
    if (auto vs = f.get_int(p + "vocab_size"); vs.ok()) vocab = *vs;
    else if (const GgufValue* t = f.find("tokenizer.ggml.tokens")) vocab = static_cast<long long>(t->array_size);
    std::printf("%-13s %lld\n", "vocab", vocab);
  }
  if (auto tk = f.get_string("tokenizer.ggml.model"); tk.ok()) {
    auto pre = f.get_string("tokenizer.ggml.pre");
    std::printf("%-13s %s%s%s\n", "tokenizer", tk->c_str(), pre.ok() ? ", pre-tokenizer " : "",
                pre.ok() ? pre->c_str() : "");
  } else {
    std::printf("%-13s (none)\n", "tokenizer");
  }
  std::printf("chat template %s\n", f.find("tokenizer.chat_template") ? "yes" : "no");
  // What d2o can do with the file: the hyper-parameters its model code reads, and the tokenizer.
  if (auto hp = ModelHParams::from_gguf(f); hp.ok()) {
    print_gemma4(*hp);
    if (auto desc = describe_model(*hp, nullptr); desc.ok()) {
      std::printf("%-13s %s\n", "d2o model", "supported");
      print_layers(*hp);
    } else {
      std::printf("%-13s not supported by this build: %s\n", "d2o model",
                  desc.status().message().c_str());
    }
  } else {
    std::printf("%-13s not supported by this build: %s\n", "d2o model",
                hp.status().message().c_str());
  }
  if (!f.find("tokenizer.ggml.model")) {
    // no tokenizer: nothing to say beyond "(none)" above
  } else if (auto tok = Tokenizer::from_gguf(f); tok.ok()) {
    std::printf("%-13s supported (%d tokens, BOS %d, EOS %d)\n", "d2o tokenizer", (*tok)->n_vocab(),
                (*tok)->bos(), (*tok)->eos());
  } else {
    std::printf("%-13s not supported: %s\n", "d2o tokenizer", tok.status().message().c_str());
  }

  if (o.all_metadata) {
    std::printf("\nmetadata:\n");
    for (const auto& [k, v] : f.metadata()) std::printf("  %-44s %s\n", k.c_str(), value_string(v).c_str());
  }

  // Tensor type summary and (optionally) the full table.
  std::map<std::string, std::pair<int, uint64_t>> by_type;
  uint64_t total_bytes = 0;
  int64_t total_elems = 0;
  for (const auto& t : f.tensors()) {
    auto& e = by_type[ggml_type_name(t.type)];
    e.first += 1;
    e.second += t.n_bytes;
    total_bytes += t.n_bytes;
    total_elems += t.n_elements();
  }
  if (!o.no_tensors) {
    std::printf("\n%-36s %-8s %-22s %12s\n", "tensor", "type", "shape", "bytes");
    for (const auto& t : f.tensors()) {
      std::printf("%-36s %-8s %-22s %12llu\n", t.name.c_str(), ggml_type_name(t.type).c_str(),
                  t.shape_string().c_str(), static_cast<unsigned long long>(t.n_bytes));
    }
  }
  std::printf("\ntensor types:");
  for (const auto& [name, e] : by_type) {
    std::printf("  %s x%d (%s)", name.c_str(), e.first, format_bytes(static_cast<double>(e.second)).c_str());
  }
  // How d2o computes with each type its matrices come in (vectors are read as F32).
  std::map<std::string, GgmlType> matrix_types;
  for (const auto& t : f.tensors())
    if (t.dims.size() >= 2) matrix_types.emplace(ggml_type_name(t.type), t.type);
  std::printf("\nd2o weights:");
  for (const auto& [name, type] : matrix_types)
    std::printf("  %s: %s", name.c_str(), weight_path(type));
  std::printf("\ntotal         %lld parameters, %s of tensor data\n",
              static_cast<long long>(total_elems), format_bytes(static_cast<double>(total_bytes)).c_str());
  return 0;
}

}  // namespace

Action add_inspect_command(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand("inspect", "Print a GGUF model's architecture, hyper-parameters and tensors");
  sub->add_option("model", o->model,
                  "GGUF file or model name (smollm2, gemma3; default: $D2O_MODEL, else smollm2)");
  sub->add_option("-m,--model", o->model, "GGUF file or model name");
  sub->add_flag("--metadata", o->all_metadata, "Also list every metadata key");
  sub->add_flag("--no-tensors", o->no_tensors, "Omit the per-tensor table");
  return [o] {
    auto path = resolve_model_path(o->model);
    if (!path.ok()) return fail(path.status());
    o->model = *path;
    return run_inspect(*o);
  };
}

}  // namespace d2o::cli
