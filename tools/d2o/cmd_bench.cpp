// d2o bench: llama-bench-style throughput figures (see src/eval/bench.h): pp N and tg N at
// context depths, for one or more KV policies, as a Markdown table (stdout) and optionally JSON.
// `d2o bench throughput` (cmd_bench_throughput.cpp) is the batched-serving benchmark instead.
//
//   d2o bench -p 512 -n 128 -d 0,8192 --kv full --kv d2o:ratio=0.2 -r 3 -t 2 --json out.json
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "commands.h"
#include "common.h"
#include "core/cpu.h"
#include "core/mem.h"
#include "core/timer.h"
#include "eval/bench.h"
#include "eval/harness.h"
#include "eval/stats.h"
#include "model/layer_desc.h"
#include "runtime/kv_pool.h"

namespace d2o::cli {

namespace {

struct BenchOptions {
  ModelOptions model;
  std::string n_prompt = "512";
  std::string n_gen = "128";
  std::string depths = "0";
  std::vector<std::string> kv_specs;
  int repetitions = 5;
  std::string text_file;
  std::string json_file;
  bool mem_bw = false;
  bool interleave = false;
  std::string kv_mem_per_seq;  // "": each --kv as given
  int chunk = -1;              // depth prefill pass; -1: not given
};

// Reads the text and tokenises as much of it as the tests need (whole lines, so no character is
// cut): tokenising all of a multi-megabyte file would take longer than the benchmark.
Result<std::vector<TokenId>> load_text_tokens(const Tokenizer& tok, const std::string& path,
                                              int64_t need) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return io_error("cannot read the text file '" + path +
                    "' (give one with -f FILE, or run scripts/setup.sh to fetch the default text)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  EncodeOptions enc;
  enc.add_special = true;
  size_t bytes = static_cast<size_t>(std::max<int64_t>(need, 1)) * 6 + 4096;
  for (;;) {
    size_t cut = text.size();
    if (bytes < text.size()) {
      cut = text.find('\n', bytes);
      cut = cut == std::string::npos ? text.size() : cut + 1;
    }
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> ids,
                         tok.encode(std::string_view(text).substr(0, cut), enc));
    if (static_cast<int64_t>(ids.size()) >= need || cut == text.size()) return ids;
    bytes *= 2;
  }
}

std::string basename_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

int run_mem_bw(const BenchOptions& o) {
  ThreadPool pool(o.model.threads);
  auto bw = measure_read_bandwidth(pool, size_t{1} << 30, 5);
  if (!bw.ok()) return fail(bw.status());
  std::printf("memory read bandwidth: %.1f GB/s (%d threads, best of 5 sweeps over 1 GiB)\n",
              *bw / 1e9, pool.n_threads());
  if (!o.json_file.empty()) {
    nlohmann::json doc;
    doc["program"] = "d2o bench --mem-bw";
    doc["threads"] = pool.n_threads();
    doc["read_bandwidth_bytes_per_s"] = *bw;
    doc["cpu"] = cpu_description();
    std::ofstream out(o.json_file, std::ios::binary);
    out << doc.dump(2) << "\n";
    if (!out) return fail(io_error("cannot write '" + o.json_file + "'"));
  }
  return 0;
}

int run_bench_cmd(BenchOptions& o) {
  if (o.mem_bw) return run_mem_bw(o);
  auto pp = parse_int_list(o.n_prompt, "-p", 0, 1 << 20);
  if (!pp.ok()) return fail(pp.status());
  auto tg = parse_int_list(o.n_gen, "-n", 0, 1 << 20);
  if (!tg.ok()) return fail(tg.status());
  auto depths = parse_int_list(o.depths, "-d", 0, 1 << 24);
  if (!depths.ok()) return fail(depths.status());
  if (o.kv_specs.empty()) o.kv_specs.push_back("full");
  for (const std::string& s : o.kv_specs) {
    auto p = parse_kv_policy(s);
    if (!p.ok()) return fail(p.status().with_context("--kv"));
  }
  if (!o.kv_mem_per_seq.empty()) {
    auto cap = parse_byte_size(o.kv_mem_per_seq);
    if (!cap.ok()) return fail(cap.status().with_context("--kv-mem-per-seq"));
  }
  const std::vector<BenchTest> tests = make_bench_tests(*pp, *tg, *depths);
  BenchConfig cfg;
  cfg.repetitions = o.repetitions;
  cfg.n_ctx = o.model.n_ctx;
  // The depth goes in passes of --chunk (with --kv-mem-per-seq 512 unless given, as `run` feeds
  // a prompt); otherwise in one pass.
  cfg.depth_chunk = o.chunk >= 0 ? o.chunk : o.kv_mem_per_seq.empty() ? 0 : 512;
  int64_t need = 0;
  for (const BenchTest& t : tests) need = std::max<int64_t>(need, int64_t{t.depth} + t.n);
  // Everything that does not need the model is checked before loading it.
  if (Status s = validate_bench_tests(tests, need, cfg); !s.ok()) return fail(s);
  auto kv_type = parse_kv_type(o.model.kv_type);
  if (!kv_type.ok()) return fail(kv_type.status());
  cfg.kv_type = *kv_type;

  ModelOptions mo = o.model;
  mo.kv_spec = "full";  // policies are handled here, one per --kv
  auto loaded = load_all(mo);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;
  // Each --kv, with --kv-mem-per-seq at the budget of the slots that fit it in the storage type
  // (the full cache runs whole: the reference).
  std::vector<std::shared_ptr<const KvPolicy>> policies;
  for (const std::string& s : o.kv_specs) {
    std::string spec = s;
    if (!o.kv_mem_per_seq.empty()) {
      int slots = 0;
      auto sp =
          spec_for_kv_mem(s, o.kv_mem_per_seq, kv_cache_config(l.model->hparams(), cfg.kv_type),
                          l.model->hparams().n_ctx_train, &slots);
      if (!sp.ok()) return fail(sp.status());
      spec = *sp;
      std::fprintf(stderr, "d2o bench: --kv-mem-per-seq %s: %s %s\n", o.kv_mem_per_seq.c_str(),
                   s.c_str(),
                   spec == s ? "runs whole (the reference)"
                             : ("at budget=" + std::to_string(slots)).c_str());
    }
    auto p = parse_kv_policy(spec);
    if (!p.ok()) return fail(p.status().with_context("--kv"));
    policies.emplace_back(std::move(p).value());
  }
  const std::string text_path = o.text_file.empty() ? default_text_path() : o.text_file;
  Stopwatch sw;
  auto ids = load_text_tokens(*l.tokenizer, text_path, need);
  if (!ids.ok()) return fail(ids.status());
  if (Status s = validate_bench_tests(tests, static_cast<int64_t>(ids->size()), cfg); !s.ok()) {
    return fail(s.with_context(text_path));
  }
  const int trained = l.model->hparams().n_ctx_train;
  if (need > trained) {
    std::fprintf(
        stderr,
        "d2o bench: note: tests reach %lld tokens, beyond the model's trained context of %d\n",
        static_cast<long long>(need), trained);
  }
  std::fprintf(stderr,
               "d2o bench: %s, %d threads, %s KV, text %s (%zu tokens, %.1f s to tokenise)\n",
               basename_of(l.model->path()).c_str(), l.pool->n_threads(), kv_type_name(cfg.kv_type),
               basename_of(text_path).c_str(), ids->size(), sw.seconds());

  // Warm-up (as llama-bench): a short pass and one decode step, untimed, so that the first
  // measurement does not pay for first-touch page faults and thread start-up.
  {
    Sequence warm(l.model->hparams(), cfg.kv_type, nullptr);
    BatchEntry be;
    be.seq = &warm;
    be.tokens = std::span<const TokenId>(*ids).first(std::min<size_t>(ids->size(), 32));
    if (Status s = l.engine->forward({&be, 1}, {}); !s.ok()) return fail(s);
    be.tokens = be.tokens.first(1);
    if (Status s = l.engine->forward({&be, 1}, {}); !s.ok()) return fail(s);
  }

  const std::string model_name = basename_of(l.model->path());
  const std::string size = format_bytes(static_cast<double>(l.model->weight_bytes()));
  std::printf(
      "| model | size | threads | kv type | kv | test | t/s | KV MiB (full) | peak RSS MiB |\n");
  std::printf("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |\n");
  std::fflush(stdout);
  nlohmann::json results = nlohmann::json::array();
  // Every result, in the order they came, with its policy's index (for the paired ratios).
  std::vector<std::pair<size_t, BenchResult>> all;
  auto on_result = [&](size_t ip, const BenchResult& r) {
    const std::string& shown = o.kv_specs[ip];  // as the user wrote it; JSON has the canonical spec
    std::printf("| %s | %s | %d | %s | %s | %s | %.2f ± %.2f | %s (%s) | %s |\n",
                model_name.c_str(), size.c_str(), l.pool->n_threads(), kv_type_name(cfg.kv_type),
                shown.c_str(), r.test.name().c_str(), r.tps_mean, r.tps_stddev,
                mib(r.kv_bytes).c_str(), mib(r.kv_bytes_full).c_str(),
                r.peak_rss ? mib(r.peak_rss).c_str() : "?");
    std::fflush(stdout);
    nlohmann::json j;
    j["kv"] = shown;
    j["kv_canonical"] = r.kv_spec;
    j["test"] = r.test.name();
    j["kind"] = r.test.kind == BenchKind::kPrompt ? "pp" : "tg";
    j["n"] = r.test.n;
    j["depth"] = r.test.depth;
    j["samples_s"] = r.seconds;
    std::vector<double> tps;
    for (const double x : r.seconds) tps.push_back(r.test.n / std::max(x, 1e-12));
    j["samples_ts"] = tps;
    j["avg_ts"] = r.tps_mean;
    j["stddev_ts"] = r.tps_stddev;
    j["depth_prefill_s"] = r.depth_seconds;
    j["slots_after_depth"] = r.slots_after_depth;
    j["slots"] = r.slots;
    j["kv_bytes"] = r.kv_bytes;
    j["kv_bytes_used"] = r.kv_bytes_used;
    j["kv_bytes_full"] = r.kv_bytes_full;
    j["peak_rss_bytes"] = r.peak_rss;
    j["engine_s"] = eval::timings_json(r.timings);
    results.push_back(std::move(j));
    all.emplace_back(ip, r);
  };
  if (o.interleave) {
    Status s = run_bench_interleaved(*l.engine, *ids, tests, policies, cfg, on_result);
    if (!s.ok()) return fail(s);
  } else {
    for (size_t ip = 0; ip < policies.size(); ++ip) {
      Status s = run_bench(*l.engine, *ids, tests, policies[ip], cfg,
                           [&](const BenchResult& r) { on_result(ip, r); });
      if (!s.ok()) return fail(s);
    }
  }

  // Rates over the first --kv's, per test. Interleaved: paired by round (mean ± standard error of
  // the per-round ratios); else the ratio of the means (runs at different times: no error given).
  nlohmann::json ratios = nlohmann::json::array();
  if (policies.size() > 1) {
    std::printf("\n| kv | test | t/s over %s | engine s: matmul / attention / policy / other |\n",
                o.kv_specs[0].c_str());
    std::printf("| --- | ---: | ---: | --- |\n");
    for (const auto& [ip, r] : all) {
      const BenchResult* base = nullptr;
      for (const auto& [jp, b] : all)
        if (jp == 0 && b.test.name() == r.test.name()) base = &b;
      char cell[64] = "-";
      nlohmann::json jr;
      jr["kv"] = o.kv_specs[ip];
      jr["test"] = r.test.name();
      if (base != nullptr && base->tps_mean > 0) {
        if (o.interleave) {
          const std::vector<double> x = paired_ratios(r, *base);
          const eval::MeanSe ms = eval::mean_se(x);
          std::snprintf(cell, sizeof cell, "%.3f ± %.3f", ms.mean, ms.se);
          jr["paired"] = true;
          jr["ratio"] = ms.mean;
          jr["ratio_se"] = ms.se;
          jr["ratio_samples"] = x;
        } else {
          std::snprintf(cell, sizeof cell, "%.3f", r.tps_mean / base->tps_mean);
          jr["paired"] = false;
          jr["ratio"] = r.tps_mean / base->tps_mean;
        }
      }
      std::printf("| %s | %s | %s | %.2f / %.2f / %.2f / %.2f |\n", o.kv_specs[ip].c_str(),
                  r.test.name().c_str(), cell, r.timings.matmul_s, r.timings.attention_s,
                  r.timings.policy_s, r.timings.other_s);
      ratios.push_back(std::move(jr));
    }
    std::printf(o.interleave
                    ? "(interleaved: each ratio is the mean ± standard error of the per-round "
                      "ratios; engine seconds summed over the repetitions)\n"
                    : "(run one policy after another: the ratio of mean rates, which a change of "
                      "the machine's speed between policies also moves; --interleave pairs them "
                      "by round)\n");
  }

  if (!o.json_file.empty()) {
    nlohmann::json doc;
    doc["program"] = "d2o bench";
    doc["model"] = l.model->path();
    doc["model_bytes"] = l.model->weight_bytes();
    {
      const ModelHParams& hp = l.model->hparams();
      doc["n_layer"] = hp.n_layer;
      doc["n_head_kv"] = hp.n_head_kv;
      doc["head_dim"] = hp.head_dim;
      // K and V bytes one token adds to a full cache of this storage type (all layers).
      doc["kv_bytes_per_token"] = KvCache(kv_cache_config(hp, cfg.kv_type)).full_kv_bytes(1);
    }
    doc["threads"] = l.pool->n_threads();
    doc["kv_type"] = kv_type_name(cfg.kv_type);
    doc["repetitions"] = cfg.repetitions;
    doc["text"] = text_path;
    doc["cpu"] = cpu_description();
    doc["interleaved"] = o.interleave;
    doc["results"] = std::move(results);
    doc["ratios"] = std::move(ratios);
    std::ofstream out(o.json_file, std::ios::binary);
    out << doc.dump(2) << "\n";
    if (!out) return fail(io_error("cannot write '" + o.json_file + "'"));
  }
  return 0;
}

}  // namespace

