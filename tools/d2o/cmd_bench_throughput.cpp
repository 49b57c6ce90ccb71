// d2o bench throughput: many requests served at once under a KV memory cap, one run per KV
// policy, compared in one table (the paper's throughput experiment, scaled to this machine).
// Registered under `d2o bench` by cmd_bench.cpp (which itself runs the llama-bench-style pp/tg
// figures when no sub-subcommand is given).
//
// Every request has the same prompt length (P tokens of a real text, from a different offset per
// request) and generates exactly G tokens (greedy, end-of-generation tokens ignored unless
// --stop-at-eos), so the policies do the same work and differ only in how many sequences their
// caches let the scheduler run at once under the cap, and in attention cost.
//
// --rounds N repeats the policy list N times, in the given order on even rounds and in reverse on
// odd ones, so that a drift of the machine's speed falls on every policy alike; each policy's
// generated tokens/s and policy (compaction) seconds are then compared with the first policy's
// round by round, as the mean and standard error of the per-round ratios.
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "common.h"
#include "core/mem.h"
#include "core/timer.h"
#include "eval/harness.h"
#include "eval/stats.h"
#include "model/layer_desc.h"
#include "runtime/scheduler.h"

namespace d2o::cli {

namespace {

struct ThroughputOptions {
  ModelOptions model;
  SamplerParams sampling;
  int prompt = 512;
  int gen = 128;
  int requests = 8;
  std::string kv_mem = "1G";
  std::string kv_mem_per_seq;  // "": the --kv specs as given
  std::vector<std::string> kv;
  int chunk = 256;
  int max_batch = 64;
  std::string text;
  std::string json;
  std::string attn_split = "auto";
  bool stop_at_eos = false;
  int rounds = 1;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx)), hi = static_cast<size_t>(std::ceil(idx));
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

// P tokens of the text from a different place for each request: request r starts at the first
// line after byte r * size / R.
Result<std::vector<std::vector<TokenId>>> make_prompts(const Tokenizer& tok,
                                                       const std::string& text, int n, int len) {
  std::vector<std::vector<TokenId>> out;
  EncodeOptions enc;
  enc.add_special = false;
  for (int r = 0; r < n; ++r) {
    size_t at = text.size() / static_cast<size_t>(n) * static_cast<size_t>(r);
    at = text.find('\n', at);
    at = at == std::string::npos ? 0 : at + 1;
    const bool bos = tok.add_bos() && tok.bos() >= 0;
    std::vector<TokenId> ids;
    for (size_t bytes = static_cast<size_t>(len) * 8; static_cast<int>(ids.size()) < len;
         bytes *= 2) {
      if (bytes > text.size()) {
        return invalid_argument("the text is too short for prompts of " + std::to_string(len) +
                                " tokens");
      }
      const size_t start = std::min(at, text.size() - bytes);
      auto piece = tok.encode(std::string_view(text).substr(start, bytes), enc);
      if (!piece.ok()) return piece.status();
      ids.clear();
      if (bos) ids.push_back(tok.bos());
      ids.insert(ids.end(), piece->begin(), piece->end());
    }
    ids.resize(static_cast<size_t>(len));
    out.push_back(std::move(ids));
  }
  return out;
}

struct PolicyRun {
  int policy = 0, round = 0;  // index into the --kv list; round (--rounds)
  std::string spec;           // as given
  std::string canonical;      // the policy's canonical spec
  int completed = 0, refused = 0, failed = 0;
  std::string refusal;
  int64_t gen_tokens = 0;
  double seconds = 0;
  int steps = 0, batch_max = 0, decode_max = 0;
  double batch_mean = 0, decode_mean = 0;
  std::vector<double> token_lat, req_lat, ttft;
  size_t kv_per_request = 0, kv_peak_reserved = 0, kv_peak_allocated = 0;
  int64_t slot_limit = 0;
  size_t rss_before = 0, rss_peak = 0;
  EngineTimings timings;
};

Result<PolicyRun> run_policy(Loaded& l, const ThroughputOptions& o, const std::string& spec,
                             const std::vector<std::vector<TokenId>>& prompts, size_t cap) {
  PolicyRun run;
  run.spec = spec;
  SchedulerParams sp;
  sp.kv_mem_bytes = cap;
  sp.prefill_chunk = o.chunk;
  sp.max_running = o.max_batch;
  sp.kv_type = l.kv_type;
  sp.max_positions = l.n_ctx;
  sp.eog_tokens = l.tokenizer->eog_tokens();
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> sched, Scheduler::create(*l.engine, sp));
  l.engine->reset_timings();
  reset_peak_rss();
  run.rss_before = current_rss_bytes();
  for (const auto& p : prompts) {
    Request req;
    req.prompt = p;
    req.max_new_tokens = o.gen;
    req.sampling = o.sampling;
    req.kv_spec = spec;
    req.stop_at_eog = o.stop_at_eos;
    auto id = sched->submit(std::move(req));
    if (!id.ok()) return id.status();
  }
  double batch_sum = 0, decode_sum = 0;
  int decode_steps = 0;
  Stopwatch sw;
  while (!sched->idle()) {
    D2O_RETURN_IF_ERROR(sched->step());
    const StepStats& st = sched->last_step();
    if (st.n_entries == 0) continue;
    ++run.steps;
    batch_sum += st.n_running;
    run.batch_max = std::max(run.batch_max, st.n_running);
    if (st.n_decode > 0) {
      ++decode_steps;
      decode_sum += st.n_decode;
      run.decode_max = std::max(run.decode_max, st.n_decode);
    }
    run.kv_peak_allocated = std::max(run.kv_peak_allocated, st.kv_allocated);
  }
  run.seconds = sw.seconds();
  run.rss_peak = peak_rss_bytes();
  run.timings = l.engine->timings();
  run.batch_mean = run.steps ? batch_sum / run.steps : 0;
  run.decode_mean = decode_steps ? decode_sum / decode_steps : 0;
  run.kv_peak_reserved = sched->pool().peak_reserved();
  for (const RequestResult& r : sched->take_finished()) {
    run.canonical = r.kv_spec;
    run.kv_per_request = r.kv_reserved ? r.kv_reserved : run.kv_per_request;
    run.slot_limit = r.kv_slot_limit;
    if (r.stop_reason == "refused") {
      ++run.refused;
      run.refusal = r.status.message();
      continue;
    }
    if (!r.status.ok()) {
      ++run.failed;
      run.refusal = r.status.message();
      continue;
    }
    ++run.completed;
    run.gen_tokens += static_cast<int64_t>(r.tokens.size());
    run.req_lat.push_back(r.t_end - r.t_submit);
    if (!r.tokens.empty()) run.ttft.push_back(r.t_first - r.t_submit);
    for (size_t i = 1; i < r.token_times.size(); ++i)
      run.token_lat.push_back(r.token_times[i] - r.token_times[i - 1]);
  }
  return run;
}

