#include "eval/ablate.h"

#include <algorithm>
#include <cmath>

#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {

const std::vector<AblationVariant>& d2o_ablation_variants() {
  static const std::vector<AblationVariant> kVariants = {
      {"budget rule", "variance softmax (paper)", ""},
      {"budget rule", "reciprocal variance", "layers=reciprocal"},
      {"budget rule", "exp decay", "layers=exp"},
      {"budget rule", "uniform", "layers=uniform"},
      {"budget rule", "pyramid", "layers=pyramid"},
      {"merge", "on (paper)", ""},
      {"merge", "off (eviction only)", "merge=off"},
      {"merge weights", "weighted (paper)", ""},
      {"merge weights", "average", "merge=average"},
      {"similarity", "key (paper)", ""},
      {"similarity", "value", "sim=value"},
      {"similarity", "key+value", "sim=kv"},
      {"N:M", "3:1 (paper)", ""},
      {"N:M", "1:1", "heavy_recent=1:1"},
      {"N:M", "1:3", "heavy_recent=1:3"},
      {"beta", "0.5", "beta=0.5"},
      {"beta", "0.7 (paper)", ""},
      {"beta", "0.9", "beta=0.9"},
      {"reading", "paper text", ""},
      {"reading", "research code", "reading=research"},
      // Diagnosis: each piece in which readings differ, alone, then the baselines and the
      // combinations the pieces suggest. The paper makes no claim on these.
      {"merged score", "sum (default)", ""},
      {"merged score", "keep", "merged_score=keep"},
      {"merged score", "mean", "merged_score=mean"},
      {"merged score", "max", "merged_score=max"},
      {"merge space", "after RoPE (paper)", ""},
      {"merge space", "before RoPE", "merge_keys=unrotated"},
      {"merge decision", "per head (paper)", ""},
      {"merge decision", "per token (research code)", "merge_decision=per_token"},
      {"query heads", "sum (paper)", ""},
      {"query heads", "max (union)", "agg=max"},
      {"query heads", "mean", "agg=mean"},
      {"protected layers", "none (paper)", ""},
      {"protected layers", "0, 1, L-1 (charged)", "keep_edge_layers=on"},
      {"merge mass", "one token (paper)", ""},
      {"merge mass", "proportional attention", "proportional_attention=on"},
      {"merge mass", "size-weighted merge", "merge=sized"},
      {"merge mass", "both", "proportional_attention=on,merge=sized"},
      {"heavy-hitter score", "accumulated attention (paper)", ""},
      {"heavy-hitter score", "mean attention (RoCo)", "norm=queries"},
      {"baselines", "d2o (paper)", ""},
      {"baselines", "h2o", "@h2o"},
      {"baselines", "streaming", "@streaming"},
      {"baselines", "snapkv", "@snapkv"},
      {"baselines", "roco", "@roco"},
      {"combinations", "d2o (paper)", ""},
      {"combinations", "eviction only, uniform, 1:1", "merge=off,layers=uniform,heavy_recent=1:1"},
      {"combinations", "mass, sized, uniform",
       "proportional_attention=on,merge=sized,layers=uniform"},
      {"combinations", "mass, sized, uniform, pre-RoPE",
       "proportional_attention=on,merge=sized,layers=uniform,merge_keys=unrotated"},
      {"combinations", "mass, sized, uniform, 1:1",
       "proportional_attention=on,merge=sized,layers=uniform,heavy_recent=1:1"},
      {"combinations", "mass, sized, pre-RoPE, uniform, 1:1",
       "proportional_attention=on,merge=sized,merge_keys=unrotated,layers=uniform,"
       "heavy_recent=1:1"},
      {"combinations", "mass, sized, uniform, 1:1, mean attention",
       "proportional_attention=on,merge=sized,layers=uniform,heavy_recent=1:1,norm=queries"},
  };
  return kVariants;
}

