// `d2o eval summary`: assembles docs/research/results_full.md (the long generated page) from the
// JSON and Markdown reports of one run of ppl, fidelity, niah, ruler and ablate (any subset
// present), and states D2O's standing against each baseline with its uncertainty:
//   - ppl: tail NLL of D2O minus the baseline, paired by position (batch-means standard error);
//   - fidelity: KL(full ‖ ·) of D2O minus the baseline, paired by sample (standard error over
//     samples), per ratio;
//   - niah: accuracy of D2O minus the baseline, paired by trial (standard error over trials);
//   - ruler: score of D2O minus the baseline per task (lengths pooled) and over all tasks,
//     paired by trial, as the ruler report computes it;
//   - ablate: the verdict on each of the paper's claims, as computed by the ablation report;
//   - fidelity_bytes (equal KV bytes): per bytes value, whether the best combination of eviction
//     and quantization beats every single method, as the fidelity report computes it.
// "wins" / "loses" when the paired difference exceeds two standard errors in D2O's favour /
// against it, "ties" otherwise. Then the direction of each result is compared with the paper's
// claim (method.md, "What the paper reports").
#pragma once

#include <string>

#include "d2o/status.h"

namespace d2o::eval {

struct SummaryOptions {
  // Folder with ppl.json, fidelity.json, fidelity_bytes.json, niah.json, ruler.json,
  // ablate.json (+ .md, .svg).
  std::string dir;
  std::string image_prefix;  // prepended to image links of the included reports ("results/")
  std::string notes;         // Markdown written by hand, included after the verdicts ("" = none)
  std::string title = "Results";
};

// The results page. Errors: no report found in dir, a report that does not parse.
Result<std::string> build_results_markdown(const SummaryOptions& o);

}  // namespace d2o::eval