double tokens_per_s(const PolicyRun& r) {
  return r.seconds > 0 ? static_cast<double>(r.gen_tokens) / r.seconds : 0.0;
}

// Per round, policy p's value over the first policy's, for value(run) of tokens/s or policy
// seconds; rounds where the first policy's value is 0 are left out.
std::vector<double> per_round_ratios(const std::vector<PolicyRun>& runs, int p, int rounds,
                                     double (*value)(const PolicyRun&)) {
  std::vector<double> out;
  for (int k = 0; k < rounds; ++k) {
    const PolicyRun *a = nullptr, *base = nullptr;
    for (const PolicyRun& r : runs) {
      if (r.round != k) continue;
      if (r.policy == p) a = &r;
      if (r.policy == 0) base = &r;
    }
    if (a && base && value(*base) > 0) out.push_back(value(*a) / value(*base));
  }
  return out;
}

double policy_seconds(const PolicyRun& r) {
  return r.timings.policy_s;
}

nlohmann::json to_json(const PolicyRun& r) {
  nlohmann::json j;
  j["kv"] = r.spec;
  j["round"] = r.round;
  j["kv_canonical"] = r.canonical;
  j["completed"] = r.completed;
  j["refused"] = r.refused;
  j["failed"] = r.failed;
  if (!r.refusal.empty()) j["refusal"] = r.refusal;
  j["generated_tokens"] = r.gen_tokens;
  j["seconds"] = r.seconds;
  j["tokens_per_s"] = tokens_per_s(r);
  j["requests_per_s"] = r.seconds > 0 ? r.completed / r.seconds : 0.0;
  j["steps"] = r.steps;
  j["batch_max"] = r.batch_max;
  j["batch_mean"] = r.batch_mean;
  j["decode_rows_max"] = r.decode_max;
  j["decode_rows_mean"] = r.decode_mean;
  j["token_latency_ms"] = {{"p50", 1e3 * percentile(r.token_lat, 0.5)},
                           {"p95", 1e3 * percentile(r.token_lat, 0.95)}};
  j["request_latency_s"] = {{"p50", percentile(r.req_lat, 0.5)},
                            {"p95", percentile(r.req_lat, 0.95)}};
  j["first_token_s"] = {{"p50", percentile(r.ttft, 0.5)}, {"p95", percentile(r.ttft, 0.95)}};
  j["kv_bytes_per_request"] = r.kv_per_request;
  j["kv_slot_limit"] = r.slot_limit;
  j["kv_peak_reserved"] = r.kv_peak_reserved;
  j["kv_peak_allocated"] = r.kv_peak_allocated;
  j["rss_before"] = r.rss_before;
  j["rss_peak"] = r.rss_peak;
  j["time_split_s"] = eval::timings_json(r.timings);
  return j;
}

