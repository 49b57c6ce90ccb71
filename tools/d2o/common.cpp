#include "common.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <sstream>

#include "commands.h"
#include "core/mem.h"
#include "core/timer.h"
#include "eval/kv_bytes.h"
#include "kv/cold_tier.h"
#include "kv/policy/composed.h"
#include "model/layer_desc.h"
#include "runtime/kv_pool.h"

namespace d2o::cli {

void add_prefill_chunk_option(CLI::App* app, int& chunk) {
  app->add_option("--chunk", chunk,
                  "Prompt tokens per prefill pass (0: the whole prompt in one pass). A fixed "
                  "budget (budget=, --kv-mem-per-seq) and ratio=...,prefill=bounded compact "
                  "between passes, so the cache stays within its budget plus two chunks for any "
                  "prompt length; other ratio policies and the full cache give the same result "
                  "either way")
      ->check(CLI::Range(0, 1 << 24));
}

void add_model_options(CLI::App* app, ModelOptions& o, bool with_kv) {
  app->add_option(
      "-m,--model", o.model,
      "GGUF model file or model name (smollm2, gemma3; default: $D2O_MODEL, else smollm2)");
  app->add_option("-t,--threads", o.threads, "Threads (default: all cores)")->check(CLI::Range(0, 1024));
  app->add_option("-c,--ctx-size", o.n_ctx, "Context size in tokens (default: the model's trained context)")
      ->check(CLI::Range(0, 1 << 24));
  app->add_option("--ubatch", o.n_ubatch, "Rows per micro-batch")->check(CLI::Range(1, 1 << 16));
  app->add_option("--kv-type", o.kv_type,
                  "KV cache storage type of keys and values: f16 (default), f32, q8_0 or q4_0; "
                  "or k:TYPE,v:TYPE for different ones");
  app->add_flag("--dequantize", o.dequantize,
                "Compute with the weights dequantised to F32 (exact reference arithmetic, more memory)");
  if (with_kv) {
    app->add_option("--kv-mem-per-seq", o.kv_mem_per_seq,
                    "KV memory of the sequence, e.g. 20M (powers of 1024): the --kv policy's "
                    "budget is the slots that fit with --kv-type (a full cache stops there)");
    app->add_option("--kv", o.kv_spec,
                    "KV cache policy spec, e.g. full, d2o:ratio=0.2, h2o:budget=512, streaming:budget=256");
  }
}

void add_sampling_options(CLI::App* app, SamplerParams& p) {
  app->add_option("--temp", p.temperature, "Temperature (0 = greedy, the default)");
  app->add_option("--top-k", p.top_k, "Top-k (0 = off)");
  app->add_option("--top-p", p.top_p, "Top-p (1 = off)");
  app->add_option("--min-p", p.min_p, "Min-p (0 = off)");
  app->add_option("--repeat-penalty", p.repeat_penalty, "Repetition penalty (1 = off)");
  app->add_option("--repeat-last-n", p.repeat_last_n, "Tokens the repetition penalty looks back on");
  app->add_option("--seed", p.seed, "Random seed (same seed, same text)");
}

Result<KvType> parse_kv_type(const std::string& s) {
  auto t = d2o::parse_kv_type(s);
  if (!t.ok()) return t.status().with_context("--kv-type");
  return *t;
}

Result<Loaded> load_all(const ModelOptions& o) {
  Loaded l;
  Stopwatch sw;
  D2O_ASSIGN_OR_RETURN(l.kv_type, parse_kv_type(o.kv_type));
  auto pol = parse_kv_policy(o.kv_spec);
  if (!pol.ok()) return pol.status().with_context("--kv");
  l.policy = std::shared_ptr<const KvPolicy>(std::move(pol).value());
  D2O_ASSIGN_OR_RETURN(const std::string path, resolve_model_path(o.model));
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::open(path));
  ModelLoadOptions mo;
  mo.dequantize_to_f32 = o.dequantize;
  D2O_ASSIGN_OR_RETURN(l.model, Model::load(*file, mo));
  if (Status st = check_kv_type(l.kv_type, l.model->hparams().head_dim); !st.ok()) {
    return st.with_context("--kv-type");
  }
  if (!o.kv_mem_per_seq.empty()) {
    int slots = 0;
    D2O_ASSIGN_OR_RETURN(
        const std::string spec,
        spec_for_kv_mem(o.kv_spec, o.kv_mem_per_seq, kv_cache_config(l.model->hparams(), l.kv_type),
                        l.model->hparams().n_ctx_train, &slots));
    auto p = parse_kv_policy(spec);
    if (!p.ok()) return p.status().with_context("--kv");
    l.policy = std::shared_ptr<const KvPolicy>(std::move(p).value());
    if (l.policy->spec() == "full") l.kv_full_slots = slots;
    l.kv_mem_note = kv_mem_note(o.kv_mem_per_seq, l.kv_type, slots, l.kv_full_slots > 0);
  }
  auto tok = Tokenizer::from_gguf(*file);
  if (!tok.ok()) return tok.status().with_context(path);
  l.tokenizer = std::move(tok).value();
  if (auto tmpl = ChatTemplate::from_gguf(*file); tmpl.ok()) {
    l.chat_template = *tmpl;
  } else {
    l.chat_template_error = tmpl.status().message();
  }
  file.reset();  // weights are copied; drop the mapping
  const int trained = l.model->hparams().n_ctx_train;
  l.n_ctx = o.n_ctx > 0 ? o.n_ctx : trained;
  l.pool = std::make_unique<ThreadPool>(o.threads);
  EngineOptions eo;
  eo.n_ubatch = o.n_ubatch;
  l.engine = std::make_unique<Engine>(*l.model, *l.pool, eo);
  l.load_seconds = sw.seconds();
  return l;
}

