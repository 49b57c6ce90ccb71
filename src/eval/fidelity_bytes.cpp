// The equal-bytes section of `d2o eval fidelity --bytes` (fidelity.h): which combination of
// eviction and KV quantization keeps the model closest to the full cache at the same KV bytes.
#include <algorithm>
#include <cmath>

#include "eval/fidelity.h"
#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {

namespace {

// A method as the comparison sees it. Single methods evict only (a policy in F16/F32 storage) or
// quantize only (a full cache in a quantized type); a combination evicts and quantizes.
enum class Kind { kFull, kEviction, kCombination };

bool kv_type_quantized(KvType t) {
  return kv_quantized(t.k) || kv_quantized(t.v);
}

// A budget at or above the context evicts nothing: the method is then the full cache in its type
// (quantization only), whatever its policy.
Kind kind_of(const FidelityParams& p, const FidelityResult& r, size_t i) {
  const bool evicts = r.cases[i].evicted > 0 || r.cases[i].merged > 0;
  if (p.cases[i].policy.policy->is_full() || !evicts) return Kind::kFull;
  return kv_type_quantized(case_kv_type(p, i)) ? Kind::kCombination : Kind::kEviction;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kFull:
      return "no eviction (quantization only)";
    case Kind::kEviction:
      return "eviction only";
    case Kind::kCombination:
      return "eviction + quantization";
  }
  return "";
}

bool on_axis(const FidelityParams& p, size_t i) {
  return p.cases[i].share > 0 || (p.cases[i].kv_type && p.cases[i].policy.policy->is_full());
}

MeanSe paired_by_sample(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = a[i] - b[i];
  return mean_se(d);
}

// Verdict on KL(single) - KL(combination): positive favours the combination.
std::string verdict(const MeanSe& d) {
  if (d.se == 0 && d.mean == 0) return "identical";
  if (d.se == 0) return "not resolved (one sample)";
  if (d.mean > 2 * d.se) return "**combination better**";
  if (d.mean < -2 * d.se) return "**combination worse**";
  return "not resolved";
}

std::string share_pct(double v) {
  return fmt_num("%.1f%%", 100 * v);
}

}  // namespace

