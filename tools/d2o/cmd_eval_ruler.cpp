// d2o eval ruler: RULER-style synthetic tasks over lengths, many trials per cell
// (src/eval/ruler.h).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cmd_eval.h"
#include "core/timer.h"
#include "eval/kv_bytes.h"
#include "eval/ruler.h"
#include "kv/policy/composed.h"
#include "model/layer_desc.h"
#include "runtime/kv_pool.h"

namespace d2o::cli {

namespace {

// --bytes: every (policy, storage type) as a policy of its own. RULER's prompts vary in length,
// so the share becomes a ratio per storage type (share x F16 slot bytes / the type's slot bytes,
// exact for models whose layers are all compressible), held through the answer (SnapKV and
// PyramidKV with hold_budget=on); "full" runs in each type as it is. The full F16 reference
// ("full") is added by the caller's list as usual.
Result<std::vector<eval::PolicyUnderTest>> bytes_policies(const std::vector<std::string>& bases,
                                                          double share, const std::string& kv_types,
                                                          const ModelHParams& hp, KvType run) {
  std::vector<KvType> types = {run};
  if (!kv_types.empty()) {
    D2O_ASSIGN_OR_RETURN(types, parse_kv_type_list(kv_types));
  }
  std::vector<eval::PolicyUnderTest> out;
  for (const std::string& given : bases) {
    std::vector<KvType> mine = types;
    D2O_ASSIGN_OR_RETURN(const std::string base, split_policy_type(given, hp.head_dim, mine));
    if (base == "full" && given == "full") {
      // The reference, in the run's storage type.
      D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest t, eval::make_policy("full", "full"));
      out.insert(out.begin(), t);
      mine.erase(std::remove(mine.begin(), mine.end(), run), mine.end());
    }
    for (const KvType& type : mine) {
      if (Status st = check_kv_type(type, hp.head_dim); !st.ok())
        return st.with_context("--kv-types");
      const KvCacheConfig cfg = kv_cache_config(hp, type);
      if (cfg.has_sliding()) {
        return invalid_argument(
            "ruler --bytes: this model has sliding-window layers, whose bytes "
            "a ratio does not set; use `eval fidelity --bytes`");
      }
      const std::string label = base + " [" + kv_type_name(type) + "]";
      std::string spec = base;
      if (eval::spec_preset(base) != "full") {
        const double r =
            std::min(1.0, share * static_cast<double>(eval::kv_slot_bytes(eval::f16_config(cfg))) /
                              static_cast<double>(eval::kv_slot_bytes(cfg)));
        // Six decimals, rounded down: the printed ratio never asks for more than the share.
        D2O_ASSIGN_OR_RETURN(
            spec, eval::spec_with_compression(
                      base, "ratio=" + eval::fmt_num("%.6f", std::floor(r * 1e6) / 1e6)));
      }
      D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest t, eval::make_policy(spec, label));
      const auto* composed = dynamic_cast<const ComposedPolicy*>(t.policy.get());
      if (composed && !composed->config().compacts_after_first()) {
        // A policy that compresses the prompt only (SnapKV, PyramidKV at a ratio) would grow by
        // the answer: hold_budget=on keeps it at the prompt's budget, as every other policy is.
        auto held = eval::make_policy(spec + ",hold_budget=on", label);
        if (!held.ok()) {
          return invalid_argument(
              "ruler --bytes holds every policy at its bytes while it "
              "answers (hold_budget=on); '" +
              given + "' does not allow it: " + held.status().message());
        }
        t = std::move(held).value();
      }
      t.kv_type = type;
      out.push_back(std::move(t));
    }
  }
  if (out.empty()) return invalid_argument("no policies to evaluate");
  return out;
}

constexpr const char* kAllTasks =
    "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe";

struct RulerOptions {
  EvalCommonOptions common;
  std::string tasks = kAllTasks;
  std::string lengths = "2048,4096,8192";
  int trials = 50;
  double ratio = 0;
  int budget = 0;
  double bytes = 0;      // > 0: equal KV bytes, a share of the F16 full cache's
  std::string kv_types;  // with --bytes: the storage types each policy runs in
  bool no_chat = false;
  std::string question = "before";  // before | after (src/eval/turns.h)
  int questions = 1;                // questions per context (after)
  PrefillOptions prefill;           // --kv-mem-per-seq, --chunk
  // Set when given on the command line (--quick shrinks only what was not given).
  CLI::Option *o_tasks = nullptr, *o_lengths = nullptr, *o_trials = nullptr, *o_policies = nullptr;
};

