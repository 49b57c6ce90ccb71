// `d2o eval ablate`: D2O's ablations as the paper tabulates them, each measured with the
// fidelity protocol (src/eval/fidelity.h) at one compression ratio.
//
// Groups (method.md, "Ablations"; the paper's claimed order, best first, where it gives one):
//   budget rule   variance softmax > reciprocal > exp decay > uniform; pyramid also run
//   merge         on (weighted) vs off (plain eviction): merging helps
//   merge weights weighted > average
//   similarity    key > value > key+value
//   N:M           3:1 best of 3:1, 1:1, 1:3
//   beta          0.7 best of 0.5, 0.7, 0.9
//   reading       the paper's text vs the authors' research code (no claim)
// and the diagnosis of why D2O loses on small models (no claims): merged score (sum, keep, mean,
// max), merge space (after or before RoPE), merge decision (per head or per token), query-head
// aggregation, protected layers, merge mass (proportional attention, size-weighted merges),
// heavy-hitter score (accumulated or mean attention), baselines at the same ratio (H2O,
// StreamingLLM, SnapKV, RoCo; a row's Δ KL vs h2o gives D2O's standing) and combinations of the
// fixes.
// Every variant is D2O with one key changed from the paper defaults, except the baselines
// ("@name" keys: another policy) and the combinations; identical specs run once.
// All variants see the same samples, so differences are paired: the report gives each variant's
// difference to the default with the standard error of the paired per-sample differences, and
// checks each adjacent pair of the paper's order: "supported" when the paired difference is
// more than two standard errors in the claimed direction, "contradicted" when it is more than two
// the other way, "not resolved" otherwise.
#pragma once

#include <string>
#include <vector>

#include "d2o/status.h"
#include "eval/fidelity.h"

namespace d2o::eval {

struct AblationVariant {
  std::string group;  // "budget rule", ...
  std::string value;  // "variance softmax (paper)", ...
  std::string keys;   // appended to "d2o:" ("" = the defaults), e.g. "layers=reciprocal"
};

struct AblationGroup {
  std::string name;
  std::string claim;                       // the paper's claim, in words
  std::vector<std::string> claimed_order;  // values, best first ("" entries: none)
};

const std::vector<AblationVariant>& d2o_ablation_variants();
const std::vector<AblationGroup>& d2o_ablation_groups();

// The fidelity cases of the ablation at ratio rho: one per distinct spec (row = the spec,
// column = the ratio). `variant_case[i]` is the case of variant i.
struct AblationPlan {
  std::vector<FidelityCase> cases;
  std::vector<int> variant_case;
  std::string ratio;
};
Result<AblationPlan> plan_ablation(double rho);

// Writes <name>.json and <name>.md (one table per group, the paired differences to the default,
// the verdict on each of the paper's claims) and <name>_kl.svg (KL per step of every variant).
Status write_ablation_report(const FidelityResult& r, const FidelityParams& p,
                             const AblationPlan& plan, const RunMeta& meta,
                             const ReportFiles& files);

}  // namespace d2o::eval
