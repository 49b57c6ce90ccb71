// d2o eval: what each KV policy keeps of the model's quality at a fraction of the cache.
//
//   d2o eval ppl       perplexity with a fixed-capacity cache (the paper's PG-19 protocol)
//   d2o eval fidelity  next-token distributions vs the full cache after prompt-then-compress
//                      (cmd_eval_fidelity.cpp)
//   d2o eval niah      needle / passkey retrieval over a grid of lengths and depths
//   d2o eval ruler     RULER-style synthetic tasks, many trials per task and length
//   d2o eval ablate    D2O's ablations, measured with the fidelity protocol
//
// Every run writes <out>/<name>.json, <out>/<name>.md and SVG charts, shows a progress bar with
// an ETA on stderr, and records the model, text, policies, budgets, seed and wall time.
#include "cmd_eval.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "core/timer.h"
#include "eval/fidelity.h"
#include "eval/stats.h"
#include "eval/stream_ppl.h"
#include "eval/turns.h"
#include "model/layer_desc.h"
#include "ops/kernel_isa.h"

#ifndef D2O_DEFAULT_CACHE_DIR
#define D2O_DEFAULT_CACHE_DIR "cache"
#endif

namespace d2o::cli {

std::string default_cache_dir() {
  if (const char* c = std::getenv("D2O_CACHE_DIR"); c && *c) return c;
  return D2O_DEFAULT_CACHE_DIR;
}

void add_teacher_forced_options(CLI::App* app, TeacherForcedOptions& o,
                                const std::string& samples_help) {
  app->add_option("--prompt", o.prompt, "Prompt length P in tokens")->check(CLI::Range(1, 1 << 24));
  app->add_option("--samples", o.samples, samples_help)->check(CLI::Range(1, 1 << 20));
  app->add_option("--continue", o.cont, "Teacher-forced continuation tokens per sample")
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--skip", o.skip, "Tokens of the text to skip first")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
}

void shrink_for_quick(TeacherForcedOptions& o) {
  o.prompt = std::min(o.prompt, 256);
  o.samples = std::min(o.samples, 2);
  o.cont = std::min(o.cont, 16);
}

std::string teacher_forced_args(const TeacherForcedOptions& o) {
  return " --prompt " + std::to_string(o.prompt) + " --samples " + std::to_string(o.samples) +
         " --continue " + std::to_string(o.cont) +
         (o.skip ? " --skip " + std::to_string(o.skip) : "");
}

Result<std::span<const TokenId>> tokens_after_skip(const std::vector<TokenId>& tokens,
                                                   int64_t skip) {
  if (skip < 0 || skip >= static_cast<int64_t>(tokens.size())) {
    return invalid_argument("--skip " + std::to_string(skip) + " is outside the text's " +
                            std::to_string(tokens.size()) + " tokens");
  }
  return std::span<const TokenId>(tokens.data() + skip, tokens.size() - static_cast<size_t>(skip));
}

const std::vector<std::string>& all_policy_presets() {
  // Every preset once (the default of --policies), d2o (its defaults) last.
  static const std::vector<std::string> kAll = {
      "full", "streaming", "h2o", "snapkv", "pyramidkv", "roco", "cam", "keydiff", "d2o"};
  return kAll;
}

void add_eval_common_options(CLI::App* app, EvalCommonOptions& o, const std::string& text_help) {
  add_model_options(app, o.model, /*with_kv=*/false);
  app->add_option("-f,--file", o.text, text_help);
  app->add_option("-o,--out", o.out_dir, "Output directory for the report (JSON, Markdown, SVG)");
  app->add_option("--name", o.name, "File name stem of the report (default: the protocol name)");
  app->add_option(
      "--policies", o.policies,
      "Policies to compare, ';'-separated base specs (e.g. \"full;h2o;d2o:heavy_recent=1:1\"); "
      "the protocol adds ratio= or budget= itself");
  app->add_option("--seed", o.seed,
                  "Seed for everything random in the protocol (same seed, same numbers)");
  app->add_flag("--quick", o.quick, "A small grid that runs in a few minutes (smoke test)");
  app->add_flag("--quiet", o.quiet, "No progress bar");
}

std::vector<std::string> eval_policies(const EvalCommonOptions& o,
                                       const std::vector<std::string>& defaults) {
  if (o.policies.empty()) return defaults;
  return eval::split_list(o.policies, ';');
}

Result<std::vector<int>> parse_int_list(const std::string& s, const std::string& option) {
  std::vector<int> out;
  for (const std::string& item : eval::split_list(s, ',')) {
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || used == 0 || v < -(1l << 30) || v > (1l << 30)) {
      return invalid_argument(option + ": '" + item + "' is not an integer");
    }
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) return invalid_argument(option + ": no values given");
  return out;
}