int run_ruler_cmd(RulerOptions& o) {
  if (o.ratio > 0 && o.budget > 0)
    return fail(invalid_argument("give --ratio or --budget, not both"));
  if (o.ratio < 0 || o.ratio > 1) return fail(invalid_argument("--ratio must be in (0, 1]"));
  if (o.budget < 0) return fail(invalid_argument("--budget must be positive"));
  if (o.bytes != 0 && (o.ratio > 0 || o.budget > 0))
    return fail(invalid_argument("give --ratio, --budget or --bytes, not two of them"));
  if (o.bytes != 0 && !(o.bytes > 0 && o.bytes <= 1))
    return fail(invalid_argument("--bytes must be in (0, 1]"));
  if (o.bytes == 0 && !o.kv_types.empty())
    return fail(invalid_argument("--kv-types needs --bytes"));
  const bool by_mem = !o.prefill.kv_mem_per_seq.empty();
  if (by_mem && (o.ratio > 0 || o.budget > 0 || o.bytes != 0))
    return fail(invalid_argument("give --kv-mem-per-seq or --ratio / --budget / --bytes, not two"));
  if (by_mem) {
    auto cap = parse_byte_size(o.prefill.kv_mem_per_seq);
    if (!cap.ok()) return fail(cap.status().with_context("--kv-mem-per-seq"));
  }
  if (o.common.quick) {
    // CI's smoke test: one cell, two trials, two policies, 512 tokens.
    if (o.o_tasks->count() == 0) o.tasks = "niah_single";
    if (o.o_lengths->count() == 0) o.lengths = "512";
    if (o.o_trials->count() == 0) o.trials = 2;
    if (o.o_policies->count() == 0) o.common.policies = "full;d2o";
  }
  const std::string compression =
      by_mem         ? "kv-mem-per-seq=" + o.prefill.kv_mem_per_seq
      : o.bytes > 0  ? "bytes=" + ratio_label(o.bytes) + " of the F16 full cache"
      : o.budget > 0 ? "budget=" + std::to_string(o.budget)
                     : "ratio=" + ratio_label(o.ratio > 0 ? o.ratio : 0.2);
  std::vector<eval::RulerTask> tasks;
  for (const std::string& t : eval::split_list(o.tasks, ',')) {
    auto task = eval::parse_ruler_task(t);
    if (!task.ok()) return fail(task.status());
    tasks.push_back(*task);
  }
  if (tasks.empty()) return fail(invalid_argument("--tasks: no task given"));
  auto lengths = parse_int_list(o.lengths, "--lengths");
  if (!lengths.ok()) return fail(lengths.status());
  for (int len : *lengths) {
    if (len < 1) return fail(invalid_argument("--lengths must be positive"));
  }
  auto hay = load_haystack(o.common.text);
  if (!hay.ok()) return fail(hay.status());
  auto setup = eval_setup(o.common, "", "d2o eval ruler");
  if (!setup.ok()) return fail(setup.status());
  EvalSetup& s = *setup;
  note_haystack(*hay, s.meta);
  const ChatTemplate* chat =
      (!o.no_chat && s.loaded.chat_template) ? &*s.loaded.chat_template : nullptr;
  auto shape = eval::parse_question_shape(o.question, o.questions);
  if (!shape.ok()) return fail(shape.status());
  auto builder = eval::RulerBuilder::create(*s.loaded.tokenizer, chat, hay->text, *shape);
  if (!builder.ok()) return fail(builder.status());
  s.meta.text_tokens = builder->haystack_tokens();

  eval::RulerParams p;
  p.tasks = tasks;
  p.lengths = *lengths;
  p.trials = o.trials;
  p.compression = compression;
  p.seed = o.common.seed;
  p.n_ctx_train = s.loaded.model->hparams().n_ctx_train;
  p.kv_type = s.loaded.kv_type;
  p.head_dim = s.loaded.model->hparams().head_dim;
  p.shape = *shape;
  p.chunk = prefill_chunk_of(o.prefill);
  std::vector<std::string> bases = eval_policies(o.common, all_policy_presets());
  bool has_full = false;
  for (const std::string& b : bases) has_full = has_full || b == "full";
  if (!has_full) {
    // Scores are reported as a share of the full cache's: it always runs.
    bases.insert(bases.begin(), "full");
  }
  if (o.bytes > 0) {
    auto ps =
        bytes_policies(bases, o.bytes, o.kv_types, s.loaded.model->hparams(), s.loaded.kv_type);
    if (!ps.ok()) return fail(ps.status());
    p.policies = std::move(ps).value();
  }
  if (o.bytes == 0) {
    auto ps = policies_with_compression(bases, compression, o.prefill, s.loaded.model->hparams(),
                                        s.loaded.kv_type);
    if (!ps.ok()) return fail(ps.status());
    p.policies = std::move(ps).value();
  }
  std::string pol_list;
  for (const std::string& b : bases) pol_list += (pol_list.empty() ? "" : ";") + b;
  s.meta.command += " --tasks " + o.tasks + " --lengths " + o.lengths + " --trials " +
                    std::to_string(o.trials) + " --policies \"" + pol_list + "\"" +
                    (by_mem ? std::string()
                     : o.bytes > 0
                         ? " --bytes " + ratio_label(o.bytes) +
                               (o.kv_types.empty() ? "" : " --kv-types " + o.kv_types)
                     : o.budget > 0 ? " --budget " + std::to_string(o.budget)
                                    : " --ratio " + compression.substr(compression.find('=') + 1)) +
                    prefill_args(o.prefill) +
                    (o.no_chat ? " --no-chat" : "") + " --question " + o.question +
                    (o.questions > 1 ? " --questions " + std::to_string(o.questions) : "");
  double total = 0;
  for (int len : p.lengths)
    total += static_cast<double>(len) * static_cast<double>(tasks.size()) * o.trials;
  Stopwatch sw;
  auto bar = make_progress(o.common, "eval ruler", total);
  auto res = eval::run_ruler(*s.loaded.engine, *s.loaded.tokenizer, *builder, p, bar.get());
  if (!res.ok()) return fail(res.status());
  bar->finish();
  s.meta.wall_seconds = sw.seconds();
  eval::RulerReportText text;
  text.haystack = hay->name;
  text.haystack_note = hay->note;
  text.chat_template = chat != nullptr;
  const eval::ReportFiles files{o.common.out_dir, o.common.name.empty() ? "ruler" : o.common.name};
  if (Status st = eval::write_ruler_report(*res, p, s.meta, text, files); !st.ok()) return fail(st);
  auto mean_score = [&](size_t pi) {
    double sum = 0;
    for (const auto& oc : res->outcomes) sum += oc.scores[pi];
    return res->outcomes.empty() ? 0.0 : sum / static_cast<double>(res->outcomes.size());
  };
  double full_mean = 0;
  for (size_t pi = 0; pi < p.policies.size(); ++pi) {
    if (p.policies[pi].label == "full") full_mean = mean_score(pi);
  }
  for (size_t pi = 0; pi < p.policies.size(); ++pi) {
    const double mean = mean_score(pi);
    std::printf("%-12s score %5.1f%%  (%s of the full cache's)\n", p.policies[pi].label.c_str(),
                100 * mean,
                full_mean > 0 ? eval::fmt_num("%.1f%%", 100 * mean / full_mean).c_str() : "-");
  }
  print_report_paths(files);
  return 0;
}

}  // namespace