std::string memory_summary(const Loaded& l, const Sequence& seq) {
  const KvCache& c = seq.cache();
  const KvBytesShares b = kv_bytes_shares(c, seq.n_past());
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "memory: weights %s, KV %s allocated (%s in use: %.1f%% of a full %s cache's %s, "
                "%.1f%% of a full F16 cache's %s for %lld tokens; slot metadata %s), peak RSS %s",
                format_bytes(static_cast<double>(l.model->weight_bytes())).c_str(),
                format_bytes(b.allocated).c_str(), format_bytes(b.needed).c_str(),
                b.full_same > 0 ? 100.0 * b.needed / b.full_same : 0.0,
                kv_type_name(c.config().type), format_bytes(b.full_same).c_str(),
                b.full_f16 > 0 ? 100.0 * b.needed / b.full_f16 : 0.0,
                format_bytes(b.full_f16).c_str(), static_cast<long long>(seq.n_past()),
                format_bytes(static_cast<double>(c.meta_bytes_allocated())).c_str(),
                format_bytes(static_cast<double>(peak_rss_bytes())).c_str());
  std::string out = buf;
  // Linear-attention layers (qwen35): their recurrent state, of a fixed size whatever the length.
  if (const size_t rb = c.recurrent().bytes(); rb > 0)
    out += "; recurrent state " + format_bytes(static_cast<double>(rb));
  return out;
}

}  // namespace d2o::cli