Result<std::vector<double>> parse_double_list(const std::string& s, const std::string& option) {
  std::vector<double> out;
  for (const std::string& item : eval::split_list(s, ',')) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || used == 0)
      return invalid_argument(option + ": '" + item + "' is not a number");
    out.push_back(v);
  }
  if (out.empty()) return invalid_argument(option + ": no values given");
  return out;
}

std::unique_ptr<eval::Progress> make_progress(const EvalCommonOptions& o, const std::string& label,
                                              double total) {
  return std::make_unique<eval::Progress>(label, total, o.quiet ? nullptr : stderr);
}

void print_report_paths(const eval::ReportFiles& f) {
  std::printf("report: %s, %s (charts: %s/%s_*.svg)\n", f.path(".md").c_str(),
              f.path(".json").c_str(), f.dir.c_str(), f.name.c_str());
}

Result<EvalSetup> eval_setup(const EvalCommonOptions& o, const std::string& text_path,
                             const std::string& command) {
  EvalSetup s;
  // Read the text before loading the model: a wrong path fails fast.
  if (!text_path.empty()) {
    D2O_ASSIGN_OR_RETURN(s.text, eval::read_text_file(text_path));
  }
  auto loaded = load_all(o.model);
  if (!loaded.ok()) return loaded.status();
  s.loaded = std::move(loaded).value();
  const ModelHParams& hp = s.loaded.model->hparams();
  eval::RunMeta& m = s.meta;
  m.command = command;
  m.model_path = s.loaded.model->path();
  m.model_name = std::filesystem::path(m.model_path).filename().string();
  m.n_layer = hp.n_layer;
  m.n_head = hp.n_head;
  m.n_head_kv = hp.n_head_kv;
  m.head_dim = hp.head_dim;
  m.n_ctx_train = hp.n_ctx_train;
  m.kv_type = kv_type_name(s.loaded.kv_type);
  m.threads = s.loaded.pool->n_threads();
  m.kernels = kernel_isa_name(best_kernel_isa());
  m.seed = o.seed;
  m.quick = o.quick;
  if (!text_path.empty()) {
    m.text_path = text_path;
    m.text_name = std::filesystem::path(text_path).stem().string();
    m.text_bytes = s.text.size();
    m.text_hash = eval::fnv1a64_hex(s.text);
    EncodeOptions enc;
    enc.add_special = true;
    Stopwatch sw;
    D2O_ASSIGN_OR_RETURN(s.tokens, s.loaded.tokenizer->encode(s.text, enc));
    m.text_tokens = static_cast<int64_t>(s.tokens.size());
    if (!o.quiet) {
      std::fprintf(stderr, "text %s: %zu bytes, %zu tokens (tokenized in %.1f s)\n",
                   text_path.c_str(), s.text.size(), s.tokens.size(), sw.seconds());
    }
  }
  return s;
}

void note_haystack(const HaystackChoice& hay, eval::RunMeta& meta) {
  meta.text_path = hay.path;
  meta.text_name = hay.name;
  meta.text_bytes = hay.text.size();
  meta.text_hash = eval::fnv1a64_hex(hay.text);
  if (!hay.note.empty())
    std::fprintf(stderr, "haystack: %s, %s\n", hay.name.c_str(), hay.note.c_str());
}