const std::vector<AblationGroup>& d2o_ablation_groups() {
  static const std::vector<AblationGroup> kGroups = {
      {"budget rule",
       "inverse-variance softmax > reciprocal variance > exponential decay > uniform",
       {"variance softmax (paper)", "reciprocal variance", "exp decay", "uniform"}},
      {"merge",
       "merging evicted tokens improves on dropping them",
       {"on (paper)", "off (eviction only)"}},
      {"merge weights", "weighted merge > average merge", {"weighted (paper)", "average"}},
      {"similarity",
       "key similarity > value similarity > key-and-value",
       {"key (paper)", "value", "key+value"}},
      {"N:M", "N:M = 3:1 is best", {"3:1 (paper)", "1:1"}},
      {"beta", "beta = 0.7 is best in [0.5, 0.9]", {"0.7 (paper)", "0.5"}},
      {"reading",
       "none (the research code differs from the paper text; both are reproducible)",
       {}},
      {"merged score", "none (the paper does not say what a merged slot's score becomes)", {}},
      {"merge space", "none (keys are merged as cached, after RoPE)", {}},
      {"merge decision", "none (the paper decides per head; the research code per token)", {}},
      {"query heads", "none (scores of a KV head sum its query heads)", {}},
      {"protected layers", "none (the research code never compresses layers 0, 1 and L-1)", {}},
      {"merge mass", "none (a merged slot counts as one token in attention)", {}},
      {"heavy-hitter score", "none (a slot's attention summed over the queries that saw it)", {}},
      {"baselines", "D2O beats StreamingLLM and H2O at ρ = 0.2 (LongBench)", {}},
      {"combinations", "none (variants beyond the paper)", {}},
  };
  return kGroups;
}

Result<AblationPlan> plan_ablation(double rho) {
  if (!(rho > 0 && rho <= 1)) return invalid_argument("--ratio must be in (0, 1]");
  AblationPlan plan;
  plan.ratio = fmt_num("%g", rho);
  for (const AblationVariant& v : d2o_ablation_variants()) {
    // "@name": another policy at the same ratio (a baseline row).
    const bool other = !v.keys.empty() && v.keys[0] == '@';
    // Every variant is one change to the paper's D2O (or a reading of its own).
    const std::string d2o =
        v.keys.find("reading=") != std::string::npos ? "d2o:" : "d2o:reading=paper,";
    const std::string spec =
        other ? v.keys.substr(1) + ":ratio=" + plan.ratio
              : d2o + "ratio=" + plan.ratio + (v.keys.empty() ? "" : "," + v.keys);
    const std::string label =
        v.keys.empty() ? "d2o (paper defaults)" : other ? v.keys.substr(1) : v.keys;
    D2O_ASSIGN_OR_RETURN(PolicyUnderTest t, make_policy(spec, label));
    int found = -1;
    for (size_t i = 0; i < plan.cases.size(); ++i) {
      if (plan.cases[i].policy.spec == t.spec) found = static_cast<int>(i);
    }
    if (found < 0) {
      plan.cases.push_back({t.label, plan.ratio, t});
      found = static_cast<int>(plan.cases.size() - 1);
    }
    plan.variant_case.push_back(found);
  }
  // beta=0.7 and heavy_recent=3:1 are the defaults: their rows map to the default case above.
  return plan;
}

