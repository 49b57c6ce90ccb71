// d2o eval summary: docs/research/results_full.md from the reports of one run (src/eval/summary.h).
#include <cstdio>

#include "cmd_eval.h"
#include "eval/summary.h"

namespace d2o::cli {

namespace {

struct SummaryCliOptions {
  std::string dir = "eval-results";
  std::string output;
  std::string notes;
  std::string image_prefix;
  std::string title = "Results";
};

int run_summary(const SummaryCliOptions& o) {
  eval::SummaryOptions so;
  so.dir = o.dir;
  so.image_prefix = o.image_prefix;
  so.title = o.title;
  if (!o.notes.empty()) {
    auto notes = eval::read_text_file(o.notes);
    if (!notes.ok()) return fail(notes.status().with_context("--notes"));
    so.notes = *notes;
  }
  auto md = eval::build_results_markdown(so);
  if (!md.ok()) return fail(md.status());
  const std::string out = o.output.empty() ? o.dir + "/summary.md" : o.output;
  if (Status s = eval::write_file(out, *md); !s.ok()) return fail(s);
  std::printf("summary: %s\n", out.c_str());
  return 0;
}

}  // namespace

Action add_eval_summary(CLI::App* eval) {
  auto o = std::make_shared<SummaryCliOptions>();
  CLI::App* sub = eval->add_subcommand(
      "summary", "Assemble a results page (verdicts, claims, reports) from a run's reports");
  sub->add_option("--dir", o->dir,
                  "Folder with ppl.json, fidelity.json, niah.json, ruler.json, ablate.json");
  sub->add_option("--output", o->output, "Markdown file to write (default: <dir>/summary.md)");
  sub->add_option("--notes", o->notes, "Hand-written Markdown to include after the verdicts");
  sub->add_option("--image-prefix", o->image_prefix,
                  "Prefix for image links (e.g. results/ when the page is one level up)");
  sub->add_option("--title", o->title, "Title of the page");
  return [o] { return run_summary(*o); };
}

}  // namespace d2o::cli
