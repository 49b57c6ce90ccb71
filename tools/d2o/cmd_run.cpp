// d2o run: generate text from a prompt, streaming it, then report speed and memory.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "commands.h"
#include "common.h"
#include "core/mem.h"
#include "runtime/generator.h"

namespace d2o::cli {

namespace {

void print_time_split(std::FILE* f, const char* what, const EngineTimings& t) {
  const double total = std::max(t.matmul_s + t.attention_s + t.policy_s + t.other_s, 1e-12);
  std::fprintf(
      f,
      "time split, %s (%lld rows, %.2f s): matmul %.1f%%, attention %.1f%%, KV policy %.1f%% "
      "(%.3f ms per row), other %.1f%%\n",
      what, static_cast<long long>(t.rows), total, 100 * t.matmul_s / total,
      100 * t.attention_s / total, 100 * t.policy_s / total,
      t.rows > 0 ? 1e3 * t.policy_s / static_cast<double>(t.rows) : 0.0, 100 * t.other_s / total);
  if (t.reconstruct_rows > 0) {
    std::fprintf(
        f,
        "  of which the prompt's reconstruction (prompt_ranking=reconstruction): %lld rows, "
        "%.2f s (%.1f%%)\n",
        static_cast<long long>(t.reconstruct_rows), t.reconstruct_s, 100 * t.reconstruct_s / total);
  }
}

struct RunOptions {
  ModelOptions model;
  SamplerParams sampling;
  std::string prompt;
  std::string prompt_file;
  std::string prompt_tokens;  // comma-separated token ids instead of text
  int n_predict = 128;
  int chunk = 512;  // prompt tokens per pass (GenerateParams::prefill_chunk)
  std::vector<std::string> stop;
  bool chat = false;
  bool kv_report = false;
  bool timings = false;
  bool ignore_eos = false;
  bool parse_special = false;
};

int run_run(RunOptions& o) {
  if (o.n_predict < 1)
    return fail(
        invalid_argument("-n must be at least 1 (got " + std::to_string(o.n_predict) + ")"));
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    if (!in) return fail(io_error("cannot read prompt file '" + o.prompt_file + "'"));
    std::stringstream ss;
    ss << in.rdbuf();
    o.prompt = ss.str();
  }
  if (o.prompt.empty() && o.prompt_tokens.empty()) {
    return fail(invalid_argument("no prompt: give -p TEXT, -f FILE or --prompt-tokens IDS"));
  }
  if (Status s = o.sampling.validate(); !s.ok()) return fail(s);

  auto loaded = load_all(o.model);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;

  std::string text = o.prompt;
  EncodeOptions enc;
  enc.parse_special = o.parse_special;
  if (o.chat) {
    if (!l.chat_template) return fail(invalid_argument("--chat: " + l.chat_template_error));
    text = l.chat_template->apply({{"user", o.prompt}}, /*add_generation_prompt=*/true);
    enc.parse_special = true;
  }
  Result<std::vector<TokenId>> ids = std::vector<TokenId>{};
  if (!o.prompt_tokens.empty()) {
    auto parsed = parse_token_list(o.prompt_tokens, l.model->hparams().n_vocab);
    if (!parsed.ok()) return fail(parsed.status().with_context("--prompt-tokens"));
    ids = std::move(parsed);
    auto shown = l.tokenizer->decode(*ids, /*render_special=*/true);
    o.prompt = shown.ok() ? *shown : std::string();
  } else {
    ids = l.tokenizer->encode(text, enc);
  }
  if (!ids.ok()) return fail(ids.status());
  if (ids->empty()) return fail(invalid_argument("the prompt produced no tokens"));
  if (static_cast<int64_t>(ids->size()) >= l.n_ctx) {
    return fail(invalid_argument(
        "the prompt has " + std::to_string(ids->size()) + " tokens, more than the context of " +
        std::to_string(l.n_ctx) + " tokens allows; use a larger -c (at most the model's " +
        std::to_string(l.model->hparams().n_ctx_train) + ") or a shorter prompt"));
  }