namespace {

// Paired difference a - b over samples (same sample order).
MeanSe paired(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return mean_se(d);
}

std::vector<double> dnll_of(const FidelityCaseResult& c) {
  std::vector<double> d(c.nll.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = c.nll[i] - c.nll_full[i];
  return d;
}

}  // namespace

Status write_ablation_report(const FidelityResult& r, const FidelityParams& p,
                             const AblationPlan& plan, const RunMeta& meta,
                             const ReportFiles& files) {
  D2O_RETURN_IF_ERROR(ensure_dir(files.dir));
  const auto& variants = d2o_ablation_variants();
  const int def = plan.variant_case[0];  // the paper defaults
  const FidelityCaseResult& base = r.cases[static_cast<size_t>(def)];
  int h2o = -1;  // the H2O baseline row, when the plan has one
  for (size_t i = 0; i < variants.size(); ++i) {
    if (variants[i].keys == "@h2o") h2o = plan.variant_case[i];
  }
  nlohmann::json j;
  j["protocol"] = "ablate";
  j["description"] =
      "D2O ablations measured with the fidelity protocol at one ratio. Paired differences to the "
      "paper defaults "
      "over the same samples (mean ± standard error of the per-sample differences). A claim 'a "
      "better than b' is "
      "supported when KL(b) - KL(a) > 2 SE, contradicted when < -2 SE, otherwise not resolved.";
  j["meta"] = to_json(meta);
  j["params"] = {{"ratio", plan.ratio},
                 {"prompt_len", p.prompt_len},
                 {"n_samples", p.n_samples},
                 {"n_continue", p.n_continue}};
  if (p.bos >= 0) j["params"]["bos"] = p.bos;
  j["seconds"] = r.seconds;
  j["offsets"] = r.offsets;
  auto case_of = [&](const std::string& group, const std::string& value) -> int {
    for (size_t i = 0; i < variants.size(); ++i) {
      if (variants[i].group == group && variants[i].value == value) return plan.variant_case[i];
    }
    return -1;
  };
  nlohmann::json jv = nlohmann::json::array();
  std::string md = "# D2O ablations (`d2o eval ablate`)\n\n";
  md += "Fidelity protocol at ρ = " + plan.ratio + ": model `" + meta.model_name + "`, text `" +
        meta.text_name + "`, " + std::to_string(p.n_samples) + " samples × (prompt " +
        std::to_string(p.prompt_len) + " + " + std::to_string(p.n_continue) +
        " teacher-forced tokens" + (p.bos >= 0 ? "; each window starts with BOS" : "") +
        "). Every variant is D2O with one setting changed from "
        "the paper defaults, except in the groups *baselines* (other policies at the same ratio) "
        "and *combinations* (several settings changed). KL and top-1 are against the full cache (mean ± SE over samples); *Δ "
        "KL vs default* "
        "is paired over the same samples (± SE of the paired differences), so it resolves smaller "
        "differences than "
        "the per-variant intervals suggest.\n\n";
  for (const AblationGroup& g : d2o_ablation_groups()) {
    md += "## " + g.name + "\n\nPaper: " + g.claim + ".\n\n";
    std::vector<std::vector<std::string>> rows;
    for (size_t i = 0; i < variants.size(); ++i) {
      if (variants[i].group != g.name) continue;
      const int ci = plan.variant_case[i];
      const FidelityCaseResult& c = r.cases[static_cast<size_t>(ci)];
      const MeanSe kl = mean_se(c.kl), top1 = mean_se(c.top1), dn = mean_se(dnll_of(c));
      const MeanSe dkl = paired(c.kl, base.kl);
      const std::string& spec = p.cases[static_cast<size_t>(ci)].policy.spec;
      std::vector<std::string> row = {variants[i].value, "`" + spec + "`",
                                      fmt_pm(kl.mean, kl.se, 4),
                                      ci == def ? "0 (default)" : fmt_pm(dkl.mean, dkl.se, 4)};
      MeanSe dh{};
      std::string vh;
      if (h2o >= 0) {
        // Against H2O: "better" when KL is lower by more than two standard errors.
        dh = paired(c.kl, r.cases[static_cast<size_t>(h2o)].kl);
        vh = ci == h2o                           ? "-"
             : dh.se > 0 && dh.mean < -2 * dh.se ? "better"
             : dh.se > 0 && dh.mean > 2 * dh.se  ? "worse"
                                                 : "tie";
        row.push_back(ci == h2o ? "0 (h2o)" : fmt_pm(dh.mean, dh.se, 4) + " " + vh);
      }
      row.push_back(fmt_pm(100 * top1.mean, 100 * top1.se, 1));
      row.push_back(fmt_pm(dn.mean, dn.se, 4));
      rows.push_back(row);
      jv.push_back({{"group", g.name},
                    {"value", variants[i].value},
                    {"spec", spec},
                    {"kl", kl.mean},
                    {"kl_se", kl.se},
                    {"delta_kl_vs_default", dkl.mean},
                    {"delta_kl_vs_default_se", dkl.se},
                    {"top1", top1.mean},
                    {"top1_se", top1.se},
                    {"delta_nll", dn.mean},
                    {"delta_nll_se", dn.se},
                    {"per_sample_kl", c.kl}});
      if (h2o >= 0) {
        jv.back()["delta_kl_vs_h2o"] = dh.mean;
        jv.back()["delta_kl_vs_h2o_se"] = dh.se;
        jv.back()["vs_h2o"] = vh;
      }
    }
    std::vector<std::string> head = {"variant", "spec", "KL (nats)", "Δ KL vs default"};
    if (h2o >= 0) head.push_back("Δ KL vs h2o");
    head.push_back("top-1 %");
    head.push_back("Δ NLL (nats)");
    md += md_table(head, rows) + "\n";
    // Verdicts on the claimed order, pair by pair.
    for (size_t k = 0; k + 1 < g.claimed_order.size(); ++k) {
      const int a = case_of(g.name, g.claimed_order[k]);
      const int b = case_of(g.name, g.claimed_order[k + 1]);
      if (a < 0 || b < 0) continue;
      const MeanSe d =
          paired(r.cases[static_cast<size_t>(b)].kl, r.cases[static_cast<size_t>(a)].kl);
      std::string verdict = "not resolved";
      if (d.se > 0 && d.mean > 2 * d.se) verdict = "supported";
      if (d.se > 0 && d.mean < -2 * d.se) verdict = "contradicted";
      if (d.se == 0 && d.mean == 0) verdict = "no difference";
      md += "- claim *" + g.claimed_order[k] + "* better than *" + g.claimed_order[k + 1] +
            "*: KL(" + g.claimed_order[k + 1] + ") − KL(" + g.claimed_order[k] +
            ") = " + fmt_pm(d.mean, d.se, 4) + " → **" + verdict + "**\n";
      j["verdicts"].push_back({{"group", g.name},
                               {"better", g.claimed_order[k]},
                               {"worse", g.claimed_order[k + 1]},
                               {"kl_difference", d.mean},
                               {"se", d.se},
                               {"verdict", verdict}});
    }
    if (g.name == "N:M" || g.name == "beta") {
      // "Best of three": also compare the default with the third value.
      const std::string third = g.name == "N:M" ? "1:3" : "0.9";
      const int a = case_of(g.name, g.claimed_order[0]), b = case_of(g.name, third);
      if (a >= 0 && b >= 0) {
        const MeanSe d =
            paired(r.cases[static_cast<size_t>(b)].kl, r.cases[static_cast<size_t>(a)].kl);
        std::string verdict = "not resolved";
        if (d.se > 0 && d.mean > 2 * d.se) verdict = "supported";
        if (d.se > 0 && d.mean < -2 * d.se) verdict = "contradicted";
        md += "- claim *" + g.claimed_order[0] + "* better than *" + third + "*: KL(" + third +
              ") − KL(" + g.claimed_order[0] + ") = " + fmt_pm(d.mean, d.se, 4) + " → **" +
              verdict + "**\n";
        j["verdicts"].push_back({{"group", g.name},
                                 {"better", g.claimed_order[0]},
                                 {"worse", third},
                                 {"kl_difference", d.mean},
                                 {"se", d.se},
                                 {"verdict", verdict}});
      }
    }
    md += "\n";
  }
  j["variants"] = jv;
  // KL per step for every distinct variant.
  LineChart chart;
  chart.title = "D2O ablations: KL(full ‖ variant) per step, ρ = " + plan.ratio;
  chart.x_label = "continuation step after compression";
  chart.y_label = "KL, nats (mean over samples)";
  for (size_t i = 0; i < p.cases.size(); ++i) {
    LineSeries s;
    s.name = p.cases[i].row;
    const auto& ks = r.cases[i].kl_by_step;
    for (size_t t = 0; t < ks.size(); ++t) {
      s.x.push_back(static_cast<double>(t + 1));
      s.y.push_back(ks[t]);
    }
    chart.series.push_back(s);
  }
  chart.width = 820;
  const std::string svg = files.name + "_kl.svg";
  D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_line_chart(chart)));
  md += "![KL per step of every variant](" + svg + ")\n\nWall time " + format_duration(r.seconds) +
        ".\n";
  D2O_RETURN_IF_ERROR(write_file(files.path(".json"), j.dump(1) + "\n"));
  D2O_RETURN_IF_ERROR(write_file(files.path(".md"), md));
  return {};
}

}  // namespace d2o::eval
