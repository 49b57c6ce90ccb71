// d2o eval niah: needle-in-a-haystack and passkey retrieval heatmaps (src/eval/niah.h).
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "cmd_eval.h"
#include "core/timer.h"
#include "eval/niah.h"
#include "runtime/kv_pool.h"

namespace d2o::cli {

namespace {

struct NiahOptions {
  EvalCommonOptions common;
  std::string tasks = "needle,passkey";
  std::string lengths;  // "" = powers of two from 1024, and the trained context
  std::string depths = "0,25,50,75,100";
  int trials = 1;
  double ratio = 0;
  int budget = 0;
  bool no_chat = false;
  std::string question = "before";  // before | after (src/eval/turns.h)
  int questions = 1;                // needle-task questions per context (after)
  PrefillOptions prefill;           // --kv-mem-per-seq, --chunk
};

int run_niah_cmd(NiahOptions& o) {
  if (o.ratio > 0 && o.budget > 0)
    return fail(invalid_argument("give --ratio or --budget, not both"));
  if (o.ratio < 0 || o.ratio > 1) return fail(invalid_argument("--ratio must be in (0, 1]"));
  if (o.budget < 0) return fail(invalid_argument("--budget must be positive"));
  const bool by_mem = !o.prefill.kv_mem_per_seq.empty();
  if (by_mem && (o.ratio > 0 || o.budget > 0))
    return fail(invalid_argument("give --kv-mem-per-seq or --ratio / --budget, not both"));
  if (by_mem) {
    auto cap = parse_byte_size(o.prefill.kv_mem_per_seq);
    if (!cap.ok()) return fail(cap.status().with_context("--kv-mem-per-seq"));
  }
  const std::string compression =
      by_mem         ? "kv-mem-per-seq=" + o.prefill.kv_mem_per_seq
      : o.budget > 0 ? "budget=" + std::to_string(o.budget)
                     : "ratio=" + ratio_label(o.ratio > 0 ? o.ratio : 0.2);
  std::vector<eval::NiahTask> tasks;
  for (const std::string& t : eval::split_list(o.tasks, ',')) {
    if (t == "needle") {
      tasks.push_back(eval::NiahTask::kNeedle);
    } else if (t == "passkey") {
      tasks.push_back(eval::NiahTask::kPasskey);
    } else {
      return fail(invalid_argument("--tasks: unknown task '" + t + "' (use needle, passkey)"));
    }
  }
  if (tasks.empty()) return fail(invalid_argument("--tasks: no task given"));
  if (o.common.quick) {
    if (o.lengths.empty()) o.lengths = "256,512";
    o.depths = "0,50,100";
    o.trials = 1;
  }
  auto depths_pct = parse_double_list(o.depths, "--depths");
  if (!depths_pct.ok()) return fail(depths_pct.status());
  std::vector<double> depths;
  for (double d : *depths_pct) {
    if (!(d >= 0 && d <= 100))
      return fail(
          invalid_argument("--depths: " + ratio_label(d) + " is not a percentage in [0, 100]"));
    depths.push_back(d / 100.0);
  }
  std::vector<int> lengths;
  if (!o.lengths.empty()) {
    auto l = parse_int_list(o.lengths, "--lengths");
    if (!l.ok()) return fail(l.status());
    lengths = *l;
  }
  auto hay = load_haystack(o.common.text);
  if (!hay.ok()) return fail(hay.status());
  auto setup = eval_setup(o.common, "", "d2o eval niah");
  if (!setup.ok()) return fail(setup.status());
  EvalSetup& s = *setup;
  const int n_ctx_train = s.loaded.model->hparams().n_ctx_train;
  if (lengths.empty()) {
    // Powers of two from 1K below the trained context, then the trained context less room for
    // the answer.
    for (int len = 1024; len < n_ctx_train - 16; len *= 2) lengths.push_back(len);
    lengths.push_back(n_ctx_train - 16);
  }
  for (int len : lengths) {
    if (len < 1) return fail(invalid_argument("--lengths must be positive"));
  }
  note_haystack(*hay, s.meta);
  const ChatTemplate* chat =
      (!o.no_chat && s.loaded.chat_template) ? &*s.loaded.chat_template : nullptr;
  auto shape = eval::parse_question_shape(o.question, o.questions);
  if (!shape.ok()) return fail(shape.status());
  auto builder = eval::NiahBuilder::create(*s.loaded.tokenizer, chat, hay->text, *shape);
  if (!builder.ok()) return fail(builder.status());
  s.meta.text_tokens = builder->haystack_tokens();

  eval::NiahParams p;
  p.tasks = tasks;
  p.lengths = lengths;
  p.depths = depths;
  p.trials = o.trials;
  p.compression = compression;
  p.seed = o.common.seed;
  p.n_ctx_train = n_ctx_train;
  p.kv_type = s.loaded.kv_type;
  p.shape = *shape;
  p.chunk = prefill_chunk_of(o.prefill);
  auto ps = policies_with_compression(eval_policies(o.common, all_policy_presets()), compression,
                                      o.prefill, s.loaded.model->hparams(), s.loaded.kv_type);
  if (!ps.ok()) return fail(ps.status());
  p.policies = std::move(ps).value();
  std::string len_list;
  for (int len : lengths) len_list += (len_list.empty() ? "" : ",") + std::to_string(len);
  s.meta.command += " --tasks " + o.tasks + " --lengths " + len_list + " --depths " + o.depths +
                    " --trials " + std::to_string(o.trials) +
                    (by_mem         ? std::string()
                     : o.budget > 0 ? " --budget " + compression.substr(compression.find('=') + 1)
                                    : " --ratio " + compression.substr(compression.find('=') + 1)) +
                    prefill_args(o.prefill) +
                    (o.no_chat ? " --no-chat" : "") + " --question " + o.question +
                    (o.questions > 1 ? " --questions " + std::to_string(o.questions) : "");
  double total = 0;
  for (int len : lengths)
    total +=
        static_cast<double>(len) * static_cast<double>(depths.size() * tasks.size()) * o.trials;
  Stopwatch sw;
  auto bar = make_progress(o.common, "eval niah", total);
  auto res = eval::run_niah(*s.loaded.engine, *s.loaded.tokenizer, *builder, p, bar.get());
  if (!res.ok()) return fail(res.status());
  bar->finish();
  s.meta.wall_seconds = sw.seconds();
  eval::NiahReportText text;
  text.haystack = hay->name;
  text.haystack_note = hay->note;
  text.chat_template = chat != nullptr;
  const eval::ReportFiles files{o.common.out_dir, o.common.name.empty() ? "niah" : o.common.name};
  if (Status st = eval::write_niah_report(*res, p, s.meta, text, files); !st.ok()) return fail(st);
  for (size_t pi = 0; pi < p.policies.size(); ++pi) {
    int k = 0, n = 0;
    for (const auto& oc : res->outcomes) k += oc.correct[pi], ++n;
    std::printf("%-12s %d/%d correct\n", p.policies[pi].label.c_str(), k, n);
  }
  print_report_paths(files);
  return 0;
}

}  // namespace

Action add_eval_niah(CLI::App* eval) {
  auto o = std::make_shared<NiahOptions>();
  CLI::App* sub = eval->add_subcommand(
      "niah", "Needle-in-a-haystack and passkey retrieval over lengths x depths");
  add_eval_common_options(
      sub, o->common,
      "Haystack for the needle task: a text file, or a directory of .txt files (default: the "
      "Paul Graham essays fetched by scripts/setup.sh, else the KJV text)");
  sub->add_option("--tasks", o->tasks, "Tasks: needle, passkey (comma-separated)");
  sub->add_option("--lengths", o->lengths,
                  "Context lengths in tokens (default: 1024, 2048, ... up to the trained context)");
  sub->add_option("--depths", o->depths, "Needle depths in percent of the context");
  sub->add_option("--trials", o->trials, "Trials per (length, depth) cell (different keys)")
      ->check(CLI::Range(1, 10000));
  sub->add_option("--ratio", o->ratio, "Compression ratio rho of the prompt (default 0.2)");
  sub->add_option("--budget", o->budget,
                  "Fixed budget in slots per KV head and layer instead of a ratio");
  add_prefill_options(sub, o->prefill, /*with_mem=*/true);
  sub->add_flag("--no-chat", o->no_chat,
                "Plain-text prompt even when the model has a chat template");
  add_question_options(sub, o->question, o->questions,
                       "the needle task holds one needle per question, passkey asks one");
  return [o] { return run_niah_cmd(*o); };
}

}  // namespace d2o::cli