Result<HaystackChoice> load_haystack(const std::string& given) {
  namespace fs = std::filesystem;
  HaystackChoice h;
  std::string path = given;
  if (path.empty()) {
    const std::string pg = default_cache_dir() + "/texts/pg";
    std::error_code ec;
    if (fs::is_directory(pg, ec)) {
      path = pg;
    } else {
      path = default_text_path();
      h.note =
          "fallback: the Paul Graham essays were not found in " + pg + " (run scripts/setup.sh)";
    }
  }
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
    }
    if (ec) return io_error("cannot list the haystack directory '" + path + "': " + ec.message());
    if (files.empty()) return not_found("the haystack directory '" + path + "' has no .txt files");
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      D2O_ASSIGN_OR_RETURN(std::string t, eval::read_text_file(f));
      h.text += t + "\n\n";
    }
    h.name = fs::path(path).filename() == "pg"
                 ? "Paul Graham essays (" + std::to_string(files.size()) + " files)"
                 : path + " (" + std::to_string(files.size()) + " files)";
  } else {
    D2O_ASSIGN_OR_RETURN(h.text, eval::read_text_file(path));
    h.name = fs::path(path).filename().string();
    if (path == default_text_path()) h.name = "King James Bible (kjv.txt)";
  }
  h.path = path;
  return h;
}

namespace {

// ---- ppl ---------------------------------------------------------------------------------------

struct EvalPplOptions {
  EvalCommonOptions common;
  std::string capacities = "256,1024";
  int64_t tokens = 0;  // 0: the whole text (quick: 600)
  int64_t skip = 0;
  int chunk = 1;
};

int run_ppl(EvalPplOptions& o) {
  const std::string text_path = o.common.text.empty() ? default_text_path() : o.common.text;
  auto caps = parse_int_list(o.capacities, "--capacities");
  if (!caps.ok()) return fail(caps.status());
  if (o.common.quick && o.tokens == 0) o.tokens = 600;
  auto setup = eval_setup(o.common, text_path, "d2o eval ppl");
  if (!setup.ok()) return fail(setup.status());
  EvalSetup& s = *setup;
  const ModelHParams& hp = s.loaded.model->hparams();
  auto skipped = tokens_after_skip(s.tokens, o.skip);
  if (!skipped.ok()) return fail(skipped.status());
  const std::span<const TokenId> toks = *skipped;
  eval::StreamPplParams p;
  p.policies = eval_policies(o.common, all_policy_presets());
  p.capacities = *caps;
  p.n_tokens = o.tokens > 0 ? o.tokens : static_cast<int64_t>(toks.size());
  p.chunk = o.chunk;
  p.kv_type = s.loaded.kv_type;
  p.n_ctx_train = hp.n_ctx_train;
  s.meta.command += " --capacities " + o.capacities + " --tokens " + std::to_string(p.n_tokens) +
                    " --chunk " + std::to_string(p.chunk) +
                    (o.skip ? " --skip " + std::to_string(o.skip) : "");
  Stopwatch sw;
  auto bar = make_progress(o.common, "eval ppl", static_cast<double>(p.n_tokens));
  auto res = eval::run_stream_ppl(*s.loaded.engine, toks, p, bar.get());
  if (!res.ok()) return fail(res.status());
  bar->finish();
  for (const std::string& w : res->warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  s.meta.wall_seconds = sw.seconds();
  const eval::ReportFiles files{o.common.out_dir, o.common.name.empty() ? "ppl" : o.common.name};
  if (Status st = eval::write_stream_ppl_report(*res, p, s.meta, files); !st.ok()) return fail(st);
  // A short summary on stdout.
  const eval::StreamPplRun* full = nullptr;
  for (const auto& r : res->runs) {
    if (r.capacity == 0) full = &r;
  }
  for (const auto& r : res->runs) {
    const eval::StreamPplSummary sm = eval::summarize_run(r, full, eval::kNllBlock);
    std::printf("%-12s cap %5d  PPL %8.3f  mean NLL %.4f ± %.4f", r.label.c_str(), r.capacity,
                sm.ppl, sm.mean_nll, sm.se_nll);
    // The tail's difference is against the full cache's run: none without it in the list.
    if (full) {
      std::printf("  tail Δ %+.4f ± %.4f\n", sm.delta_nll, sm.delta_se);
    } else {
      std::printf("  tail Δ - (no full cache in --policies)\n");
    }
  }
  print_report_paths(files);
  return 0;
}

}  // namespace

void add_prefill_options(CLI::App* app, PrefillOptions& o, bool with_mem) {
  if (with_mem) {
    app->add_option("--kv-mem-per-seq", o.kv_mem_per_seq,
                    "KV memory of each sequence, e.g. 4M (powers of 1024): every policy's budget "
                    "is the slots that fit with --kv-type, as in `run`, and contexts are fed in "
                    "passes of --chunk (512 unless given); the full cache runs whole, as the "
                    "reference. Instead of --ratio / --budget");
  }
  app->add_option("--chunk", o.chunk,
                  "Prompt tokens per prefill pass, each policy fed its own passes (a fixed budget "
                  "and prefill=bounded compact between them; 0: one pass shared by all policies, "
                  "the default)")
      ->check(CLI::Range(0, 1 << 24));
}

int prefill_chunk_of(const PrefillOptions& o) {
  if (o.chunk >= 0) return o.chunk;
  return o.kv_mem_per_seq.empty() ? 0 : 512;
}

std::string prefill_args(const PrefillOptions& o) {
  std::string s;
  if (!o.kv_mem_per_seq.empty()) s += " --kv-mem-per-seq " + o.kv_mem_per_seq;
  if (o.chunk >= 0) s += " --chunk " + std::to_string(o.chunk);
  return s;
}

Result<std::vector<eval::PolicyUnderTest>> policies_with_compression(
    const std::vector<std::string>& bases, const std::string& compression, const PrefillOptions& o,
    const ModelHParams& hp, KvType type) {
  std::vector<eval::PolicyUnderTest> out;
  for (const std::string& base : bases) {
    std::string spec = base;
    if (eval::spec_preset(base) != "full") {
      if (!o.kv_mem_per_seq.empty()) {
        int slots = 0;
        D2O_ASSIGN_OR_RETURN(
            spec, spec_for_kv_mem(base, o.kv_mem_per_seq, kv_cache_config(hp, type), hp.n_ctx_train,
                                  &slots));
      } else if (!eval::spec_has_compression(base)) {
        D2O_ASSIGN_OR_RETURN(spec, eval::spec_with_compression(base, compression));
      }
    }
    D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest t, eval::make_policy(spec, base));
    out.push_back(std::move(t));
  }
  return out;
}