  Sequence seq(l.model->hparams(), l.kv_type, l.policy);
  // No layer ever holds more slots than the run has tokens (nor than the context): the cache's
  // geometric growth stops there instead of over-allocating by up to a quarter.
  int64_t most_tokens = std::min<int64_t>(l.n_ctx, static_cast<int64_t>(ids->size()) + o.n_predict);
  // --kv-mem-per-seq with a full cache: the memory is a hard cap (a longer run fails, saying so).
  if (l.kv_full_slots > 0) most_tokens = std::min<int64_t>(most_tokens, l.kv_full_slots);
  // A policy that reconstructs the prompt before compressing it holds one reconstruction pass
  // more, for a moment (KvPolicy::reconstruction_chunk).
  most_tokens += l.policy->reconstruction_chunk(seq.policy_state());
  if (Status s = seq.cache().set_slot_limit(static_cast<int>(most_tokens)); !s.ok()) return fail(s);
  GenerateParams gp;
  gp.n_predict = o.n_predict;
  gp.sampling = o.sampling;
  gp.stop = o.stop;
  gp.stop_at_eog = !o.ignore_eos;
  gp.max_positions = l.n_ctx;
  gp.prefill_chunk = o.chunk;
  if (o.chat && l.chat_template) {
    for (const std::string& s : l.chat_template->stop_strings()) gp.stop.push_back(s);
  }
  if (!o.chat) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    std::fflush(stdout);
  }
  // The engine's timings when the first generated text arrives: the prompt's share of the split.
  EngineTimings at_prompt;
  bool prompt_done = false;
  auto res = generate(*l.engine, *l.tokenizer, seq, *ids, gp, [&](std::string_view s) {
    if (!prompt_done) {
      at_prompt = l.engine->timings();
      prompt_done = true;
    }
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  });
  std::printf("\n");
  std::fflush(stdout);
  if (!res.ok()) return fail(res.status());

  const GenerateResult& r = *res;
  std::fprintf(stderr, "\n[kv %s, stop: %s]\n", l.policy->spec().c_str(), r.stop_reason.c_str());
  std::fprintf(stderr,
               "prompt: %d tokens in %.2f s (%.1f tok/s); generation: %zu tokens, %d passes in "
               "%.2f s (%.1f tok/s)\n",
               r.n_prompt, r.prompt_seconds, r.n_prompt / std::max(r.prompt_seconds, 1e-9),
               r.tokens.size(), r.n_decoded, r.decode_seconds,
               r.n_decoded / std::max(r.decode_seconds, 1e-9));
  std::fprintf(stderr, "%s\n", memory_summary(l, seq).c_str());
  if (o.kv_report) print_kv_report(stderr, seq, l.kv_mem_note);
  if (o.timings) {
    EngineTimings gen = l.engine->timings();
    if (!prompt_done) at_prompt = gen;
    gen.matmul_s -= at_prompt.matmul_s;
    gen.attention_s -= at_prompt.attention_s;
    gen.policy_s -= at_prompt.policy_s;
    gen.other_s -= at_prompt.other_s;
    gen.rows -= at_prompt.rows;
    gen.reconstruct_s -= at_prompt.reconstruct_s;
    gen.reconstruct_rows -= at_prompt.reconstruct_rows;
    print_time_split(stderr, "prompt", at_prompt);
    print_time_split(stderr, "generation", gen);
  }
  return 0;
}

}  // namespace

Action add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* sub = app.add_subcommand("run", "Generate text from a prompt");
  add_model_options(sub, o->model, /*with_kv=*/true);
  add_sampling_options(sub, o->sampling);
  sub->add_option("-p,--prompt", o->prompt, "Prompt text");
  sub->add_option("-f,--file", o->prompt_file, "Read the prompt from a file");
  sub->add_option("--prompt-tokens", o->prompt_tokens, "Prompt as comma-separated token ids");
  sub->add_option("-n,--n-predict", o->n_predict, "Tokens to generate (>= 1)");
  sub->add_option("--stop", o->stop, "Stop string (repeatable)");
  add_prefill_chunk_option(sub, o->chunk);
  sub->add_flag("--chat", o->chat,
                "Wrap the prompt as a user message in the model's chat template");
  sub->add_flag("--kv-report", o->kv_report,
                "Print per-layer KV budgets, slots, merges and thresholds");
  sub->add_flag("--timings", o->timings,
                "Print how the time split between matmul, attention, KV policy and the rest");
  sub->add_flag("--ignore-eos", o->ignore_eos, "Do not stop at end-of-generation tokens");
  sub->add_flag("--parse-special", o->parse_special,
                "Map special-token text in the prompt to special tokens");
  return [o] { return run_run(*o); };
}

}  // namespace d2o::cli