int run_throughput(ThroughputOptions& o) {
  if (o.prompt < 1) return fail(invalid_argument("--prompt must be at least 1 token"));
  if (o.gen < 1) return fail(invalid_argument("--gen must be at least 1 token"));
  if (o.requests < 1) return fail(invalid_argument("--requests must be at least 1"));
  if (o.chunk < 1) return fail(invalid_argument("--chunk must be at least 1 token"));
  if (o.max_batch < 1) return fail(invalid_argument("--max-batch must be at least 1"));
  if (o.rounds < 1 || o.rounds > 1000)
    return fail(invalid_argument("--rounds must be in [1, 1000]"));
  auto cap = parse_byte_size(o.kv_mem);
  if (!cap.ok()) return fail(cap.status().with_context("--kv-mem"));
  if (Status s = o.sampling.validate(); !s.ok()) return fail(s);
  AttnSplit split = AttnSplit::kAuto;
  if (o.attn_split == "within")
    split = AttnSplit::kWithinSequence;
  else if (o.attn_split == "across")
    split = AttnSplit::kAcrossSequences;
  else if (o.attn_split != "auto")
    return fail(invalid_argument("--attn-split must be auto, within or across"));
  if (o.kv.empty() && !o.kv_mem_per_seq.empty()) {
    o.kv = {"full", "h2o", "streaming", "d2o"};  // each at the budget --kv-mem-per-seq gives
  } else if (o.kv.empty()) {
    const long budget = std::lround(0.2 * o.prompt);
    o.kv = {"full", "h2o:ratio=0.2", "streaming:budget=" + std::to_string(std::max(1L, budget)),
            "d2o:ratio=0.2"};
  }
  for (const std::string& spec : o.kv) {
    auto p = parse_kv_policy(spec);
    if (!p.ok()) return fail(p.status().with_context("--kv"));
  }
  const std::string text_path = o.text.empty() ? default_text_path() : o.text;
  std::ifstream in(text_path, std::ios::binary);
  if (!in)
    return fail(io_error("cannot read the prompt text '" + text_path + "' (give one with --text)"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();

  // Cache buffers above 64 KiB come from mmap and go back to the system when a sequence ends, so
  // RSS follows the live caches (glibc would otherwise raise the threshold and keep them).
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  // A step is max_batch decode rows + one chunk: one micro-batch must hold it (see scheduler.h).
  o.model.n_ubatch = std::max(o.model.n_ubatch, o.max_batch + o.chunk);
  auto loaded = load_all(o.model);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;
  EngineOptions eo;
  eo.n_ubatch = o.model.n_ubatch;
  eo.attn_split = split;
  l.engine = std::make_unique<Engine>(*l.model, *l.pool, eo);
  if (static_cast<int64_t>(o.prompt) + o.gen > l.n_ctx) {
    return fail(invalid_argument("--prompt + --gen (" + std::to_string(o.prompt + o.gen) +
                                 ") exceed the context of " + std::to_string(l.n_ctx) +
                                 " tokens (-c)"));
  }
  auto prompts = make_prompts(*l.tokenizer, text, o.requests, o.prompt);
  if (!prompts.ok()) return fail(prompts.status());

  std::printf(
      "d2o bench throughput: %d requests x (%d prompt + %d generated tokens), KV cap %s, %s KV, "
      "chunk %d, max batch %d, %d threads, attention split %s\n",
      o.requests, o.prompt, o.gen, format_bytes(static_cast<double>(*cap)).c_str(),
      kv_type_name(l.kv_type), o.chunk, o.max_batch, l.pool->n_threads(), attn_split_name(split));
  std::printf(
      "%s sampling%s; prompts: %s at %d offsets; weights %s\n",
      o.sampling.temperature > 0 ? "random" : "greedy",
      o.stop_at_eos
          ? ", stopping at end-of-generation tokens"
          : ", end-of-generation tokens ignored: every request generates exactly --gen tokens",
      text_path.c_str(), o.requests,
      format_bytes(static_cast<double>(l.model->weight_bytes())).c_str());
  std::fflush(stdout);

  std::vector<std::string> specs;
  for (const std::string& given : o.kv) {
    std::string spec = given;
    if (!o.kv_mem_per_seq.empty()) {
      int slots = 0;
      auto s =
          spec_for_kv_mem(given, o.kv_mem_per_seq, kv_cache_config(l.model->hparams(), l.kv_type),
                          l.model->hparams().n_ctx_train, &slots);
      if (!s.ok()) return fail(s.status());
      spec = *s;
    }
    specs.push_back(std::move(spec));
  }
  const int n_policy = static_cast<int>(specs.size());
  std::vector<PolicyRun> runs;  // in run order
  for (int k = 0; k < o.rounds; ++k) {
    for (int i = 0; i < n_policy; ++i) {
      const int p = k % 2 == 0 ? i : n_policy - 1 - i;  // reversed on odd rounds
      auto r = run_policy(l, o, specs[static_cast<size_t>(p)], *prompts, *cap);
      if (!r.ok()) return fail(r.status().with_context("--kv " + specs[static_cast<size_t>(p)]));
      r->policy = p;
      r->round = k;
      runs.push_back(std::move(r).value());
      const PolicyRun& pr = runs.back();
      std::fprintf(stderr, "  %s%s: %d done, %d refused in %.1f s\n", pr.spec.c_str(),
                   o.rounds > 1 ? (" (round " + std::to_string(k + 1) + ")").c_str() : "",
                   pr.completed, pr.refused, pr.seconds);
    }
  }
  // Tables in policy order, round by round.
  std::stable_sort(runs.begin(), runs.end(), [](const PolicyRun& a, const PolicyRun& b) {
    return a.policy != b.policy ? a.policy < b.policy : a.round < b.round;
  });
  auto label = [&](const PolicyRun& r) {
    return o.rounds > 1 ? r.spec + " #" + std::to_string(r.round + 1) : r.spec;
  };

  std::printf("\n%-22s %5s %4s %9s %6s %7s %9s %15s %15s %10s %10s %10s\n", "kv policy", "done",
              "ref", "gen tok/s", "x", "req/s", "batch", "tok lat p50/95", "req lat p50/95",
              "KV/req", "KV peak", "peak RSS");
  const double base = runs.front().seconds > 0 ? runs.front().gen_tokens / runs.front().seconds : 0;
  for (const PolicyRun& r : runs) {
    const double tps = tokens_per_s(r);
    char batch[32], tl[48], rl[48];
    std::snprintf(batch, sizeof batch, "%d/%.1f", r.batch_max, r.batch_mean);
    std::snprintf(tl, sizeof tl, "%.0f/%.0f ms", 1e3 * percentile(r.token_lat, 0.5),
                  1e3 * percentile(r.token_lat, 0.95));
    std::snprintf(rl, sizeof rl, "%.1f/%.1f s", percentile(r.req_lat, 0.5),
                  percentile(r.req_lat, 0.95));
    std::printf("%-22s %5d %4d %9.1f %6.2f %7.3f %9s %15s %15s %10s %10s %10s\n", label(r).c_str(),
                r.completed, r.refused, tps, base > 0 ? tps / base : 0.0,
                r.seconds > 0 ? r.completed / r.seconds : 0.0, batch, tl, rl,
                format_bytes(static_cast<double>(r.kv_per_request)).c_str(),
                format_bytes(static_cast<double>(r.kv_peak_allocated)).c_str(),
                format_bytes(static_cast<double>(r.rss_peak)).c_str());
  }
  for (const PolicyRun& r : runs) {
    if (r.round == 0 && !r.canonical.empty() && r.canonical != r.spec)
      std::printf("%s = %s\n", r.spec.c_str(), r.canonical.c_str());
  }
  for (const PolicyRun& r : runs) {
    if (r.round == 0 && !r.refusal.empty())
      std::printf("%s: %s\n", r.spec.c_str(), r.refusal.c_str());
  }
  std::printf("\n%-22s %10s %11s %10s %10s %12s\n", "kv policy", "matmul s", "attention s",
              "policy s", "other s", "policy / 1st");
  const double base_policy = runs.front().timings.policy_s;
  for (const PolicyRun& r : runs) {
    char rel[32] = "-";
    if (base_policy > 0) std::snprintf(rel, sizeof rel, "%.2f", r.timings.policy_s / base_policy);
    std::printf("%-22s %10.2f %11.2f %10.2f %10.2f %12s\n", label(r).c_str(), r.timings.matmul_s,
                r.timings.attention_s, r.timings.policy_s, r.timings.other_s, rel);
  }
  std::printf(
      "x = generated tokens/s relative to the first policy; batch = sequences running per step, "
      "max/mean; "
      "KV/req = reservation per request (peak footprint); KV peak = most KV bytes allocated at "
      "once; matmul ... other = the engine's time split (policy: the KV policy's compactions), "
      "policy / 1st = policy seconds over the first policy's%s\n",
      o.rounds > 1 ? " (its first round)" : "");

  // --rounds: each policy over the first, paired by round.
  nlohmann::json ratios = nlohmann::json::array();
  if (o.rounds > 1) {
    std::printf(
        "\n%-22s %22s %22s   (%d rounds, the order reversed every other round: mean ± "
        "standard error of the per-round ratios over the first policy)\n",
        "kv policy", "gen tok/s over 1st", "policy s over 1st", o.rounds);
    for (int p = 0; p < n_policy; ++p) {
      const std::vector<double> t = per_round_ratios(runs, p, o.rounds, tokens_per_s);
      const std::vector<double> q = per_round_ratios(runs, p, o.rounds, policy_seconds);
      const eval::MeanSe mt = eval::mean_se(t), mq = eval::mean_se(q);
      char a[48] = "-", b[48] = "-";
      if (!t.empty()) std::snprintf(a, sizeof a, "%.3f ± %.3f", mt.mean, mt.se);
      if (!q.empty()) std::snprintf(b, sizeof b, "%.3f ± %.3f", mq.mean, mq.se);
      std::printf("%-22s %22s %22s\n", specs[static_cast<size_t>(p)].c_str(), a, b);
      nlohmann::json jr;
      jr["kv"] = specs[static_cast<size_t>(p)];
      jr["tokens_per_s_ratio"] = {{"mean", mt.mean}, {"se", mt.se}, {"samples", t}};
      jr["policy_s_ratio"] = {{"mean", mq.mean}, {"se", mq.se}, {"samples", q}};
      ratios.push_back(std::move(jr));
    }
  }

  if (!o.json.empty()) {
    nlohmann::json j;
    j["config"] = {{"model", l.model->path()},
                   {"prompt_tokens", o.prompt},
                   {"gen_tokens", o.gen},
                   {"requests", o.requests},
                   {"kv_mem_bytes", *cap},
                   {"kv_type", kv_type_name(l.kv_type)},
                   {"chunk", o.chunk},
                   {"max_batch", o.max_batch},
                   {"threads", l.pool->n_threads()},
                   {"attn_split", attn_split_name(split)},
                   {"greedy", o.sampling.temperature <= 0},
                   {"ignore_eos", !o.stop_at_eos},
                   {"text", text_path},
                   {"rounds", o.rounds},
                   {"weights_bytes", l.model->weight_bytes()}};
    for (const PolicyRun& r : runs) j["runs"].push_back(to_json(r));
    if (o.rounds > 1) j["ratios"] = std::move(ratios);
    const std::string s = j.dump(2) + "\n";
    if (o.json == "-") {
      std::fwrite(s.data(), 1, s.size(), stdout);
    } else {
      std::ofstream out(o.json, std::ios::binary);
      if (!(out << s)) return fail(io_error("cannot write '" + o.json + "'"));
    }
  }
  return 0;
}

}  // namespace

Action add_bench_throughput_command(CLI::App& bench) {
  auto o = std::make_shared<ThroughputOptions>();
  CLI::App* sub = bench.add_subcommand("throughput",
                                       "Many requests at once under a KV memory cap: tokens/s, "
                                       "batch sizes, latency, memory per policy");
  add_model_options(sub, o->model, /*with_kv=*/false);
  add_sampling_options(sub, o->sampling);
  sub->add_option("--prompt", o->prompt, "Prompt tokens per request");
  sub->add_option("--gen", o->gen, "Tokens generated per request");
  sub->add_option("--requests", o->requests, "Number of requests");
  sub->add_option("--kv-mem", o->kv_mem, "KV memory cap, e.g. 512M, 2G (powers of 1024)");
  sub->add_option("--kv-mem-per-seq", o->kv_mem_per_seq,
                  "KV memory per sequence, e.g. 4M: each --kv policy's budget is the slots that "
                  "fit with --kv-type (its spec must not set ratio= or budget=); a request "
                  "reserves its peak, up to the budget plus one prompt chunk (--chunk; two where "
                  "layers' budgets vary, as D2O's)");
  sub->add_option(
      "--kv", o->kv,
      "KV policy spec (repeatable; default: full, h2o:ratio=0.2, streaming at the same budget, "
      "d2o:ratio=0.2)");
  sub->add_option("--chunk", o->chunk, "Prompt tokens per prefill pass");
  sub->add_option("--max-batch", o->max_batch, "Most sequences running at once");
  sub->add_option("--text", o->text,
                  "Text the prompts are cut from (default: cache/texts/kjv.txt)");
  sub->add_option("--json", o->json, "Write the results as JSON to this file ('-': stdout)");
  sub->add_option("--attn-split", o->attn_split,
                  "Attention threads: auto, within (a sequence) or across (sequences)");
  sub->add_flag("--stop-at-eos", o->stop_at_eos, "Stop a request at an end-of-generation token");
  sub->add_option("--rounds", o->rounds,
                  "Run the --kv list this many times (order reversed every other round) and "
                  "compare each policy with the first round by round (mean ± standard error)");
  return [o] { return run_throughput(*o); };
}

}  // namespace d2o::cli