Result<std::string> fidelity_bytes_section(const FidelityResult& r, const FidelityParams& p,
                                           const ReportFiles& files, nlohmann::json& j) {
  const size_t n = p.cases.size();
  std::vector<double> shares;  // the bytes values, in the order given
  for (size_t i = 0; i < n; ++i) {
    const double s = p.cases[i].share;
    if (s > 0 && std::find(shares.begin(), shares.end(), s) == shares.end()) shares.push_back(s);
  }
  bool any = !shares.empty();
  for (size_t i = 0; i < n; ++i) any = any || on_axis(p, i);
  if (!any) return std::string();
  const double f16 = r.f16_full_bytes_end;
  const double ctx = static_cast<double>(r.context_end);
  auto share_end = [&](size_t i) { return f16 > 0 ? r.cases[i].kv_bytes_end / f16 : 0.0; };
  const MeanSe zero{0, 0, 0};
  auto kl = [&](size_t i) { return i < n ? mean_se(r.cases[i].kl) : zero; };

  std::string md = "## At equal KV bytes\n\n";
  md +=
      "Each bytes value is a share of the key and value bytes of a full F16 cache holding the "
      "prompt (" +
      fmt_num("%.0f", f16 / ctx) +
      " bytes per token of context for this model). Every policy gets, in each storage type, the "
      "largest budget (slots per KV head and layer) whose key and value rows fit that share; "
      "quantized rows count with their block scales, slot metadata (the same 20 bytes per slot "
      "and KV head in every method) is not counted. A full cache in a quantized type holds what "
      "it holds: it is compared at the bytes values at least its share only. The share "
      "column is measured at the end of the continuation (a budgeted cache then holds the same "
      "bytes for a context longer than the prompt, hence a little under the target). KL is "
      "paired by sample: the difference to the best combination (eviction and quantization "
      "together) ± the standard error of the paired differences, resolved beyond two standard "
      "errors.\n\n";
  // Full caches in their own storage types: where they stand.
  for (size_t i = 0; i < n; ++i) {
    if (!p.cases[i].policy.policy->is_full() || !on_axis(p, i)) continue;
    std::string at;
    for (double s : shares) {
      if (share_end(i) <= s + 1e-9) at += (at.empty() ? "" : ", ") + share_pct(s);
    }
    md += "- `" + p.cases[i].row + "` holds " + share_pct(share_end(i)) +
          " of the F16 full cache's bytes: " +
          (at.empty() ? "above every bytes value of this run; it is on the chart only"
                      : "compared at " + at) +
          ".\n";
  }
  md += "\n";

  nlohmann::json jb = nlohmann::json::array();
  for (double s : shares) {
    std::vector<size_t> members;
    for (size_t i = 0; i < n; ++i) {
      if (p.cases[i].share == s)
        members.push_back(i);
      else if (p.cases[i].policy.policy->is_full() && on_axis(p, i) && share_end(i) <= s + 1e-9)
        members.push_back(i);
    }
    size_t best = n;
    for (size_t i : members) {
      if (kind_of(p, r, i) != Kind::kCombination) continue;
      if (best == n || kl(i).mean < kl(best).mean) best = i;
    }
    std::string label;
    for (size_t i : members) {
      if (p.cases[i].share == s) label = p.cases[i].column;
    }
    md += label.rfind("mem ", 0) == 0
              ? "### KV memory " + label.substr(4) +
                    " per sequence (keys, values and slot metadata; " + share_pct(s) +
                    " of the F16 full cache's key and value bytes for the prompt)\n\n"
              : "### Bytes = " + share_pct(s) + " of the F16 full cache\n\n";
    std::vector<std::vector<std::string>> rows;
    nlohmann::json jm = nlohmann::json::array();
    int singles = 0, beaten = 0;
    std::sort(members.begin(), members.end(),
              [&](size_t a, size_t b) { return kl(a).mean < kl(b).mean; });
    for (size_t i : members) {
      const Kind k = kind_of(p, r, i);
      const MeanSe m = kl(i), t1 = mean_se(r.cases[i].top1);
      std::string diff = "-", v = "-";
      MeanSe d;
      if (best < n && i != best) {
        d = paired_by_sample(r.cases[i].kl, r.cases[best].kl);
        diff = fmt_pm(d.mean, d.se, 4);
        if (k != Kind::kCombination) {
          v = verdict(d);
          ++singles;
          if (d.se > 0 && d.mean > 2 * d.se) ++beaten;
        }
      }
      if (i == best) v = "best combination";
      rows.push_back({"`" + p.cases[i].row + "`", kind_name(k),
                      k == Kind::kFull ? "all" : std::to_string(p.cases[i].budget),
                      share_pct(share_end(i)), fmt_pm(m.mean, m.se, 4),
                      fmt_pm(100 * t1.mean, 100 * t1.se, 1), diff, v});
      jm.push_back({{"row", p.cases[i].row},
                    {"kind", kind_name(k)},
                    {"kv_type", kv_type_name(case_kv_type(p, i))},
                    {"budget", p.cases[i].budget},
                    {"share_end", share_end(i)},
                    {"kl", m.mean},
                    {"kl_se", m.se},
                    {"kl_minus_best", d.mean},
                    {"kl_minus_best_se", d.se},
                    {"verdict", v}});
    }
    md += md_table({"method", "kind", "budget", "KV bytes (% of F16 full)", "KL ± SE",
                    "top-1 % ± SE", "KL − best combination", "verdict"},
                   rows) +
          "\n";
    const bool all = best < n && singles > 0 && beaten == singles;
    if (best < n) {
      md += "Best combination at " + share_pct(s) + ": `" + p.cases[best].row + "` (KL " +
            fmt_pm(kl(best).mean, kl(best).se, 4) + "); better than " + std::to_string(beaten) +
            " of " + std::to_string(singles) + " single methods beyond two standard errors: " +
            (all ? "**better than every single method**."
                 : "**not better than every single "
                   "method**.") +
            "\n\n";
    } else {
      md += "No combination of eviction and quantization ran at this value.\n\n";
    }
    jb.push_back({{"share", s},
                  {"column", label},
                  {"best_combination", best < n ? p.cases[best].row : ""},
                  {"singles", singles},
                  {"singles_beaten", beaten},
                  {"better_than_every_single", all},
                  {"methods", jm}});
  }
  j["bytes"] = {{"f16_full_bytes_per_token", f16 / ctx}, {"values", jb}};

  // Quality against bytes: one line per method (a row label), full caches as single points.
  LineChart chart;
  chart.title = "KL(full F16 ‖ method) against KV bytes";
  chart.x_label = "KV bytes per token of context (keys and values, end of continuation)";
  chart.y_label = "KL, nats per token (mean over samples)";
  std::vector<std::string> order;
  for (size_t i = 0; i < n; ++i) {
    if (on_axis(p, i) && std::find(order.begin(), order.end(), p.cases[i].row) == order.end())
      order.push_back(p.cases[i].row);
  }
  // One colour per policy, one dash per storage type: F16 / F32 solid, 8-bit dashed, 4-bit dotted.
  std::vector<std::string> policies;
  for (const std::string& row : order) {
    LineSeries ls;
    ls.name = row;
    const std::string policy = row.substr(0, row.rfind(" ["));
    auto at = std::find(policies.begin(), policies.end(), policy);
    if (at == policies.end()) at = policies.insert(policies.end(), policy);
    ls.colour = static_cast<int>(at - policies.begin());
    std::vector<std::pair<double, size_t>> pts;
    for (size_t i = 0; i < n; ++i) {
      if (on_axis(p, i) && p.cases[i].row == row) pts.push_back({r.cases[i].kv_bytes_end / ctx, i});
    }
    std::sort(pts.begin(), pts.end());
    for (const auto& [x, i] : pts) {
      const MeanSe m = kl(i);
      ls.x.push_back(x);
      ls.y.push_back(m.mean);
      ls.lo.push_back(m.mean - m.se);
      ls.hi.push_back(m.mean + m.se);
      const KvType t = case_kv_type(p, i);
      const bool q4 = t.k == KvElemType::kQ4_0 || t.v == KvElemType::kQ4_0;
      ls.dash = q4 ? "2 3" : kv_type_quantized(t) ? "7 4" : "";
    }
    chart.series.push_back(ls);
  }
  chart.height = std::max(420, 60 + 18 * static_cast<int>(chart.series.size()) + 60);
  chart.width = 860;
  chart.log_x = true;  // the bytes values are shares; full caches sit far to the right
  const std::string svg = files.name + "_bytes.svg";
  D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_line_chart(chart)));
  md +=
      "![KL against KV bytes per token](" + svg +
      ")\n\nOne colour per policy; solid: F16 (or F32), dashed: 8-bit (q8_0), dotted: 4-bit (q4_0, "
      "q4_0r); logarithmic bytes axis; bands: ± one standard error over samples.\n\n";
  return md;
}

}  // namespace d2o::eval