Action add_eval_ruler(CLI::App* eval) {
  auto o = std::make_shared<RulerOptions>();
  CLI::App* sub = eval->add_subcommand(
      "ruler", "RULER-style synthetic tasks (niah variants, variable tracking, cwe, fwe)");
  add_eval_common_options(
      sub, o->common,
      "Haystack: a text file, or a directory of .txt files (default: the Paul Graham essays "
      "fetched by scripts/setup.sh, else the KJV text)");
  o->o_policies = sub->get_option("--policies");
  o->o_tasks =
      sub->add_option("--tasks", o->tasks, std::string("Tasks, comma-separated: ") + kAllTasks);
  o->o_lengths = sub->add_option(
      "--lengths", o->lengths, "Lengths in tokens: the prompt plus the answer's budget, as RULER");
  o->o_trials = sub->add_option("--trials", o->trials, "Trials per (task, length) cell")
                    ->check(CLI::Range(1, 100000));
  sub->add_option("--ratio", o->ratio, "Compression ratio rho of the prompt (default 0.2)");
  sub->add_option("--budget", o->budget,
                  "Fixed budget in slots per KV head and layer instead of a ratio");
  sub->add_option("--bytes", o->bytes,
                  "Equal KV bytes instead of a ratio: a share of a full F16 cache's key and value "
                  "bytes; each policy in each --kv-types type keeps what fits (the ratio that "
                  "share gives in that type, to the nearest slot) until the answer ends "
                  "(snapkv and pyramidkv with hold_budget=on)");
  sub->add_option("--kv-types", o->kv_types,
                  "With --bytes: storage types each policy runs in, e.g. f16,q8_0,q4_0r "
                  "(POLICY@TYPE: that type only)");
  add_prefill_options(sub, o->prefill, /*with_mem=*/true);
  sub->add_flag("--no-chat", o->no_chat,
                "Plain-text prompt even when the model has a chat template");
  add_question_options(
      sub, o->question, o->questions,
      "niah and vt hold one needle set or chain per question, cwe and fwe ask one");
  return [o] { return run_ruler_cmd(*o); };
}

}  // namespace d2o::cli