namespace d2o::cli {

KvBytesShares kv_bytes_shares(const KvCache& c, int64_t n_tokens) {
  KvBytesShares b;
  size_t slots = 0;
  for (int il = 0; il < c.n_layer(); ++il) {
    // A sliding-window layer's slots past its window wait to be dropped: attention skips them.
    const int w = c.config().window(il);
    const int n = c.layer(il).n_slot();
    slots += static_cast<size_t>(w > 0 ? std::min(n, w) : n);
  }
  b.needed = static_cast<double>(slots * eval::kv_slot_bytes(c.config()));
  b.allocated = static_cast<double>(c.kv_bytes_allocated());
  b.full_same = static_cast<double>(eval::full_kv_bytes(c.config(), n_tokens));
  b.full_f16 = static_cast<double>(eval::full_kv_bytes(eval::f16_config(c.config()), n_tokens));
  return b;
}

namespace {

// How the budget is set, and what was chosen: the report's first lines.
void print_budget(std::FILE* out, const Sequence& seq, const std::string& mem_note) {
  const KvCache& c = seq.cache();
  const PolicyState& st = seq.policy_state();
  const auto* composed = dynamic_cast<const ComposedPolicy*>(&seq.policy());
  const ComposedPolicyState* own = composed_state(st);
  std::string how;
  if (!composed) {
    how = seq.policy().is_full() ? "none, the full cache keeps every token" : "set by the policy";
  } else if (composed->config().mode == BudgetMode::kBudget) {
    how = "budget=" + std::to_string(composed->config().budget) +
          " slots per KV head and layer on average, at all times";
  } else {
    const PolicyConfig& cfg = composed->config();
    const std::string of = st.budgets_set && own && own->prompt_end > 0
                               ? "the prompt's " + std::to_string(own->prompt_end) + " tokens"
                               : "the prompt's tokens";
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%g", cfg.ratio);
    how = "ratio=" + std::string(ratio) + " of " + of +
          (cfg.bounded_prefill()
               ? " (prefill=bounded: known at its first pass, compacted to between its passes)"
               : " (prefill=exact: the whole prompt held, then compressed after its last pass)");
  }
  std::fprintf(out, "budget: %s\n", how.c_str());
  if (!mem_note.empty()) std::fprintf(out, "  from %s\n", mem_note.c_str());
  if (!composed) return;
  if (!st.budgets_set) {
    std::fprintf(out, "  chosen: not yet (no pass held more than the budget)\n");
    return;
  }
  int64_t sum = 0;
  int n = 0, lo = 0, hi = 0;
  for (int il = 0; il < c.n_layer() && static_cast<size_t>(il) < st.budgets.size(); ++il) {
    const int b = st.budgets[static_cast<size_t>(il)];
    if (!c.config().layer_compressible(il) || b == PolicyState::kNoBudget) continue;
    lo = n == 0 ? b : std::min(lo, b);
    hi = n == 0 ? b : std::max(hi, b);
    sum += b;
    ++n;
  }
  if (n == 0) {
    std::fprintf(out, "  chosen: no layer is compressed\n");
    return;
  }
  std::fprintf(out,
               "  chosen: %.1f slots per KV head on average over %d compressed layers (%d to %d), "
               "%lld slots per KV head in all\n",
               static_cast<double>(sum) / n, n, lo, hi, static_cast<long long>(sum));
}

// Every byte the sequence holds, and the hot cache's peak.
void print_bytes_held(std::FILE* out, const Sequence& seq, const KvBytesShares& b) {
  const KvCache& c = seq.cache();
  const size_t hot = c.kv_bytes_allocated(), meta = c.meta_bytes_allocated();
  const size_t state = seq.policy_state().held_bytes();
  const ColdTier* cold = c.cold();
  const size_t cold_rows = cold ? cold->rows_bytes() : 0, cold_meta = cold ? cold->meta_bytes() : 0;
  const double all = static_cast<double>(hot + meta + state + cold_rows + cold_meta);
  std::string parts = "hot key and value rows " + format_bytes(static_cast<double>(hot)) + " (" +
                      format_bytes(static_cast<double>(c.kv_bytes_used())) +
                      " in slots), hot slot metadata " + format_bytes(static_cast<double>(meta)) +
                      ", KV policy state " + format_bytes(static_cast<double>(state));
  if (cold) {
    parts += ", cold tier " + format_bytes(static_cast<double>(cold_rows)) + " of rows and " +
             format_bytes(static_cast<double>(cold_meta)) + " of metadata";
  }
  std::fprintf(out, "bytes held in memory: %s; %s in all = %.1f%% of a full F16 cache's key and "
               "value bytes (%s)\n",
               parts.c_str(), format_bytes(all).c_str(),
               b.full_f16 > 0 ? 100.0 * all / b.full_f16 : 0.0, format_bytes(b.full_f16).c_str());
  if (cold && cold->config().place == ColdPlace::kDisk)
    std::fprintf(out, "bytes on disk: %s (the cold tier's file)\n",
                 format_bytes(static_cast<double>(cold->disk_bytes())).c_str());
  std::fprintf(out,
               "peak: %s of hot key and value rows and slot metadata allocated at once (the "
               "cold tier and policy state not counted)\n",
               format_bytes(static_cast<double>(c.peak_bytes_allocated())).c_str());
}

}  // namespace

void print_kv_report(std::FILE* out, const Sequence& seq, const std::string& mem_note) {
  const KvCache& c = seq.cache();
  const PolicyState& st = seq.policy_state();
  // D2O thresholds and layer statistics: the composed policies' own state (absent for others).
  static const ComposedPolicyState kNone;
  static const D2oMergeState kNoMerger;
  const ComposedPolicyState* own = composed_state(st);
  const ComposedPolicyState& cs = own ? *own : kNone;
  const D2oMergeState* d2o = d2o_merge_state(st);
  const D2oMergeState& ms = d2o ? *d2o : kNoMerger;
  std::fprintf(out, "KV report (%s, %s storage, %lld tokens seen)\n", seq.policy().spec().c_str(),
               kv_type_name(c.config().type), static_cast<long long>(seq.n_past()));
  print_budget(out, seq, mem_note);
  std::fprintf(out, "%5s %-10s %8s %8s %9s %9s %8s %10s\n", "layer", "kind", "budget", "slots",
               "evicted", "merged", "tau", "variance");
  int64_t tot_slots = 0, full_slots = 0;
  for (int il = 0; il < c.n_layer(); ++il) {
    const KvLayer& L = c.layer(il);
    // Per-head budgets (heads=ada): heads hold different counts; the column shows their range.
    tot_slots += L.held_slots() / L.n_head_kv();
    char slot_s[32];
    int lo = L.n_slot();
    for (int g = 0; g < L.n_head_kv(); ++g) lo = std::min(lo, L.n_slot(g));
    if (L.uniform())
      std::snprintf(slot_s, sizeof slot_s, "%d", L.n_slot());
    else
      std::snprintf(slot_s, sizeof slot_s, "%d-%d", lo, L.n_slot());
    const int w = c.config().window(il);
    full_slots += w > 0 ? std::min<int64_t>(seq.n_past(), w) : seq.n_past();
    char kind_s[32] = "global";
    if (w > 0) std::snprintf(kind_s, sizeof kind_s, "window %d", w);
    const bool has_budget = st.budgets_set && static_cast<size_t>(il) < st.budgets.size();
    double tau = 0;
    int n_tau = 0;
    for (int g = 0; g < L.n_head_kv(); ++g) {
      const size_t k = static_cast<size_t>(il) * L.n_head_kv() + g;
      if (k < ms.tau_ready.size() && ms.tau_ready[k]) {
        tau += ms.tau[k];
        ++n_tau;
      }
    }
    auto at = [&](const std::vector<int64_t>& v) { return static_cast<size_t>(il) < v.size() ? v[static_cast<size_t>(il)] : 0; };
    char tau_s[32] = "-", var_s[32] = "-", bud_s[32] = "-";
    if (n_tau) std::snprintf(tau_s, sizeof tau_s, "%.4f", tau / n_tau);
    if (static_cast<size_t>(il) < cs.layer_variance.size())
      std::snprintf(var_s, sizeof var_s, "%.3g", cs.layer_variance[static_cast<size_t>(il)]);
    if (has_budget) {
      const int b = st.budgets[static_cast<size_t>(il)];
      std::snprintf(bud_s, sizeof bud_s, "%s",
                    b != PolicyState::kNoBudget ? std::to_string(b).c_str() : w > 0 ? "window" : "all");
    }
    if (w > 0) std::snprintf(var_s, sizeof var_s, "-");
    std::fprintf(out, "%5d %-10s %8s %8s %9lld %9lld %8s %10s\n", il, kind_s, bud_s, slot_s,
                 static_cast<long long>(at(st.evicted)), static_cast<long long>(at(st.merged)),
                 tau_s, var_s);
  }
  const KvBytesShares b = kv_bytes_shares(c, seq.n_past());
  std::fprintf(out, "total: %lld slots per KV head over %d layers (full cache: %lld)\n",
               static_cast<long long>(tot_slots), c.n_layer(), static_cast<long long>(full_slots));
  std::fprintf(out,
               "KV bytes (keys and values, %s): %s in the slots attention reads = %.1f%% of a full "
               "%s cache (%s), %.1f%% of a full F16 cache (%s) for %lld tokens\n",
               kv_type_name(c.config().type), format_bytes(b.needed).c_str(),
               b.full_same > 0 ? 100.0 * b.needed / b.full_same : 0.0,
               kv_type_name(c.config().type), format_bytes(b.full_same).c_str(),
               b.full_f16 > 0 ? 100.0 * b.needed / b.full_f16 : 0.0,
               format_bytes(b.full_f16).c_str(), static_cast<long long>(seq.n_past()));
  std::fprintf(out, "KV bytes allocated: %s (capacity: room to grow%s)\n",
               format_bytes(b.allocated).c_str(),
               c.config().has_sliding()
                   ? ", and sliding-window layers that hold up to 64 slots past their window "
                     "before dropping them in a batch"
                   : "");
  bool ragged = false;
  for (int il = 0; il < c.n_layer(); ++il) ragged = ragged || !c.layer(il).uniform();
  if (ragged) {
    // The [head, capacity] layout pads every head to the layer's largest (heads=ada).
    std::fprintf(
        out, "(KV bytes held by slots: %s; the rest is capacity, heads padded to the largest)\n",
        format_bytes(static_cast<double>(c.kv_bytes_used())).c_str());
  }
  if (const ColdTier* cold = c.cold()) {
    const double whole = static_cast<double>(c.bytes_held());
    std::fprintf(out,
                 "cold tier (%s, %s): %lld slots over all KV heads and layers, %s of rows "
                 "and %s of metadata in memory; %lld turns recalled %lld slots in %.3f s. In "
                 "memory in all (hot, cold, metadata): %s = %.1f%% of a full F16 cache's key and "
                 "value bytes\n",
                 kv_type_name(cold->config().type),
                 cold->config().place == ColdPlace::kDisk
                     ? ("on disk, " + format_bytes(static_cast<double>(cold->disk_bytes())) +
                        " in its file")
                           .c_str()
                     : "in memory",
                 static_cast<long long>(cold->total_slots()),
                 format_bytes(static_cast<double>(cold->rows_bytes())).c_str(),
                 format_bytes(static_cast<double>(cold->meta_bytes())).c_str(),
                 static_cast<long long>(cold->recall_turns()),
                 static_cast<long long>(cold->recalled_slots()), cold->recall_seconds(),
                 format_bytes(whole).c_str(), b.full_f16 > 0 ? 100.0 * whole / b.full_f16 : 0.0);
  }
  print_bytes_held(out, seq, b);
}

}  // namespace d2o::cli
