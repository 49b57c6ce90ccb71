// d2o eval ablate: D2O's ablations measured with the fidelity protocol (src/eval/ablate.h).
#include <cstdio>

#include "cmd_eval.h"
#include "core/timer.h"
#include "eval/ablate.h"
#include "eval/stats.h"

namespace d2o::cli {

namespace {

struct AblateOptions {
  EvalCommonOptions common;
  double ratio = 0.2;
  TeacherForcedOptions tf;
};

int run_ablate_cmd(AblateOptions& o) {
  if (!o.common.policies.empty()) {
    return fail(
        invalid_argument("--policies does not apply to ablate (the variants are D2O's ablations)"));
  }
  const std::string text_path = o.common.text.empty() ? default_text_path() : o.common.text;
  if (o.common.quick) shrink_for_quick(o.tf);
  auto plan = eval::plan_ablation(o.ratio);
  if (!plan.ok()) return fail(plan.status());
  auto setup = eval_setup(o.common, text_path, "d2o eval ablate");
  if (!setup.ok()) return fail(setup.status());
  EvalSetup& s = *setup;
  auto skipped = tokens_after_skip(s.tokens, o.tf.skip);
  if (!skipped.ok()) return fail(skipped.status());
  const std::span<const TokenId> toks = *skipped;
  eval::FidelityParams p;
  p.cases = plan->cases;
  p.prompt_len = o.tf.prompt;
  p.n_samples = o.tf.samples;
  p.n_continue = o.tf.cont;
  p.kv_type = s.loaded.kv_type;
  p.n_ctx_train = s.loaded.model->hparams().n_ctx_train;
  if (s.loaded.tokenizer->add_bos()) p.bos = s.loaded.tokenizer->bos();
  s.meta.command += " --ratio " + plan->ratio + teacher_forced_args(o.tf);
  Stopwatch sw;
  auto bar =
      make_progress(o.common, "eval ablate", static_cast<double>(p.n_samples) * p.n_continue);
  auto res = eval::run_fidelity(*s.loaded.engine, toks, p, bar.get());
  if (!res.ok()) return fail(res.status());
  bar->finish();
  s.meta.wall_seconds = sw.seconds();
  const eval::ReportFiles files{o.common.out_dir, o.common.name.empty() ? "ablate" : o.common.name};
  if (Status st = eval::write_ablation_report(*res, p, *plan, s.meta, files); !st.ok())
    return fail(st);
  for (size_t i = 0; i < p.cases.size(); ++i) {
    std::printf("%-24s KL %.4f  top-1 %.3f\n", p.cases[i].row.c_str(),
                eval::mean_se(res->cases[i].kl).mean, eval::mean_se(res->cases[i].top1).mean);
  }
  print_report_paths(files);
  return 0;
}

}  // namespace

Action add_eval_ablate(CLI::App* eval) {
  auto o = std::make_shared<AblateOptions>();
  CLI::App* sub = eval->add_subcommand(
      "ablate", "D2O's ablations (budget rule, merging, similarity, N:M, beta, reading)");
  add_eval_common_options(sub, o->common,
                          "Text file the samples are taken from (default: the KJV text)");
  sub->add_option("--ratio", o->ratio, "Compression ratio rho for every variant");
  add_teacher_forced_options(sub, o->tf, "Number of prompts (text windows)");
  return [o] { return run_ablate_cmd(*o); };
}

}  // namespace d2o::cli