Action add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench",
      "Throughput in the manner of llama-bench: pp N and tg N after d tokens of context, per KV "
      "policy (or `bench throughput`: many requests under a KV memory cap)");
  sub->require_subcommand(0, 1);
  Action throughput = add_bench_throughput_command(*sub);
  CLI::App* throughput_app = sub->get_subcommands({}).back();
  add_model_options(sub, o->model, /*with_kv=*/false);
  sub->add_option("-p,--n-prompt", o->n_prompt,
                  "Prompt sizes to time, e.g. 512 or 128,512 (0: none)");
  sub->add_option("-n,--n-gen", o->n_gen, "Generation lengths to time, e.g. 128 (0: none)");
  sub->add_option("-d,--n-depth", o->depths,
                  "Context depths: tokens of text prefilled (untimed, compressed by the policy) "
                  "first, e.g. 0,2048,8192");
  sub->add_option("-r,--repetitions", o->repetitions, "Repetitions of each test (mean ± stddev)");
  sub->add_option("--kv", o->kv_specs,
                  "KV policy spec (repeatable), e.g. --kv full --kv d2o:ratio=0.2 (default: full)");
  sub->add_option("--kv-mem-per-seq", o->kv_mem_per_seq,
                  "KV memory of the sequence, e.g. 20M (powers of 1024): each --kv policy's "
                  "budget is the slots that fit with --kv-type, as in `run` (give the policies "
                  "without ratio= / budget=; the full cache runs whole, as the reference), and "
                  "the depth is prefilled in passes of --chunk");
  sub->add_option("--chunk", o->chunk,
                  "Tokens per pass of the depth prefill (a fixed budget and prefill=bounded "
                  "compact between them; default 0, one pass, or 512 with --kv-mem-per-seq)")
      ->check(CLI::Range(0, 1 << 24));
  sub->add_option("-f,--file", o->text_file,
                  "Text for the depth and the prompts (default: the KJV text from setup)");
  sub->add_option("--json", o->json_file, "Also write the results as JSON to this file");
  sub->add_flag("--interleave", o->interleave,
                "Interleave the --kv policies: each repetition is a round of one run per policy "
                "(order reversed every other round), so that ratios between policies are paired "
                "by round and a drift of the machine's speed falls on all alike (peak RSS is not "
                "measured then)");
  sub->add_flag(
      "--mem-bw", o->mem_bw,
      "Only measure the memory read bandwidth with -t threads (the limit decoding runs against)");
  return [o, throughput, throughput_app] {
    return throughput_app->parsed() ? throughput() : run_bench_cmd(*o);
  };
}

}  // namespace d2o::cli
