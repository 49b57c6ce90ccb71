// d2o chat: an interactive conversation in the model's chat template. The conversation lives in
// one sequence whose KV cache (compressed by --kv) carries the history: each turn feeds only the
// new text, so a long chat with a compressed cache keeps bounded memory.
#include <cstdio>
#include <iostream>

#include "commands.h"
#include "common.h"
#include "runtime/generator.h"

namespace d2o::cli {

namespace {

struct ChatOptions {
  ModelOptions model;
  SamplerParams sampling;
  int n_predict = 512;
  int chunk = 512;  // prompt tokens per pass (GenerateParams::prefill_chunk)
  std::string system;
  std::string template_name;
  bool kv_report = false;
};

int run_chat(ChatOptions& o) {
  if (o.n_predict < 1) return fail(invalid_argument("-n must be at least 1"));
  if (Status s = o.sampling.validate(); !s.ok()) return fail(s);
  auto loaded = load_all(o.model);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;
  if (!o.template_name.empty()) {
    auto t = ChatTemplate::from_name(o.template_name);
    if (!t.ok()) return fail(t.status());
    l.chat_template = *t;
  }
  if (!l.chat_template) {
    return fail(invalid_argument("this model has no usable chat template (" +
                                 l.chat_template_error + "); pick one with --template"));
  }
  const ChatTemplate& tmpl = *l.chat_template;
  Sequence seq(l.model->hparams(), l.kv_type, l.policy);
  // The cache's geometric growth stops at the context instead of over-allocating past it.
  // (A policy that reconstructs the prompt holds one reconstruction pass more for a moment.)
  const int64_t limit = l.n_ctx + l.policy->reconstruction_chunk(seq.policy_state());
  if (Status s = seq.cache().set_slot_limit(static_cast<int>(limit)); !s.ok()) return fail(s);
  std::vector<ChatMessage> history;
  if (!o.system.empty()) history.push_back({"system", o.system});
  std::vector<TokenId> unfed;  // generated tokens not yet in the cache
  std::string rendered;        // the conversation text whose tokens are in the cache
  std::fprintf(stderr, "d2o chat (%s, kv %s). Commands: /reset, /kv, /quit.\n", tmpl.name(),
               l.policy->spec().c_str());

  std::string line;
  while (true) {
    std::fprintf(stdout, "\n> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line == "/quit" || line == "/exit") break;
    if (line == "/reset") {
      seq.reset();
      history.clear();
      if (!o.system.empty()) history.push_back({"system", o.system});
      unfed.clear();
      rendered.clear();
      std::fprintf(stderr, "(conversation reset)\n");
      continue;
    }
    if (line == "/kv") {
      print_kv_report(stderr, seq, l.kv_mem_note);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({"user", line});
    const std::string full = tmpl.apply(history, /*add_generation_prompt=*/true);
    std::string delta;
    if (full.compare(0, rendered.size(), rendered) == 0) {
      delta = full.substr(rendered.size());
    } else {
      // The template re-rendered earlier turns differently: start the cache over.
      seq.reset();
      unfed.clear();
      delta = full;
    }
    EncodeOptions enc;
    enc.parse_special = true;
    enc.add_special = !seq.started();
    auto ids = l.tokenizer->encode(delta, enc);
    if (!ids.ok()) return fail(ids.status());
    std::vector<TokenId> prompt = unfed;
    prompt.insert(prompt.end(), ids->begin(), ids->end());
    GenerateParams gp;
    gp.n_predict = o.n_predict;
    gp.sampling = o.sampling;
    gp.stop = tmpl.stop_strings();
    gp.max_positions = l.n_ctx;
    gp.prefill_chunk = o.chunk;
    const int64_t before = seq.n_past();
    auto res = generate(*l.engine, *l.tokenizer, seq, prompt, gp, [](std::string_view s) {
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::fflush(stdout);
    });
    if (!res.ok()) {
      std::fprintf(stderr, "\nd2o: error: %s\n", res.status().to_string().c_str());
      history.pop_back();
      if (res.status().code() == StatusCode::kInvalidArgument) continue;  // e.g. context full
      return 1;
    }
    std::fprintf(stdout, "\n");
    const size_t fed_gen = static_cast<size_t>(seq.n_past() - before) - prompt.size();
    unfed.assign(res->tokens.begin() + static_cast<ptrdiff_t>(fed_gen), res->tokens.end());
    history.push_back({"assistant", res->text});
    rendered = tmpl.apply(history, /*add_generation_prompt=*/false);
    // What the cache holds ends with the reply's tokens; the template's closing text for the
    // reply comes with the next turn's delta.
    const std::string with_reply_open = full + res->text;
    if (rendered.compare(0, with_reply_open.size(), with_reply_open) == 0)
      rendered = with_reply_open;
    std::fprintf(stderr, "[%zu tokens, %.1f tok/s, %lld in context]\n", res->tokens.size(),
                 res->n_decoded / std::max(res->decode_seconds, 1e-9),
                 static_cast<long long>(seq.n_past()));
    if (o.kv_report) print_kv_report(stderr, seq, l.kv_mem_note);
  }
  std::fprintf(stderr, "%s\n", memory_summary(l, seq).c_str());
  return 0;
}

}  // namespace

Action add_chat_command(CLI::App& app) {
  auto o = std::make_shared<ChatOptions>();
  CLI::App* sub = app.add_subcommand("chat", "Interactive chat in the model's chat template");
  add_model_options(sub, o->model, /*with_kv=*/true);
  add_sampling_options(sub, o->sampling);
  sub->add_option("-n,--n-predict", o->n_predict, "Maximum tokens per reply");
  add_prefill_chunk_option(sub, o->chunk);
  sub->add_option("--system", o->system, "System prompt");
  sub->add_option("--template", o->template_name,
                  "Force a chat format (chatml, llama3, mistral, gemma)");
  sub->add_flag("--kv-report", o->kv_report, "Print the KV report after each reply");
  return [o] { return run_chat(*o); };
}

}  // namespace d2o::cli