void add_question_options(CLI::App* app, std::string& question, int& questions,
                          const std::string& questions_help) {
  app->add_option("--question", question,
                  "before: the question is in the prompt that is compressed; after: the context "
                  "is compressed as a turn of its own, then the question comes as the next turn, "
                  "as in a server session (default before)");
  app->add_option("--questions", questions,
                  "Questions per context, each asked of a copy of the compressed context (needs "
                  "--question after; " +
                      questions_help + ")")
      ->check(CLI::Range(1, eval::kMaxQuestions));
}

Action add_eval_ppl(CLI::App* eval) {
  auto o = std::make_shared<EvalPplOptions>();
  CLI::App* sub = eval->add_subcommand(
      "ppl", "Perplexity with a fixed-capacity cache (the paper's PG-19 protocol)");
  add_eval_common_options(sub, o->common,
                          "Text file (default: the KJV text fetched by scripts/setup.sh)");
  sub->add_option("--capacities", o->capacities,
                  "Cache capacities in slots per KV head and layer (budget=B)");
  sub->add_option("--tokens", o->tokens,
                  "Tokens to feed (0 = the whole text; cut to stay in the trained context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  sub->add_option("--skip", o->skip, "Tokens of the text to skip first")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  sub->add_option("--chunk", o->chunk,
                  "Tokens per forward pass (1 = plain decoding, the paper's setting)");
  return [o] { return run_ppl(*o); };
}

Action add_eval_command(CLI::App& app) {
  CLI::App* ev = app.add_subcommand(
      "eval", "Evaluate KV policies: ppl, fidelity, niah, ruler, ablate (and summary)");
  ev->require_subcommand(1);
  std::vector<std::pair<CLI::App*, Action>> subs;
  auto keep = [&](Action a) { subs.emplace_back(ev->get_subcommands({}).back(), std::move(a)); };
  keep(add_eval_ppl(ev));
  keep(add_eval_fidelity(ev));
  keep(add_eval_niah(ev));
  keep(add_eval_ruler(ev));
  keep(add_eval_ablate(ev));
  keep(add_eval_summary(ev));
  return [subs] {
    for (const auto& [sub, action] : subs) {
      if (sub->parsed()) return action();
    }
    return 2;
  };
}

}  // namespace d2o::cli
